"""Skipping batches on resume (``load_state_dict(state, skip=N)`` / ``skip_to=k``, the
loss-spike rollback): what is skipped, what the rest of the stream is, that it is
deterministic, and that the next checkpoint records the skip."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import snaploader
from snaploader._format.checkpoint import resign

from ._datasets import Augmented, StatefulSampler
from ._iterable_datasets import PlainStream, ShuffleBufferStream
from ._support import assert_same, assert_same_stream, generator, take, through_bytes

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
    # A skipped batch's digest must never be compared with a batch that replaces it.
    pytest.mark.filterwarnings("error::snaploader.ResumeMismatchWarning"),
]

N_ITEMS, BATCH = 48, 2  # 24 batches an epoch


def map_loader(num_workers: int, **kwargs: Any) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        Augmented(N_ITEMS), batch_size=BATCH, shuffle=True, num_workers=num_workers,
        generator=generator(7), **kwargs,
    )


def checkpoint_at(loader: snaploader.DataLoader, k: int) -> dict[str, Any]:
    it = iter(loader)
    take(it, k)
    state = through_bytes(loader.state_dict())
    del it
    return state


def resumed(make: Any, state: dict[str, Any], epochs: int = 1, **skip: Any) -> list[list[Any]]:
    """The rest of the epoch and ``epochs - 1`` more, from ``state`` with ``skip``."""
    loader = make()
    loader.load_state_dict(state, **skip)
    return [list(loader) for _ in range(epochs)]


@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_map_skip_reads_on_in_order_and_each_worker_continues_its_rng(num_workers: int) -> None:
    uninterrupted_loader = map_loader(num_workers)
    full = [list(uninterrupted_loader) for _ in range(2)]
    k, skip = 5, 4
    state = checkpoint_at(map_loader(num_workers), k)
    rest, next_epoch = resumed(lambda: map_loader(num_workers), state, epochs=2, skip=skip)
    epoch0 = full[0]
    # The sample order of the remaining batches is the uninterrupted run's.
    assert len(rest) == len(epoch0) - k - skip
    for j, batch in enumerate(rest, start=k + skip):
        assert torch.equal(batch[:, 0], epoch0[j][:, 0]), f"batch {j}: other samples"
    # Each worker's RNG draws go on from its snapshot in the checkpoint: its m-th
    # batch after the resume has the augmentations its m-th batch after batch k had.
    slots = max(1, num_workers)
    for w in range(slots):
        after_skip = [rest[j - k - skip] for j in range(k + skip, len(epoch0)) if j % slots == w]
        uninterrupted = [epoch0[j] for j in range(k, len(epoch0)) if j % slots == w]
        for m, batch in enumerate(after_skip):
            assert_same(batch[:, 1:], uninterrupted[m][:, 1:], f"worker {w}'s batch {m} after the skip")
    if skip % slots:
        assert not torch.equal(rest[0][:, 1:], epoch0[k + skip][:, 1:])  # so the test can fail
    # The next epoch does not depend on the skip (non-persistent workers start afresh).
    assert_same_stream(next_epoch, full[1], "next epoch")


def test_map_skip_reads_no_skipped_sample() -> None:
    class Recording(Dataset[int]):
        def __init__(self) -> None:
            self.read: list[int] = []

        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> int:
            self.read.append(i)
            return i

    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(Recording(), batch_size=4, shuffle=True, generator=generator(3))

    full = [b.tolist() for b in make()]
    state = checkpoint_at(make(), 2)
    loader = make()
    loader.load_state_dict(state, skip=5)
    rest = [b.tolist() for b in loader]
    assert rest == full[7:]
    assert loader.dataset.read == [i for batch in full[7:] for i in batch]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_same_skip_gives_same_stream_and_its_checkpoints_resume_exactly(num_workers: int, persistent: bool) -> None:
    def make() -> snaploader.DataLoader:
        return map_loader(num_workers, persistent_workers=persistent)

    state = checkpoint_at(make(), 3)
    first = resumed(make, state, epochs=2, skip=6)
    second = resumed(make, state, epochs=2, skip_to=9)
    assert_same_stream(first[0] + first[1], second[0] + second[1], "same skip, fresh loaders")
    # A checkpoint taken between load_state_dict(skip=...) and iter() holds the skip...
    loader = make()
    loader.load_state_dict(state, skip=6)
    pending = through_bytes(loader.state_dict())
    assert pending["skip"] == 6 and state["skip"] == 0
    again = resumed(make, pending, epochs=2)
    assert_same_stream(again[0] + again[1], first[0] + first[1], "resumed from the pending skip")
    # ...and one taken after some batches of the skipped stream resumes it exactly,
    # including workers that had not produced a batch since the skip.
    for cut in (1, 4):
        loader = make()
        loader.load_state_dict(state, skip=6)
        it = iter(loader)
        head = take(it, cut)
        later = through_bytes(loader.state_dict())
        del it
        tail = resumed(make, later, epochs=2)
        assert_same_stream(head + tail[0] + tail[1], first[0] + first[1], f"resumed {cut} batches after the skip")


def test_skip_twice_adds_up_and_skip_from_an_ended_epoch_starts_the_next_one_later() -> None:
    two_epochs = map_loader(2)
    full = [list(two_epochs) for _ in range(2)]
    state = checkpoint_at(map_loader(2), 1)
    loader = map_loader(2)
    loader.load_state_dict(state, skip=2)
    loader.load_state_dict(through_bytes(loader.state_dict()), skip=3)
    rest = list(loader)
    assert [b[:, 0].tolist() for b in rest] == [b[:, 0].tolist() for b in full[0][6:]]

    loader = map_loader(2)
    list(loader)
    ended = through_bytes(loader.state_dict())
    loader = map_loader(2)
    loader.load_state_dict(ended, skip_to=20)
    assert [b[:, 0].tolist() for b in loader] == [b[:, 0].tolist() for b in full[1][20:]]


def test_skip_with_a_stateful_sampler_keeps_its_order() -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(Augmented(30), batch_size=3, sampler=StatefulSampler(30, 5), num_workers=2)

    full = list(make())
    state = checkpoint_at(make(), 2)
    assert state["sampler_state"] is not None
    rest = resumed(make, state, skip=3)[0]
    assert [b[:, 0].tolist() for b in rest] == [b[:, 0].tolist() for b in full[5:]]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stream", [PlainStream, ShuffleBufferStream])
def test_iterable_skip_is_the_uninterrupted_run_without_the_skipped_batches(num_workers: int, stream: Any) -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(stream(n=40), batch_size=2, num_workers=num_workers, generator=generator(1))

    two_epochs = make()
    full = [list(two_epochs) for _ in range(2)]
    state = checkpoint_at(make(), 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PlainStream's replay warning
        first = resumed(make, state, epochs=2, skip=5)
        second = resumed(make, state, epochs=2, skip_to=8)
        # A checkpoint taken after the skip resumes exactly too.
        loader = make()
        loader.load_state_dict(state, skip=5)
        it = iter(loader)
        head = take(it, 2)
        later = through_bytes(loader.state_dict())
        del it
        tail = resumed(make, later, epochs=2)
    assert_same_stream(first[0], full[0][8:], "rest of the epoch")
    assert_same_stream(first[1], full[1], "next epoch")
    assert_same_stream(second[0] + second[1], first[0] + first[1], "skip_to")
    assert_same_stream(head + tail[0] + tail[1], first[0] + first[1], "resumed after the skip")


def test_iterable_skip_across_a_worker_running_dry_follows_the_round_robin() -> None:
    # Worker 0 has 3 batches, worker 1 has 10: the skip passes worker 0's end.
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(
            ShuffleBufferStream(sizes=(6, 20)), batch_size=2, num_workers=2, generator=generator(4)
        )

    full = list(make())
    state = checkpoint_at(make(), 2)
    assert_same_stream(resumed(make, state, skip=6)[0], full[8:], "after a skip across worker 0's end")


def test_iterable_skip_past_the_end_ends_the_epoch_with_a_warning() -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(ShuffleBufferStream(n=20), batch_size=2, num_workers=2, generator=generator(2))

    two_epochs = make()
    full = [list(two_epochs) for _ in range(2)]
    state = checkpoint_at(make(), 4)
    loader = make()
    loader.load_state_dict(state, skip=50)
    with pytest.warns(UserWarning, match=r"asked for 50 batch\(es\) of epoch 0, but the epoch ended after 6"):
        assert list(loader) == []
    assert loader.state_dict()["skip"] == 0
    assert_same_stream(list(loader), full[1], "the next epoch, whole")


@pytest.mark.parametrize(
    ("skip", "message"),
    [
        ({"skip": 20}, r"skipping 20 batch\(es\) from batch 5 of epoch 0 goes past the epoch's end: it has 24 batches, 19 left"),
        ({"skip_to": 3}, r"skip_to=3 is before the checkpoint's position \(batch 5 of epoch 0\)"),
        ({"skip": 1, "skip_to": 9}, "not both"),
        ({"skip": -1}, r"skip should be an int >= 0 .* got -1"),
        ({"skip": True}, r"skip should be an int >= 0 .* got True"),
        ({"skip_to": 2.5}, r"skip_to should be None or an int >= 0 .* got 2.5"),
    ],
)
def test_bad_skips_are_refused_and_change_nothing(skip: dict[str, Any], message: str) -> None:
    state = checkpoint_at(map_loader(0), 5)
    loader = map_loader(0)
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state, **skip)
    assert loader.state_dict()["epoch"] == -1  # nothing was loaded


def test_skip_to_the_end_ends_the_epoch() -> None:
    state = checkpoint_at(map_loader(2), 5)
    loader = map_loader(2)
    loader.load_state_dict(state, skip_to=24)
    assert list(loader) == []
    assert loader.state_dict()["ended"]


def test_checkpoints_written_before_the_skip_fields_still_load() -> None:
    full = list(map_loader(2))
    state = checkpoint_at(map_loader(2), 5)
    old = {key: value for key, value in state.items() if key != "skip"}
    old["workers"] = [{k: v for k, v in ledger.items() if k != "skipped"} for ledger in state["workers"]]
    old["digest"] = resign(old)["digest"]
    assert_same_stream(resumed(lambda: map_loader(2), old)[0], full[5:], "an older checkpoint")


def test_an_edited_skip_is_refused() -> None:
    loader = map_loader(2)
    loader.load_state_dict(checkpoint_at(map_loader(2), 5), skip=2)
    state = loader.state_dict()
    state["skip"] = 0
    with pytest.raises(snaploader.CheckpointFormatError, match="digest"):
        map_loader(2).load_state_dict(state)


class _HeldGeneratorStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Draws from a generator object it holds: ``random.Random`` or NumPy's, by ``kind``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.rng: Any = random.Random(3) if kind == "random" else np.random.default_rng(3)

    def __iter__(self) -> Any:
        for i in range(40):
            yield torch.tensor([float(i), float(self.rng.random())])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("skip", [0, 2])
def test_a_workers_restore_error_is_raised_through_a_skip(num_workers: int, skip: int) -> None:
    # The checkpoint's generator objects differ from the ones the dataset holds now:
    # each worker's restore fails. A skip must not pass over that error as a batch.
    def make(kind: str) -> snaploader.DataLoader:
        return snaploader.DataLoader(_HeldGeneratorStream(kind), batch_size=2, num_workers=num_workers)

    state = checkpoint_at(make("random"), 3)
    loader = make("numpy")
    loader.load_state_dict(state, skip=skip)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replay warning
        with pytest.raises(snaploader.CheckpointFormatError, match="random.Random"):
            list(loader)
