"""A checkpoint resumed into a loader of another ``batch_size`` or a dataset of another
length (``allow_mismatch=("batch_size",)`` / ``("dataset_length",)``; docs/elastic.md).

- **Another batch size** (map-style, torch's ``BatchSampler``): the rest of the
  interrupted epoch is the sampler's items from the first one not yet yielded, batched
  by the new size (``drop_last`` applying to the new batches). The epoch goes on as an
  *epoch part*: its batch 0 is the first new batch, ``item_offset`` counts the sampler
  items consumed before it, and each logical worker starts the part from the snapshot
  after its last yielded batch. A checkpoint of the part records ``item_offset``, so
  it resumes exactly (into any batch size again).
- **Another dataset length**: the interrupted epoch finishes over the old index range
  (its sampler rebuilt over the old length, ``epoch_length``); the next epoch uses the
  loader's own sampler. Only torch's samplers can be rebuilt, and only a grown dataset
  holds every index of the old range.
- **Another world size** for a sampler that deals one stream to the ranks (a
  Mixture's, ``load_state_dict`` or ``reshard``): the epoch goes on as an epoch part
  from the sampler's position, ``item_offset`` counting this rank's items before it
  in the new world.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Mapping
from typing import Any

from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .._errors import CheckpointMismatchError
from .fingerprint import Fingerprint
from .._state.ledger import EpochStart, WorkerLedger, first_due


class _Sized:
    # The samplers read only len() of their data source.
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


def rebatched(start: EpochStart, old_size: int | None, new_size: int | None) -> EpochStart:
    """The interrupted epoch ``start`` (taken at batch size ``old_size``) resumed with
    batches of ``new_size``: an epoch part from the first sample not yet yielded."""
    if old_size is None or new_size is None:
        raise CheckpointMismatchError(
            f"batch_size {old_size!r} in the checkpoint / {new_size!r} in this loader: a "
            "batch size can change at resume only between two loaders that batch with "
            "torch's BatchSampler (batch_size= given, no batch_sampler=)"
        )
    if not start.record.in_order:
        raise CheckpointMismatchError(
            f"the checkpoint was taken in the middle of epoch {start.epoch} with in_order=False: "
            "its yielded batches are not the first ones of the epoch, and resuming with "
            "another batch_size needs them to be. Resume with the old batch_size, or from a "
            "checkpoint taken with in_order=True or at an epoch's end"
        )
    if start.skip:
        raise CheckpointMismatchError(
            f"the checkpoint holds a skip of {start.skip} batch(es) of size {old_size} not yet "
            "carried out; load it with the old batch_size, or skip in the new batches "
            "(load_state_dict(skip=...)) from a checkpoint without one"
        )
    consumed = first_due(start.workers or [])
    return _part(start, start.record.item_offset + consumed * old_size)


def reworlded(start: EpochStart, item_offset: int, done: bool) -> EpochStart:
    """The interrupted epoch ``start``, whose stateful sampler was dealing one stream to
    ranks of another world size (a Mixture's), resumed on this loader's world: an epoch
    part from the sampler's position, before which ``item_offset`` of this rank's items
    stand (the old world's batches are not this one's); ``done``: nothing of the epoch
    is left for this rank."""
    if start.skip:
        raise CheckpointMismatchError(
            f"the checkpoint holds a skip of {start.skip} batch(es) of the old world size not yet "
            "carried out; load it on the old world size, or skip in the new world's batches "
            "(load_state_dict(skip=...)) from a checkpoint without one"
        )
    part = _part(start, item_offset)
    if done and part.sampler_state is not None:
        part = replace(part, sampler_state={**part.sampler_state, "done": True})
    return part


def _part(start: EpochStart, item_offset: int) -> EpochStart:
    # Each logical worker goes on from the snapshot after its last yielded batch.
    workers = [WorkerLedger(epoch_start=ledger.yielded or ledger.epoch_start) for ledger in start.workers or []]
    return replace(
        start, workers=workers, yielded=0, turn=0, next_batches=None, record=replace(start.record, item_offset=item_offset)
    )


def old_range_sampler(index_sampler: Any, old_length: int, new_length: int | None) -> Any:
    """``index_sampler`` (torch's BatchSampler over a torch sampler) rebuilt over the
    dataset's old length, for the rest of the interrupted epoch."""
    if new_length is not None and new_length < old_length:
        raise CheckpointMismatchError(
            f"dataset_length {old_length} in the checkpoint / {new_length} in this loader: the "
            "dataset shrank, so the rest of the interrupted epoch (over the old indices) "
            "cannot be read. Finish that epoch on the old dataset, or resume from a "
            "checkpoint taken at an epoch's end"
        )
    if type(index_sampler) is not BatchSampler:
        raise CheckpointMismatchError(
            "the dataset length changed in the middle of an epoch, and this loader batches "
            f"with {type(index_sampler).__qualname__}: only torch's own batching "
            "(batch_size=, no batch_sampler=) over its own samplers can finish the epoch over "
            "the old indices. Resume from a checkpoint taken at an epoch's end"
        )
    sampler = index_sampler.sampler
    old = _Sized(old_length)
    rebuilt: Any
    if type(sampler) is SequentialSampler:
        rebuilt = SequentialSampler(old)  # type: ignore[arg-type]
    elif type(sampler) is RandomSampler:
        rebuilt = RandomSampler(old, sampler.replacement, sampler._num_samples, sampler.generator)  # type: ignore[arg-type]
    elif type(sampler) is DistributedSampler:
        rebuilt = DistributedSampler(
            old, sampler.num_replicas, sampler.rank, sampler.shuffle, sampler.seed, sampler.drop_last  # type: ignore[arg-type]
        )
    else:
        raise CheckpointMismatchError(
            "the dataset length changed in the middle of an epoch, and the loader's sampler is "
            f"{type(sampler).__qualname__}: only torch's SequentialSampler, RandomSampler and "
            "DistributedSampler can be rebuilt over the old length. Resume from a checkpoint "
            "taken at an epoch's end"
        )
    return BatchSampler(rebuilt, index_sampler.batch_size, index_sampler.drop_last)


def resized(start: EpochStart, saved: Mapping[str, Any], mine: Fingerprint, index_sampler: Any) -> EpochStart:
    """The interrupted map-style epoch ``start``, from a checkpoint whose fingerprint is
    ``saved``, as a loader of fingerprint ``mine`` resumes it (the differences were
    allowed or are none)."""
    if saved["batch_size"] != mine.values["batch_size"]:
        start = rebatched(start, saved["batch_size"], mine.values["batch_size"])
    old_length = saved["dataset_length"] if start.record.epoch_length is None else start.record.epoch_length
    new_length = mine.values["dataset_length"]
    if old_length is not None and old_length != new_length:
        start = replace(
            start,
            record=replace(start.record, epoch_length=old_length),
            index_sampler=old_range_sampler(index_sampler, old_length, new_length),
        )
    return start


def part_batches(index_sampler: Any, item_offset: int, epoch_length: int | None) -> int | None:
    """The batches of a map-style epoch part whose loader batches with ``index_sampler``:
    the sampler's items after ``item_offset`` (another batch size), over ``epoch_length``
    indices (another dataset length; None: the loader's own). None when the sampler has
    no length."""
    if epoch_length is not None:
        index_sampler = old_range_sampler(index_sampler, epoch_length, None)
    try:
        if not item_offset:
            return len(index_sampler)
        items = len(index_sampler.sampler) - item_offset
    except TypeError:
        return None
    return batch_count(items, index_sampler.batch_size, index_sampler.drop_last)


def batch_count(items: int, batch_size: int, drop_last: bool) -> int:
    """The batches ``items`` samples make (none for fewer than none), as torch's
    BatchSampler counts them."""
    items = max(0, items)
    return items // batch_size if drop_last else -(-items // batch_size)

