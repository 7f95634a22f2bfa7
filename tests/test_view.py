"""The loader's internal read API (``snaploader._view.LoaderView``), which the
integrations use instead of the loader's private fields: where a loader stands, and its
state as of one batch back or as if its epoch had ended, each resuming exactly that.
And the mismatch a rank gets for another rank's state, which names Lightning's callback
whoever the caller (no Lightning needed: the loader never looks at its caller)."""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data.distributed import DistributedSampler

import snaploader
from snaploader._view import LoaderView

from ._datasets import Augmented
from ._support import assert_same_stream, epochs, generator, take, through_bytes

_BATCHES = 5  # 20 samples in batches of 4


def _loader(num_workers: int) -> snaploader.DataLoader:
    return snaploader.DataLoader(Augmented(20), batch_size=4, shuffle=True, num_workers=num_workers, generator=generator(3))


def _resumed(state: dict[str, Any], num_workers: int, count: int = 2) -> list[list[Any]]:
    loader = _loader(num_workers)
    loader.load_state_dict(through_bytes(state))
    return epochs(loader, count)


@pytest.fixture(scope="module", params=[0, 2], ids=["main-process", "two-workers"])
def workers(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def reference(workers: int) -> list[list[Any]]:
    return epochs(_loader(workers), 2)


def test_a_new_loader_stands_nowhere() -> None:
    view = LoaderView.of(_loader(0))
    assert (view.epoch, view.yielded, view.live, view.used) == (-1, 0, False, False)
    assert view.state_dict() == view.loader.state_dict()


def test_mid_epoch_the_view_and_its_states(workers: int, reference: list[list[Any]]) -> None:
    loader = _loader(workers)
    it = iter(loader)
    take(it, 3)
    view = LoaderView.of(loader)
    assert (view.epoch, view.yielded, view.live, view.used) == (0, 3, True, True)
    assert view.state_dict() == loader.state_dict()
    assert view.state_as_of(3) == loader.state_dict()
    # one batch back: the resumed stream starts again with batch 2
    back = _resumed(view.state_as_of(2), workers)
    assert_same_stream(back[0], reference[0][2:], "one batch back, epoch 0")
    assert_same_stream(back[1], reference[1], "one batch back, epoch 1")
    with pytest.raises(RuntimeError, match="as of batch 1 .* yielded 3 batches"):
        view.state_as_of(1)
    with pytest.raises(RuntimeError, match="after 3 of its 5 batches"):
        view.state_ending_epoch()
    del it


def test_at_the_last_batch_the_epoch_can_be_ended(workers: int, reference: list[list[Any]]) -> None:
    # A consumer that stops after the epoch's last batch without asking for one more
    # (Lightning after num_training_batches): the loader has not seen its epoch end.
    # Its next epoch is the one after an epoch whose sampler never ran dry: torch's
    # sampler iterator draws its end only when one more batch is asked for, and the next
    # epoch's order can depend on that draw (RandomSampler with the loader's generator).
    loader = _loader(workers)
    it = iter(loader)
    take(it, _BATCHES)
    view = LoaderView.of(loader)
    assert (view.yielded, view.live) == (_BATCHES, True)
    assert _resumed(view.state_dict(), workers, count=1) == [[]]  # the epoch's empty rest
    ended = _resumed(view.state_ending_epoch(), workers, count=1)
    del it
    uninterrupted = list(loader)
    assert_same_stream(ended[0], uninterrupted, "ended at its last batch: the next epoch")


def test_a_view_is_one_moment(workers: int, reference: list[list[Any]]) -> None:
    loader = _loader(workers)
    it = iter(loader)
    take(it, 2)
    view = LoaderView.of(loader)
    take(it, 2)  # the loader goes on; the view does not
    assert view.yielded == 2 and LoaderView.of(loader).yielded == 4
    assert_same_stream(_resumed(view.state_dict(), workers, count=1)[0], reference[0][2:], "view taken at batch 2")
    assert_same_stream(_resumed(view.state_as_of(1), workers, count=1)[0], reference[0][1:], "one batch back of the view")
    del it


def test_after_an_epoch_and_after_a_load(workers: int, reference: list[list[Any]]) -> None:
    loader = _loader(workers)
    list(loader)
    view = LoaderView.of(loader)
    assert (view.epoch, view.yielded, view.live, view.used) == (0, _BATCHES, False, True)
    assert view.state_ending_epoch() == loader.state_dict()  # nothing live to end
    it = iter(loader)
    take(it, 1)
    state = loader.state_dict()
    fresh = _loader(workers)
    fresh.load_state_dict(state)
    loaded = LoaderView.of(fresh)
    assert (loaded.epoch, loaded.yielded, loaded.live, loaded.used) == (1, 1, False, True)
    assert loaded.state_dict() == state
    assert_same_stream(list(fresh), reference[1][1:], "loaded at batch 1 of epoch 1")


# -- Lightning's fit loop hands rank 0's state to every rank --------------------------


def _ranked(rank: int) -> snaploader.DataLoader:
    sampler = DistributedSampler(Augmented(24), num_replicas=2, rank=rank, shuffle=True, seed=7)
    return snaploader.DataLoader(Augmented(24), batch_size=4, sampler=sampler, generator=generator(3))


def _load_as(module: str, loader: snaploader.DataLoader, state: dict[str, Any]) -> None:
    """``loader.load_state_dict(state)`` called from code of module ``module``."""
    namespace: dict[str, Any] = {"__name__": module}
    exec("def load(loader, state):\n    loader.load_state_dict(state)\n", namespace)
    namespace["load"](loader, state)


@pytest.mark.parametrize("caller", ["my_training_script", "lightning.pytorch.utilities.combined_loader"])
def test_rank0_state_given_to_another_rank_is_a_mismatch_that_names_lightnings_callback(caller: str) -> None:
    rank0 = _ranked(0)
    it = iter(rank0)
    take(it, 2)
    state = through_bytes(rank0.state_dict())
    del it
    rank1 = _ranked(1)
    # Lightning's fit loop without ExactResume gives rank 0's state to every rank: the
    # same error whoever calls, saying what to add, and the loader is left as it was.
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"(?s)distributed.*rank 1's loader, given rank 0's state.*ExactResume\(\)"):
        _load_as(caller, rank1, state)
    assert_same_stream(list(rank1), list(_ranked(1)), "rank 1 after the refused load")
    # Allowed knowingly, it resumes at rank 0's position with rank 1's own samples.
    allowed = _ranked(1)
    allowed.load_state_dict(state, allow_mismatch=("distributed",))
    own = list(_ranked(1))
    assert [batch[:, 0].tolist() for batch in allowed] == [batch[:, 0].tolist() for batch in own[2:]]


def test_another_runs_sampler_is_a_mismatch_without_the_lightning_hint() -> None:
    rank0 = _ranked(0)
    state = rank0.state_dict()
    other = snaploader.DataLoader(
        Augmented(24), batch_size=4, generator=generator(3),
        sampler=DistributedSampler(Augmented(24), num_replicas=2, rank=1, shuffle=True, seed=8),
    )
    with pytest.raises(snaploader.CheckpointMismatchError, match="distributed") as raised:
        _load_as("lightning.pytorch.utilities.combined_loader", other, state)
    assert "ExactResume" not in str(raised.value)
