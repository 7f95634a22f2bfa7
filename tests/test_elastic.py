"""Logical workers (docs/elastic.md): a checkpoint taken with W workers resumes exactly in
a loader with any num_workers P, each process hosting one or more logical workers.

Every test compares, with torch.equal, against the uninterrupted run with W workers:
the stream is a function of the logical workers, not of the processes."""

from __future__ import annotations

import json
import os
import random
import signal
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import snaploader
from snaploader import DataLoader, WorkerRespawnedWarning

from . import _iterable_datasets as ids
from ._datasets import Augmented, draws_in_init
from ._support import assert_same_stream, epochs, generator, mp_helpers, take  # noqa: F401  (mp_helpers: a fixture)

EPOCHS = 2
SEED = 11


class LogicalProbe(Augmented):
    """Augmented's random columns, plus what get_worker_info() says: [id, num_workers]
    (-1, -1 outside a worker)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        info = snaploader.get_worker_info()
        where = [-1.0, -1.0] if info is None else [float(info.id), float(info.num_workers)]
        return torch.cat([super().__getitem__(i), torch.tensor(where, dtype=torch.float64)])


def _map_loader(workers: int, logical: int | None = None, **kwargs: Any) -> DataLoader:
    return DataLoader(
        LogicalProbe(23), batch_size=3, shuffle=True, num_workers=workers, logical_workers=logical,
        worker_init_fn=draws_in_init, generator=generator(SEED), **kwargs,
    )


def _iterable_loader(workers: int, logical: int | None = None, **kwargs: Any) -> DataLoader:
    kind = kwargs.pop("kind", "IteratorStateStream")
    return DataLoader(
        getattr(ids, kind)(n=29), batch_size=2, num_workers=workers, logical_workers=logical,
        generator=generator(SEED), replay="allow", **kwargs,
    )


def _cut(make: Any, workers: int, epoch: int, cut: int, **kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """The batches before a cut after ``cut`` batches of ``epoch`` and the state there,
    through JSON (what a checkpoint on disk would give back)."""
    loader = make(workers, **kwargs)
    before = [batch for _ in range(epoch) for batch in loader]
    iterator = iter(loader)
    before += take(iterator, cut)
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    return before, state


def _resumed(make: Any, workers: int, logical: int | None, state: dict[str, Any], epoch: int, **kwargs: Any) -> list[Any]:
    loader = make(workers, logical, **kwargs)
    loader.load_state_dict(state)
    return [batch for _ in range(epoch, EPOCHS) for batch in loader]


def _random_cut(rng: random.Random, reference: list[list[Any]]) -> tuple[int, int]:
    epoch = rng.randrange(EPOCHS)
    return epoch, rng.randrange(len(reference[epoch]) + 1)


class _References:
    """The uninterrupted runs of one test, each computed once (a test checks one saved
    W against several process counts). Kept for one test only: batches from workers
    hold shared memory, which the leak check must not find after it."""

    def __init__(self) -> None:
        self.runs: dict[tuple[Any, ...], list[list[Any]]] = {}

    def of(self, make: Any, workers: int, **kwargs: Any) -> list[list[Any]]:
        key = (make, workers, *sorted(kwargs.items()))
        if key not in self.runs:
            self.runs[key] = epochs(make(workers, **kwargs), EPOCHS)
        return self.runs[key]


def _check(
    make: Any, saved_with: int, resumed_with: int, rng: random.Random, references: _References | None = None,
    resumed_options: dict[str, Any] | None = None, **kwargs: Any,
) -> None:
    """A cut at random of the W=saved_with run, resumed with num_workers=resumed_with
    keeping W logical workers: the whole run is the uninterrupted one. (W=0, torch's
    main-process contract, cannot be hosted by worker processes: resumed with some,
    the interrupted epoch ends as W=0's and the next epochs are their own.)"""
    references = references or _References()
    reference = references.of(make, saved_with, **kwargs)
    epoch, cut = _random_cut(rng, reference)
    keep = saved_with > 0 or resumed_with == 0
    if not keep:
        reference = reference[: epoch + 1] + references.of(make, resumed_with, **kwargs)[epoch + 1 :]
    before, state = _cut(make, saved_with, epoch, cut, **kwargs)
    after = _resumed(make, resumed_with, saved_with if keep else None, state, epoch, **kwargs, **(resumed_options or {}))
    assert_same_stream(before + after, [b for e in reference for b in e],
                       f"W={saved_with} -> num_workers={resumed_with}, cut {cut} of epoch {epoch}")


@pytest.mark.parametrize("saved_with", [0, 1, 2, 3, 4])
def test_map_style_resumes_exactly_with_any_num_workers(saved_with: int) -> None:
    rng, references = random.Random(saved_with), _References()
    for resumed_with in range(5):
        _check(_map_loader, saved_with, resumed_with, rng, references)


@pytest.mark.parametrize("kind", ["IteratorStateStream", "PlainStream"])
@pytest.mark.parametrize("saved_with", [0, 1, 2, 3, 4])
def test_iterable_resumes_exactly_with_any_num_workers(saved_with: int, kind: str) -> None:
    rng, references = random.Random(saved_with), _References()
    for resumed_with in range(5):
        _check(_iterable_loader, saved_with, resumed_with, rng, references, kind=kind)


@pytest.mark.parametrize("saved_with", [1, 2, 3, 4])
def test_persistent_workers_resume_exactly_with_other_process_counts(saved_with: int) -> None:
    # persistent_workers needs num_workers >= 1 on both sides
    rng, references = random.Random(saved_with), _References()
    for resumed_with in range(1, 5):
        _check(_map_loader, saved_with, resumed_with, rng, references, persistent_workers=True)
        _check(_iterable_loader, saved_with, resumed_with, rng, references, persistent_workers=True)


@pytest.mark.usefixtures("mp_helpers")
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_hosting_under_spawn_and_forkserver(context: str) -> None:
    rng = random.Random(5)
    # Only the resumed run, whose processes host several logical workers each (and make
    # their copies of the setup), runs under the start method; the reference and the
    # checkpoint come from fork, as in test_iterable.py's test_resume_under_spawn: the
    # resumed stream must join them exactly. A spawned or forkserver worker costs
    # seconds to start, at every epoch.
    resumed = {"multiprocessing_context": context}
    _check(_map_loader, 3, 2, rng, resumed_options=resumed)
    _check(_iterable_loader, 2, 1, rng, resumed_options=resumed)


def test_the_next_epoch_has_the_new_num_workers_by_default() -> None:
    # The interrupted epoch goes on with the checkpoint's 3 logical workers; the next
    # one is the epoch a loader built with num_workers=2 gives (torch's stream for 2).
    reference_3 = epochs(_map_loader(3), EPOCHS)
    reference_2 = epochs(_map_loader(2), EPOCHS)
    before, state = _cut(_map_loader, 3, 0, 4)
    after = _resumed(_map_loader, 2, None, state, 0)
    assert_same_stream(before + after, reference_3[0] + reference_2[1])
    assert [b[0, -1].item() for b in reference_2[1]] == [2.0] * len(reference_2[1])


def test_get_worker_info_reports_the_logical_worker_and_count() -> None:
    before, state = _cut(_map_loader, 4, 0, 1)
    loader = _map_loader(2, 4)
    loader.load_state_dict(state)
    rest = list(loader)
    for k, batch in enumerate(before + rest):
        assert batch[:, -2:].tolist() == [[float(k % 4), 4.0]] * len(batch), f"batch {k}"


def test_logical_workers_option_gives_torchs_stream_for_that_count() -> None:
    # Two processes hosting four logical workers yield torch's num_workers=4 stream.
    def make(cls: type[torch.utils.data.DataLoader], **kwargs: Any) -> torch.utils.data.DataLoader:
        return cls(LogicalProbe(23), batch_size=3, shuffle=True, worker_init_fn=draws_in_init,
                   generator=generator(SEED), **kwargs)

    ours = epochs(make(DataLoader, num_workers=2, logical_workers=4), EPOCHS)
    theirs = epochs(make(torch.utils.data.DataLoader, num_workers=4), EPOCHS)
    for epoch in range(EPOCHS):
        assert_same_stream(ours[epoch], theirs[epoch], f"epoch {epoch}")
    inline = epochs(make(DataLoader, num_workers=0, logical_workers=4), EPOCHS)
    assert_same_stream(inline[0] + inline[1], theirs[0] + theirs[1])


def test_a_respawned_process_restores_every_logical_worker_it_hosted() -> None:
    def make(workers: int, logical: int | None = None) -> DataLoader:
        return DataLoader(LogicalProbe(150), batch_size=3, shuffle=True, num_workers=workers,
                          logical_workers=logical, worker_init_fn=draws_in_init, generator=generator(SEED))

    reference = epochs(make(4), 1)[0]
    before, state = _cut(make, 4, 0, 2)
    loader = make(2, 4)
    loader.load_state_dict(state)
    iterator = iter(loader)
    got = take(iterator, 1)
    os.kill(iterator.worker_pids[1], signal.SIGKILL)  # it hosts logical workers 1 and 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got += list(iterator)
    assert any(issubclass(w.category, WorkerRespawnedWarning) for w in caught)
    assert_same_stream(before + got, reference)


def test_logical_workers_option_is_checked() -> None:
    with pytest.raises(ValueError, match="logical_workers should be an int from 0 to 1024"):
        DataLoader(LogicalProbe(4), logical_workers=-1)
    with pytest.raises(ValueError, match="cannot be hosted by num_workers=2"):
        DataLoader(LogicalProbe(4), num_workers=2, logical_workers=0)


class _Unpicklable(Dataset[int]):
    def __init__(self) -> None:
        self.lock = __import__("threading").Lock()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def test_hosting_an_uncopyable_dataset_is_a_clear_error() -> None:
    loader = DataLoader(_Unpicklable(), batch_size=1, num_workers=1, logical_workers=2)
    with pytest.raises(TypeError, match="each needs its own copy of the dataset"):
        next(iter(loader))


def test_the_checkpoint_records_the_logical_workers() -> None:
    loader = _map_loader(2, 4)
    iterator = iter(loader)
    take(iterator, 1)
    state = loader.state_dict()
    assert state["logical_workers"] == 4 and [w["worker"] for w in state["workers"]] == [0, 1, 2, 3]
    assert state["fingerprint"]["num_workers"] == 2


@pytest.mark.parametrize(("saved", "resumed"), [
    ({"num_workers": 2, "persistent_workers": True}, {"num_workers": 0}),
    ({"num_workers": 0}, {"num_workers": 2, "persistent_workers": True}),
    ({"num_workers": 2, "persistent_workers": True}, {"num_workers": 2}),
])
@pytest.mark.parametrize("make", [_map_loader, _iterable_loader])
def test_persistent_workers_is_no_mismatch_and_the_next_epoch_follows_the_new_loader(
    make: Any, saved: dict[str, Any], resumed: dict[str, Any]
) -> None:
    # The common elastic resume: a checkpoint of a persistent loader resumed on a laptop
    # with num_workers=0 (torch forbids persistent workers there), and back. The rest
    # of the interrupted epoch (the second: persistent workers carried the first's
    # states into it) is exact; the next epoch is the new loader's.
    saved, resumed = dict(saved), dict(resumed)
    workers = saved.pop("num_workers")
    reference = epochs(make(workers, **saved), 3)
    before, state = _cut(make, workers, 1, 3, **saved)
    loader = make(resumed.pop("num_workers"), None, **resumed)
    loader.load_state_dict(state)
    rest = list(loader)
    assert_same_stream(before + rest, reference[0] + reference[1], f"{saved} -> {loader.num_workers} workers")
    following = [list(loader) for _ in range(2)]
    assert all(len(epoch) == len(reference[2]) for epoch in following)
    if make is _map_loader:
        # get_worker_info() as the new loader gives it: None at 0, else its workers
        want = -1.0 if loader.num_workers == 0 else float(loader.num_workers)
        assert {b[j, -1].item() for epoch in following for b in epoch for j in range(len(b))} == {want}
