"""What an epoch has consumed so far, reconstructed from a checkpoint's position alone
(``loader.consumed()``, ``snaploader inspect --consumed``): the dataset indices of the
batches behind the position, rebuilt with torch's own sampler from what the checkpoint
records (the sampler's arguments, the generator's state at the epoch start), never
stored sample by sample; and, for a sampler that keeps its own ledger (a Mixture's),
what each source gave. A sampler whose order the checkpoint does not determine gets no
indices, and the reason says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

from .._rng.capture import RngSource
from .checkpoint import Checkpoint

# The samplers whose whole order the checkpoint determines, by the name the fingerprint
# records (the exact type: a subclass may order otherwise).
REBUILT = ("SequentialSampler", "RandomSampler", "DistributedSampler")


def _random_order(checkpoint: Checkpoint, n: int) -> list[int]:
    # As the epoch drew it: the worker base seed first, then the sampler (_epoch/iterator.py).
    assert checkpoint.rng_start is not None
    if checkpoint.rng_kind == "generator":
        generator = torch.Generator()
        source = RngSource(generator)
        source.set_state(checkpoint.rng_start)
        if checkpoint.drew_base_seed:
            source.draw_base_seed()
        return list(RandomSampler(range(n), generator=generator))
    with torch.random.fork_rng(devices=[]):
        source = RngSource(None)
        source.set_state(checkpoint.rng_start)
        if checkpoint.drew_base_seed:
            source.draw_base_seed()
        return list(RandomSampler(range(n)))


def _order(checkpoint: Checkpoint) -> tuple[list[int] | None, str | None]:
    fingerprint = checkpoint.fingerprint
    kind, n = fingerprint["sampler"], fingerprint["dataset_length"]
    if kind == "MixtureSampler":
        return None, "a Mixture's epoch: what each source gave, item by item, is under 'sources'"
    if kind not in REBUILT or n is None:
        return None, (f"the sampler is {kind}, whose order a checkpoint does not record (indices are "
                      f"rebuilt for {', '.join(REBUILT)})")
    if checkpoint.sampler_rngs is not None:
        return None, "the sampler holds a generator of its own, whose draws are not rebuilt here"
    if kind == "SequentialSampler":
        return list(range(n)), None
    if kind == "DistributedSampler":
        args = checkpoint.distributed
        if args is None or checkpoint.record.sampler_epoch is None:
            return None, "the checkpoint does not record the DistributedSampler's arguments and epoch"
        sampler: DistributedSampler[int] = DistributedSampler(range(n), num_replicas=args.num_replicas, rank=args.rank,  # type: ignore[arg-type]
                                     shuffle=args.shuffle, seed=args.seed, drop_last=args.drop_last)
        sampler.set_epoch(checkpoint.record.sampler_epoch)
        return list(sampler), None
    if checkpoint.rng_start is None:
        return None, "the checkpoint holds no generator state for the epoch start"
    return _random_order(checkpoint, n), None


def _indices(checkpoint: Checkpoint) -> tuple[list[int] | None, str | None]:
    fingerprint = checkpoint.fingerprint
    if fingerprint["dataset_kind"] != "map":
        return None, "an iterable dataset has no indices"
    if checkpoint.epoch < 0:
        return [], None
    if not checkpoint.record.in_order and not checkpoint.ended:
        return None, "taken mid-epoch with in_order=False: its yielded batches are not the epoch's first ones"
    if checkpoint.record.item_offset or checkpoint.record.epoch_length is not None:
        return None, "the epoch was resumed with another batch size or dataset length"
    # torch's own BatchSampler from batch_size is recorded as "BatchSampler" beside a batch
    # size; one the user gave is recorded without one (torch sets batch_size to None)
    if fingerprint["batch_sampler"] is not None and (fingerprint["batch_sampler"] != "BatchSampler" or fingerprint["batch_size"] is None):
        return None, f"a custom batch sampler ({fingerprint['batch_sampler']}) makes the batches"
    order, why = _order(checkpoint)
    if order is None:
        return None, why
    size = fingerprint["batch_size"] or 1
    return order[: checkpoint.consumed * size], None


def unrebuilt(index_sampler: Any, generator: Any) -> str | None:
    """Why a live loader's sampler orders otherwise than the one :func:`consumed_of`
    rebuilds from the fingerprint's name (torch's arguments it does not record), or None."""
    sampler = index_sampler.sampler if type(index_sampler) is BatchSampler else index_sampler
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler._num_samples is not None:
            return "a RandomSampler with replacement or num_samples, which the checkpoint does not record"
        if sampler.generator is not None and sampler.generator is not generator:
            return "the RandomSampler draws from a generator of its own, not the loader's"
    return None


def consumed_of(
    checkpoint: Checkpoint, by_source: Callable[[Any], dict[str, Any]] | None = None, unknown: str | None = None
) -> dict[str, Any]:
    """What the epoch of ``checkpoint`` has consumed: ``epoch``, ``ended``, ``batches``
    (yielded or skipped: behind the position), ``skipped``, ``indices`` (the dataset
    indices of those batches in the epoch's order, or None with the reason in
    ``indices_unknown``) and ``sources`` (``by_source`` of the sampler's state: a
    Mixture's per-source ledger, or None). ``unknown``: why the live sampler's order is
    not the one rebuilt (:func:`unrebuilt`), which leaves ``indices`` None."""
    indices, why = (None, unknown) if unknown is not None else _indices(checkpoint)
    sources = None
    if by_source is not None and checkpoint.sampler_state is not None:
        sources = by_source(checkpoint.sampler_state.state)
    return {
        "epoch": checkpoint.epoch,
        "ended": checkpoint.ended,
        "batches": checkpoint.consumed,
        "skipped": checkpoint.skip,
        "indices": indices,
        "indices_unknown": why,
        "sources": sources,
    }
