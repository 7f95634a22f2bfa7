"""``loader.batches_remaining()``: the batches the epoch in progress still yields, for a
progress bar or an LR schedule after a restore (``len(loader)`` is the whole epoch).
Each count is checked against the batches the loader then actually yields."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Sampler

import snaploader

from ._datasets import Range
from ._iterable_datasets import MisreportedLength, PlainStream
from ._support import generator, take, through_bytes

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

N_ITEMS, BATCH = 22, 4  # 6 batches an epoch, the last one short (5 with drop_last)


def make(num_workers: int, **kwargs: Any) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        Range(N_ITEMS), batch_size=BATCH, shuffle=True, num_workers=num_workers,
        generator=generator(3), **kwargs,
    )


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_counts_down_through_an_epoch_and_restarts_at_the_next(num_workers: int, drop_last: bool) -> None:
    loader = make(num_workers, drop_last=drop_last)
    per_epoch = 5 if drop_last else 6
    assert len(loader) == per_epoch
    assert loader.batches_remaining() == per_epoch  # before the first epoch
    seen = []
    for _ in loader:
        seen.append(loader.batches_remaining())
    assert seen == list(range(per_epoch - 1, -1, -1))
    assert loader.batches_remaining() == per_epoch  # the epoch ended: the next is whole


def test_persistent_workers_count_each_epoch_afresh() -> None:
    loader = make(2, persistent_workers=True)
    for _ in range(2):
        it = iter(loader)
        take(it, 4)
        assert loader.batches_remaining() == 2
        assert len(list(it)) == 2
        assert loader.batches_remaining() == 6
    del it


@pytest.mark.parametrize("restore_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("cut", [0, 2, 5])
def test_after_a_restore_it_is_what_the_next_epoch_yields(cut: int, drop_last: bool, restore_workers: int) -> None:
    original = make(2, drop_last=drop_last)
    it = iter(original)
    take(it, min(cut, len(original)))
    state = through_bytes(original.state_dict())
    del it
    resumed = make(restore_workers, drop_last=drop_last)
    resumed.load_state_dict(state)
    remaining = resumed.batches_remaining()
    assert remaining == len(resumed) - min(cut, len(resumed))
    assert len(list(resumed)) == remaining


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_skip_is_counted(num_workers: int) -> None:
    original = make(num_workers)
    it = iter(original)
    take(it, 1)
    state = through_bytes(original.state_dict())
    del it
    resumed = make(num_workers)
    resumed.load_state_dict(state, skip=2)
    assert resumed.batches_remaining() == 3
    it = iter(resumed)
    next(it)
    assert resumed.batches_remaining() == 2
    assert len(list(it)) == 2


def test_a_checkpoint_taken_after_an_epoch_ended_leaves_the_whole_next_epoch() -> None:
    original = make(2)
    list(original)
    state = through_bytes(original.state_dict())
    resumed = make(2)
    resumed.load_state_dict(state)
    assert resumed.batches_remaining() == len(resumed) == len(list(resumed))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_out_of_order_yields_are_counted(num_workers: int) -> None:
    loader = make(num_workers, in_order=False)
    it = iter(loader)
    take(it, 3)
    assert loader.batches_remaining() == 3
    assert len(list(it)) == 3


class _Unsized(Sampler[int]):
    def __iter__(self) -> Any:
        return iter(range(N_ITEMS))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unknown_for_iterable_datasets_and_unsized_samplers(num_workers: int) -> None:
    stream = snaploader.DataLoader(PlainStream(12), batch_size=4, num_workers=num_workers)
    assert stream.batches_remaining() is None
    it = iter(stream)
    next(it)
    assert stream.batches_remaining() is None
    del it
    # even with a __len__: how many batches the workers' shards make is known at the end
    sized_stream = snaploader.DataLoader(MisreportedLength(12, 12), batch_size=4, num_workers=num_workers)
    assert len(sized_stream) == 3 and sized_stream.batches_remaining() is None
    unsized = snaploader.DataLoader(Range(N_ITEMS), batch_size=4, sampler=_Unsized(), num_workers=num_workers)
    assert unsized.batches_remaining() is None
    assert len(list(unsized)) == 6


def _count_down(loader: snaploader.DataLoader) -> tuple[int | None, list[int | None], int]:
    """The count before the next epoch, the counts after each of its batches, and how
    many batches it actually yields."""
    before, after, yielded = loader.batches_remaining(), [], 0
    for _ in loader:
        yielded += 1
        after.append(loader.batches_remaining())
    return before, after, yielded


# 22 items: 4 -> 6 and 6 -> 4 leave a short last batch of the new size, which drop_last
# drops; 4 -> 4 is the same topology.
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("old", "new"), [(4, 4), (4, 6), (6, 4)])
def test_a_resume_into_another_batch_size_counts_the_new_batches(old: int, new: int, drop_last: bool) -> None:
    original = snaploader.DataLoader(Range(N_ITEMS), batch_size=old, shuffle=True, num_workers=2,
                                     drop_last=drop_last, generator=generator(3))
    it = iter(original)
    take(it, 2)
    state = through_bytes(original.state_dict())
    del it
    resumed = snaploader.DataLoader(Range(N_ITEMS), batch_size=new, shuffle=True, num_workers=1,
                                    drop_last=drop_last, generator=generator(3))
    resumed.load_state_dict(state, allow_mismatch=("batch_size",))
    left = N_ITEMS - 2 * old
    expected = left // new if drop_last else -(-left // new)
    before, after, yielded = _count_down(resumed)
    assert before == yielded == expected
    assert after == list(range(expected - 1, -1, -1))
    assert resumed.batches_remaining() == len(resumed)  # the next epoch: whole, in the new size
    # a checkpoint taken one batch into the part counts the part too, loaded again
    middle = snaploader.DataLoader(Range(N_ITEMS), batch_size=new, shuffle=True, drop_last=drop_last, generator=generator(3))
    middle.load_state_dict(state, allow_mismatch=("batch_size",))
    it = iter(middle)
    take(it, 1)
    again = through_bytes(middle.state_dict())
    del it
    last = snaploader.DataLoader(Range(N_ITEMS), batch_size=new, shuffle=True, drop_last=drop_last, generator=generator(3))
    last.load_state_dict(again)
    assert last.batches_remaining() == expected - 1 == len(list(last))
    # a skip in the part is counted, and one past its end is refused
    skipped = snaploader.DataLoader(Range(N_ITEMS), batch_size=new, shuffle=True, drop_last=drop_last, generator=generator(3))
    with pytest.raises(ValueError, match="past the end|left"):
        skipped.load_state_dict(state, allow_mismatch=("batch_size",), skip=expected + 1)
    skipped.load_state_dict(state, allow_mismatch=("batch_size",), skip=1)
    assert skipped.batches_remaining() == expected - 1 == len(list(skipped))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_grown_dataset_counts_the_old_range_then_the_new_length(drop_last: bool) -> None:
    original = make(2, drop_last=drop_last)
    it = iter(original)
    take(it, 2)
    state = through_bytes(original.state_dict())
    del it
    grown = snaploader.DataLoader(Range(N_ITEMS + 9), batch_size=BATCH, shuffle=True, num_workers=2,
                                  drop_last=drop_last, generator=generator(3))
    grown.load_state_dict(state, allow_mismatch=("dataset_length",))
    assert len(grown) == (31 // BATCH if drop_last else -(-31 // BATCH))  # the whole epoch: the new length
    per_old_epoch = 5 if drop_last else 6
    before, after, yielded = _count_down(grown)
    assert before == yielded == per_old_epoch - 2
    assert after == list(range(yielded - 1, -1, -1))
    before, after, yielded = _count_down(grown)  # the next epoch, over the new length
    assert before == yielded == len(grown) and after[-1] == 0
