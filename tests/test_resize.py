"""A checkpoint resumed with another batch size or a dataset of another length
(docs/elastic.md, "Another batch size" and "A grown dataset"; ``_format/resize.py``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import snaploader
from snaploader import DataLoader

from ._datasets import Augmented, StatefulSampler
from ._support import generator, mp_helpers, take, through_bytes  # noqa: F401  (mp_helpers: a fixture)

SEED = 3


def _loader(batch_size: int, workers: int = 0, n: int = 50, per_sample: bool = True, **kwargs: Any) -> DataLoader:
    kwargs.setdefault("shuffle", True)
    return DataLoader(
        Augmented(n), batch_size=batch_size, num_workers=workers, generator=generator(SEED),
        seed_per_sample=per_sample, **kwargs,
    )


def _rows(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [row for batch in batches for row in batch]


def _cut(loader: DataLoader, cut: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    iterator = iter(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 2-core worker-count warning
        before = take(iterator, cut)
    state = through_bytes(loader.state_dict())
    del iterator
    return before, state


# Every pair of sizes under fork, with and without per-sample seeds; under spawn the
# case that needs the most to travel (per-sample seeds, a growing batch): the spawn path
# differs only in how the workers get their setup, which one case covers.
_REBATCH_CASES = [
    (context, old, new, drop_last, per_sample)
    for old, new, drop_last in [(4, 6, False), (6, 4, True), (4, 5, True)]
    for per_sample in (True, False)
    for context in ("fork", "spawn")
    if context == "fork" or (old, new, per_sample) == (4, 6, True)
]


@pytest.mark.parametrize(("context", "old", "new", "drop_last", "per_sample"), _REBATCH_CASES)
def test_another_batch_size_resumes_with_every_sample_not_yet_yielded(
    mp_helpers: None, context: str, old: int, new: int, drop_last: bool, per_sample: bool
) -> None:
    reference = _rows(list(_loader(old, per_sample=per_sample)))
    before, state = _cut(_loader(old, 2, per_sample=per_sample, multiprocessing_context=context), 3)
    resumed = _loader(new, 3, per_sample=per_sample, drop_last=drop_last, multiprocessing_context=context)
    assert resumed.batch_size == new
    with pytest.raises(snaploader.CheckpointMismatchError, match="allow_mismatch=\\('batch_size',"):
        resumed.load_state_dict(state)
    resumed.load_state_dict(state, allow_mismatch=("batch_size", "drop_last"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = list(resumed)
        following = list(resumed)
    sizes = [len(batch) for batch in after]
    assert all(size == new for size in sizes[:-1]) and (not drop_last or sizes[-1] == new), sizes
    rows = _rows(before) + _rows(after)
    remaining = len(reference) - 3 * old
    expected = reference[: 3 * old + (remaining // new * new if drop_last else remaining)]
    # the interrupted run's order, none lost or repeated (but what drop_last drops)
    assert [int(row[0]) for row in rows] == [int(row[0]) for row in expected]
    if per_sample:
        for got, want in zip(rows, expected):
            assert torch.equal(got, want), f"sample {int(want[0])} differs"
    assert {len(batch) for batch in following[:-1]} == {new}  # the next epoch: the new size
    indices = [int(row[0]) for row in _rows(following)]
    assert len(set(indices)) == len(indices) == (len(reference) // new * new if drop_last else len(reference))


def test_a_checkpoint_of_a_rebatched_epoch_resumes_exactly() -> None:
    reference = _rows(list(_loader(4)))
    before, state = _cut(_loader(4, 2), 3)
    middle = _loader(6, 0)
    middle.load_state_dict(state, allow_mismatch=("batch_size",))
    iterator = iter(middle)
    mid = take(iterator, 2)
    again = through_bytes(middle.state_dict())
    del iterator
    assert again["item_offset"] == 12 and again["yielded"] == 2
    # into the same batch size, and into a third one
    for size, allow in ((6, ()), (7, ("batch_size",))):
        last = _loader(size, 1)
        last.load_state_dict(again, allow_mismatch=allow)
        rows = _rows(before) + _rows(mid) + _rows(list(last))
        assert len(rows) == len(reference)
        for got, want in zip(rows, reference):
            assert torch.equal(got, want)


def test_a_stateful_sampler_resumes_into_another_batch_size() -> None:
    def make(size: int) -> DataLoader:
        return DataLoader(Augmented(40), batch_size=size, sampler=StatefulSampler(40, seed=2),
                          generator=generator(SEED), seed_per_sample=True)

    reference = _rows(list(make(4)))
    before, state = _cut(make(4), 3)
    resumed = make(7)
    resumed.load_state_dict(state, allow_mismatch=("batch_size",))
    rows = _rows(before) + _rows(list(resumed))
    assert [int(row[0]) for row in rows] == [int(row[0]) for row in reference]
    assert all(torch.equal(a, b) for a, b in zip(rows, reference))


def test_another_batch_size_is_refused_where_it_cannot_be_exact() -> None:
    _, unordered = _cut(_loader(4, 2, in_order=False), 3)
    with pytest.raises(snaploader.CheckpointMismatchError, match="in_order=False"):
        _loader(6).load_state_dict(unordered, allow_mismatch=("batch_size",))
    _, state = _cut(_loader(4), 3)
    with pytest.raises(snaploader.CheckpointMismatchError, match="BatchSampler"):
        DataLoader(Augmented(50), batch_size=None, seed_per_sample=True,
                   generator=generator(SEED)).load_state_dict(state, allow_mismatch=("batch_size", "sampler"))


@pytest.mark.parametrize(
    ("context", "shuffle", "per_sample"),
    [("fork", True, True), ("fork", False, True), ("fork", True, False), ("spawn", True, True)],
)
def test_a_grown_dataset_finishes_the_old_epoch_then_uses_the_new_length(
    mp_helpers: None, context: str, shuffle: bool, per_sample: bool
) -> None:
    # Without per-sample seeds too: the old range's batches are the same batches, each
    # logical worker resuming from its own snapshot.
    reference = _rows(list(_loader(4, 2, n=30, shuffle=shuffle, per_sample=per_sample)))
    before, state = _cut(_loader(4, 2, n=30, shuffle=shuffle, per_sample=per_sample, multiprocessing_context=context), 3)
    grown = _loader(4, 2, n=40, shuffle=shuffle, per_sample=per_sample, multiprocessing_context=context)
    with pytest.raises(snaploader.CheckpointMismatchError, match="allow_mismatch=\\('dataset_length',\\)"):
        grown.load_state_dict(state)
    grown.load_state_dict(state, allow_mismatch=("dataset_length",))
    iterator = iter(grown)
    middle = take(iterator, 2)
    again = through_bytes(grown.state_dict())  # taken in the old-range epoch
    del iterator
    assert again["epoch_length"] == 30
    last = _loader(4, 1, n=40, shuffle=shuffle, per_sample=per_sample, logical_workers=2)
    last.load_state_dict(again)
    rows = _rows(before) + _rows(middle) + _rows(list(last))
    assert len(rows) == len(reference)
    for got, want in zip(rows, reference):
        assert torch.equal(got, want), f"sample {int(want[0])} differs"
    assert sorted(int(row[0]) for row in _rows(list(last))) == list(range(40))


def test_a_shrunk_dataset_or_a_custom_sampler_is_refused_mid_epoch() -> None:
    _, state = _cut(_loader(4, n=30), 3)
    with pytest.raises(snaploader.CheckpointMismatchError, match="the dataset shrank"):
        _loader(4, n=20).load_state_dict(state, allow_mismatch=("dataset_length",))
    custom = DataLoader(Augmented(40), batch_size=4, sampler=StatefulSampler(40, seed=2), generator=generator(SEED),
                        seed_per_sample=True)
    with pytest.raises(snaploader.CheckpointMismatchError, match="StatefulSampler"):
        custom.load_state_dict(state, allow_mismatch=("dataset_length", "sampler"))


def test_a_distributed_sampler_finishes_the_old_range() -> None:
    def make(n: int) -> DataLoader:
        sampler = DistributedSampler(Augmented(n), num_replicas=2, rank=1, seed=4)
        sampler.set_epoch(3)
        return DataLoader(Augmented(n), batch_size=3, sampler=sampler, generator=generator(SEED), seed_per_sample=True)

    reference = _rows(list(make(31)))
    before, state = _cut(make(31), 2)
    grown = make(45)
    grown.load_state_dict(state, allow_mismatch=("dataset_length", "distributed"))
    rows = _rows(before) + _rows(list(grown))
    assert [int(row[0]) for row in rows] == [int(row[0]) for row in reference]
    assert all(torch.equal(a, b) for a, b in zip(rows, reference))
