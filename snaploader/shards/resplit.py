"""Another world size for a shard stream's interrupted epoch: every old rank's loader
checkpoint read, the samples none of them yielded gathered, and dealt to the new ranks
and workers (docs/shards.md, "Elastic").

The work left in an epoch is, for each old (rank, worker): the samples in its shuffle
buffer, the rest of its open shard, and its shards not yet opened; a worker that yielded
no batch yet has its whole share left, derived from the epoch's base seed. Pooled in
that order (the loose samples first, so they spread evenly) and dealt as webdataset
deals shards, ``[rank::world_size][worker::num_workers]``, they are read once each by the
new run. The order within the epoch and the augmentations are the new run's own, so
only "nothing lost, nothing repeated" holds, not bit-for-bit equality.

Another ``num_workers`` on the same world size needs none of this: snaploader keeps the
interrupted epoch's logical workers (docs/elastic.md), and the epoch goes on bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .._errors import CheckpointMismatchError
from .._format.parse import parse
from .._loader import DataLoader
from .state import read_state
from .stream import ShardStream, Work, epoch_plan

__all__ = ["ResplitLoader", "remaining_work", "resplit"]


def remaining_work(states: Sequence[Any], stream: ShardStream) -> tuple[Work, ...] | None:
    """The work the old ranks' loader checkpoints ``states`` (in rank order) left in their
    epoch, pooled; None when no epoch is under way (the next one starts afresh)."""
    checkpoints = [parse(state) for state in states]
    world = len(checkpoints)
    if not checkpoints:
        raise ValueError("resplit needs every old rank's loader state_dict(), got none")
    epochs = {(c.epoch, c.ended) for c in checkpoints}
    if len(epochs) != 1:
        shown = ", ".join(f"rank {r}: epoch {c.epoch}{' (ended)' if c.ended else ''}" for r, c in enumerate(checkpoints))
        raise CheckpointMismatchError(f"the old ranks' checkpoints are not of one step ({shown}): give the states saved together")
    first = checkpoints[0]
    if first.epoch < 0 or first.ended:
        return None
    if any(c.skip for c in checkpoints):
        raise CheckpointMismatchError(
            "a checkpoint holds a pending skip (load_state_dict(skip=...)), whose batches its "
            "workers have not read yet: resume it on the old world size past the skip, then resplit"
        )
    seeds = {c.base_seed for c in checkpoints}
    if len(seeds) != 1 or first.base_seed is None:
        raise CheckpointMismatchError(
            f"the old ranks drew different base seeds ({sorted(map(str, seeds))}), so they shuffled "
            "the shards differently and their shares overlap: nothing can tell which samples "
            "the epoch still holds. Give every rank's loader the same generator seed"
        )
    fresh: list[str] = []  # workers that yielded nothing: their whole share is left
    explicit = False  # a worker was reading an earlier resplit's work, not its epoch share
    loose: list[Work] = []
    partial: list[Work] = []
    whole: list[Work] = []
    for rank, checkpoint in enumerate(checkpoints):
        workers = checkpoint.logical_workers
        for w, ledger in enumerate(checkpoint.workers):
            split = (rank, world, w, max(1, workers))
            at = ledger.yielded
            if at is None:
                fresh.append(f"rank {rank}'s worker {w}")
                whole += epoch_plan(len(stream.urls), first.base_seed, stream.shuffle_shards, split)
                continue
            if at.data_owner != "iterator" or not at.complete:
                raise CheckpointMismatchError(
                    f"rank {rank}'s worker {w} snapshot holds no shard stream state (the loader was "
                    "built with state_protocol=False, or snapshot_every > 1): resplit needs every "
                    "worker's state after its last batch; resume on the old world size instead"
                )
            shard = read_state(at.data, stream, None)
            if shard.split != split:
                raise CheckpointMismatchError(
                    f"rank {rank}'s checkpoint holds the state of rank {shard.split[0]} of "
                    f"{shard.split[1]}, worker {shard.split[2]} of {shard.split[3]}: give the states "
                    "in rank order, one per old rank"
                )
            explicit = explicit or shard.plan is not None
            plan = list(shard.plan) if shard.plan is not None else epoch_plan(
                len(stream.urls), shard.seed, stream.shuffle_shards, split)
            loose += [(s, o, 1) for s, o in shard.buffer]
            if shard.item < len(plan):
                s, o, count = plan[shard.item]
                if shard.offset < 0:
                    partial.append((s, o, count))
                elif shard.left != 0:
                    partial.append((s, shard.offset, shard.left))
                whole += plan[shard.item + 1 :]
    if explicit and fresh:
        raise CheckpointMismatchError(
            f"these checkpoints were taken while the old run itself finished a resplit epoch, "
            f"and {', '.join(fresh)} had yielded no batch of it yet, so its share of that epoch "
            "is not in the checkpoint: resume on the old world size (resplit with the states "
            "that epoch came from), or from a checkpoint taken after it"
        )
    return tuple(loose + partial + whole)


class ResplitLoader:
    """A loader over a :class:`ShardStream` that first reads the rest of an epoch
    interrupted on another world size (:func:`resplit`), then the stream's own epochs.
    Iterated, checkpointed and loaded like its loader (``.loader``)."""

    def __init__(self, loader: DataLoader[Any], stream: ShardStream) -> None:
        self.loader, self.stream = loader, stream

    def __iter__(self) -> Iterator[Any]:
        yield from self.loader
        # The loader's epoch 0 was the rest of the old epoch; its next ones are ordinary.
        self.stream.remainder = None

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any, **kwargs: Any) -> None:
        self.loader.load_state_dict(state, **kwargs)
        checkpoint = parse(state)
        if checkpoint.epoch > 0 or (checkpoint.epoch == 0 and checkpoint.ended):
            self.stream.remainder = None


def resplit(states: Sequence[Any], loader: DataLoader[Any]) -> ResplitLoader:
    """``loader`` (a new rank's, over a :class:`ShardStream` built with the old run's
    shards and options) set to finish the epoch the old ranks' checkpoints ``states``
    (every old rank's ``loader.state_dict()``, in rank order) were taken in, re-split
    over the new world and workers. To resume a checkpoint the returned loader saved
    during that epoch, call ``resplit`` with the same old states again, then
    ``load_state_dict`` the new checkpoint."""
    stream = loader.dataset
    if not isinstance(stream, ShardStream):
        raise TypeError(f"resplit takes a loader over a ShardStream, got one over {type(stream).__qualname__}")
    stream.remainder = remaining_work(states, stream)
    return ResplitLoader(loader, stream)
