"""The bookkeeping of a world-size change, pure: which old ranks' checkpoints make a
world, which logical ranks a new rank hosts, and which samples each new rank reads
for the rest of an interrupted epoch. No loader is built here (``distributed/resharded.py``).

A *world* is the N checkpoints of one N-rank run, taken at one step, each from a
loader over torch's ``DistributedSampler(num_replicas=N, rank=r)``; its fingerprint's
``distributed`` entry (``_format/fingerprint.py``'s ``distributed_of``) records the sampler's
arguments, from which rank r's order for any epoch is rebuilt with torch's own
sampler. The rules, and what each guarantees, are in ``docs/elastic.md``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from torch.utils.data.distributed import DistributedSampler

from .._format.resize import batch_count
from .._errors import CheckpointFormatError, CheckpointMismatchError
from .._format.checkpoint import Checkpoint, DistributedArgs
from .._format.fingerprint import FINGERPRINT_KEYS
from .._format.parse import parse
from .._rng.per_sample import epoch_seed
from .continuation import Continuation

# The fingerprint entries that differ between the ranks of one world: the rank itself,
# and the process count, which never defines the stream (logical workers).
_PER_RANK: Final = frozenset({"num_workers", "distributed"})


@dataclass(frozen=True)
class Source:
    """What the rest of an interrupted epoch is computed from: the old world's sampler
    and loader arguments and where each old rank stood. O(N) plain data."""

    num_replicas: int
    shuffle: bool
    seed: int
    sampler_drop_last: bool
    dataset_length: int
    batch_size: int
    drop_last: bool
    sampler_epoch: int | None  # None: no epoch under way (nothing is left of one)
    consumed: tuple[int, ...]  # per old rank, batches yielded or skipped this epoch
    # seed_per_sample: the interrupted epoch's per-sample seed, which the loaders reading
    # its rest draw with (every sample then as the old run drew it); None: option off
    sample_seed: int | None = None
    # reshard(..., allow_mismatch=("batch_size",)): the new loaders' batch size, which
    # the rest is dealt in; None: the old one. batch_size stays the old run's, which
    # its ranks' positions (consumed) count in.
    new_batch_size: int | None = None
    # the old run's next epoch, for the loaders that read it (None: a source written
    # before it was recorded, whose next epoch starts as a new loader's)
    after: Continuation | None = None

    @property
    def deal_size(self) -> int:
        """The batch size the rest of the interrupted epoch is dealt in."""
        return self.batch_size if self.new_batch_size is None else self.new_batch_size

    def to_plain(self) -> dict[str, Any]:
        return {
            "num_replicas": self.num_replicas, "shuffle": self.shuffle, "seed": self.seed,
            "sampler_drop_last": self.sampler_drop_last, "dataset_length": self.dataset_length,
            "batch_size": self.batch_size, "drop_last": self.drop_last,
            "sampler_epoch": self.sampler_epoch, "consumed": list(self.consumed),
            "sample_seed": self.sample_seed, "new_batch_size": self.new_batch_size,
            "after": None if self.after is None else self.after.to_plain(),
        }

    @classmethod
    def from_plain(cls, plain: Any, where: str) -> Source:
        """The source ``plain`` describes, every field checked as the parse of a loader
        state checks its own (``_format/parse.py``)."""
        types = {
            "num_replicas": int, "shuffle": bool, "seed": int, "sampler_drop_last": bool,
            "dataset_length": int, "batch_size": int, "drop_last": bool,
        }
        keys = {*types, "sampler_epoch", "consumed", "sample_seed", "new_batch_size", "after"}
        # a source written before new_batch_size (after) existed was dealt in the old
        # batch size (left the next epoch to start as a new loader's)
        if isinstance(plain, dict) and set(plain) | {"new_batch_size", "after"} == keys:
            plain = {"new_batch_size": None, "after": None, **plain}
        if not isinstance(plain, dict) or set(plain) != keys:
            raise CheckpointFormatError(f"{where} is not a re-partition source: it should hold {sorted(keys)}")
        for key, kind in types.items():
            if type(plain[key]) is not kind:
                raise CheckpointFormatError(f"{where}[{key!r}] should be {kind.__name__}, got {plain[key]!r:.60}")
        epoch, consumed = plain["sampler_epoch"], plain["consumed"]
        if epoch is not None and (type(epoch) is not int or epoch < 0):
            raise CheckpointFormatError(f"{where}['sampler_epoch'] should be None or an int >= 0, got {epoch!r:.60}")
        lows = {"num_replicas": 1, "dataset_length": 0, "batch_size": 1}
        for key, low in lows.items():
            if plain[key] < low:
                raise CheckpointFormatError(f"{where}[{key!r}] is {plain[key]}; expected >= {low}")
        if not -(2**63) <= plain["seed"] < 2**63:
            raise CheckpointFormatError(f"{where}['seed'] is {plain['seed']}; torch seeds fit in 64 bits")
        sample_seed = plain["sample_seed"]
        if sample_seed is not None and (type(sample_seed) is not int or not 0 <= sample_seed < 2**64):
            raise CheckpointFormatError(f"{where}['sample_seed'] should be None or an int in [0, 2**64), got {sample_seed!r:.60}")
        new_size = plain["new_batch_size"]
        if new_size is not None and (type(new_size) is not int or new_size < 1):
            raise CheckpointFormatError(f"{where}['new_batch_size'] should be None or an int >= 1, got {new_size!r:.60}")
        if not isinstance(consumed, list) or len(consumed) != plain["num_replicas"]:
            raise CheckpointFormatError(f"{where}['consumed'] should be a list of one count per old rank ({plain['num_replicas']})")
        after = None if plain["after"] is None else Continuation.from_plain(plain["after"], f"{where}['after']", plain["num_replicas"])
        source = cls(**{**plain, "consumed": tuple(consumed), "after": after})
        per_rank = rank_batches(source)
        for rank, count in enumerate(consumed):
            if type(count) is not int or not 0 <= count <= per_rank:
                raise CheckpointFormatError(
                    f"{where}['consumed'][{rank}] is {count!r:.60}; expected an int from 0 to {per_rank}, "
                    "the batches of one old rank's epoch"
                )
        return source


@dataclass(frozen=True)
class World:
    """The checkpoints of the N ranks of one run, ``states[r]`` rank r's as given and
    ``checkpoints[r]`` parsed."""

    states: list[dict[str, Any]]
    checkpoints: list[Checkpoint]
    source: Source
    # per rank: (epoch, ended, batches consumed): hosting needs them all equal
    positions: tuple[tuple[int, bool, int], ...]

    @property
    def size(self) -> int:
        return len(self.states)


class _Sized:
    # DistributedSampler reads only len() of its dataset.
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


def sampler_for(source: Source, num_replicas: int, rank: int, epoch: int | None) -> DistributedSampler[int]:
    """torch's DistributedSampler with the old world's arguments, for ``rank`` of
    ``num_replicas``, at ``epoch`` (None: left at 0)."""
    sampler: DistributedSampler[int] = DistributedSampler(
        _Sized(source.dataset_length),  # type: ignore[arg-type]
        num_replicas=num_replicas,
        rank=rank,
        shuffle=source.shuffle,
        seed=source.seed,
        drop_last=source.sampler_drop_last,
    )
    if epoch is not None:
        sampler.set_epoch(epoch)
    return sampler


def _refuse(who: str, problem: str) -> CheckpointMismatchError:
    return CheckpointMismatchError(f"{who} {problem}")


def _distributed(checkpoint: Checkpoint, who: str) -> DistributedArgs:
    fingerprint = checkpoint.fingerprint
    if "distributed" not in fingerprint:
        raise _refuse(
            who,
            "was written by a snaploader that did not record the "
            "DistributedSampler's arguments; resume it on its own world size, or save "
            "it again with this snaploader",
        )
    # With sampler= and batch_size=, torch's loader batches through its own BatchSampler
    # (recorded as such); a batch_sampler= of the user's leaves no DistributedSampler.
    if checkpoint.distributed is None or fingerprint["batch_size"] is None or fingerprint["dataset_length"] is None:
        raise _refuse(
            who,
            f"was taken from a loader with sampler {fingerprint['sampler']!r} and batch_size "
            f"{fingerprint['batch_size']!r}: only a map-style dataset read through torch's "
            "DistributedSampler (sampler=, batch_size=, no batch_sampler=) can change world size",
        )
    return checkpoint.distributed


def gather(states: Sequence[dict[str, Any]]) -> World:
    """The world the checkpoints ``states`` make, in rank order, or a clear error: each
    parsed, all of one run (same fingerprint but the rank), every rank 0..N-1 once,
    all in the same epoch."""
    if not states:
        raise ValueError("no checkpoints given: pass the state_dict() of every rank of the old run")
    by_rank: dict[int, tuple[dict[str, Any], Checkpoint]] = {}
    first: Checkpoint | None = None
    for place, state in enumerate(states):
        try:
            checkpoint = parse(state)
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"checkpoint {place} of the list: {exc}") from None
        shard = _distributed(checkpoint, f"checkpoint {place} of the list")
        who = f"rank {shard.rank}'s checkpoint"
        if first is None:
            first = checkpoint
        diffs = [
            f"  {key}: {first.fingerprint.get(key)!r} / {checkpoint.fingerprint.get(key)!r}"
            for key in FINGERPRINT_KEYS if key not in _PER_RANK and first.fingerprint[key] != checkpoint.fingerprint[key]
        ]
        base = replace(_distributed(first, "the first checkpoint"), rank=shard.rank)
        if base != shard:
            diffs.append(f"  distributed (but rank): {base!r} / {shard!r}")
        if diffs:
            raise _refuse(who, "comes from a loader built differently from the first one's (first / this):\n" + "\n".join(diffs))
        if shard.rank in by_rank:
            raise _refuse(who, "is given twice: pass each old rank's checkpoint once")
        by_rank[shard.rank] = (state, checkpoint)
    assert first is not None
    size = _distributed(first, "the first checkpoint").num_replicas
    if len(by_rank) != size:
        # by_rank's ranks are distinct and below size: the first missing ones are found
        # among the first len(by_rank) + 10, whatever size is.
        missing = [r for r in range(min(size, len(by_rank) + 10)) if r not in by_rank]
        raise CheckpointMismatchError(
            f"the checkpoints are of a {size}-rank run, but ranks {missing}"
            f"{f' and {size - len(by_rank) - len(missing)} more' if size - len(by_rank) > len(missing) else ''} "
            f"are missing (got {sorted(by_rank)}): "
            f"pass the state_dict() of all {size} old ranks"
        )
    ordered = [by_rank[rank] for rank in range(size)]
    checkpoints = [checkpoint for _, checkpoint in ordered]
    positions = tuple(_position(f"rank {r}'s checkpoint", c) for r, c in enumerate(checkpoints))
    return World([state for state, _ in ordered], checkpoints, _source_of(checkpoints), positions)


def _position(who: str, checkpoint: Checkpoint) -> tuple[int, bool, int]:
    if not checkpoint.ended and (checkpoint.record.item_offset or checkpoint.record.epoch_length is not None):
        raise _refuse(
            who,
            "was taken in an epoch resumed with another batch_size or dataset length, whose "
            "batches are not the old world's; change the world size from a checkpoint "
            "taken after that epoch",
        )
    if checkpoint.ended and checkpoint.skip:
        raise _refuse(
            who,
            f"holds a skip of {checkpoint.skip} batches asked for the next epoch (load_state_dict(skip=...)); "
            "start that epoch on the old world size first",
        )
    return checkpoint.epoch, checkpoint.ended, checkpoint.consumed


def require_in_order(checkpoints: Sequence[Checkpoint]) -> None:
    """Refuse to re-partition an epoch some rank yielded out of order: what is left of
    it is then not "all but the first N batches" of each rank."""
    for rank, checkpoint in enumerate(checkpoints):
        if not checkpoint.record.in_order and not checkpoint.ended:
            raise _refuse(
                f"rank {rank}'s checkpoint",
                "was taken in the middle of an epoch with in_order=False: its yielded "
                "batches are not the first ones of the epoch, which re-partitioning "
                "needs. Reshard from checkpoints taken at an epoch's end or with "
                "in_order=True, or resume on a world size that divides the old one",
            )


def _source_of(checkpoints: list[Checkpoint]) -> Source:
    epochs = {(c.epoch, c.record.sampler_epoch) for c in checkpoints}
    if len(epochs) > 1:
        shown = ", ".join(f"rank {r}: epoch {c.epoch} (sampler epoch {c.record.sampler_epoch})" for r, c in enumerate(checkpoints))
        raise CheckpointMismatchError(
            f"the checkpoints are from different epochs ({shown}); pass the checkpoints "
            "every rank saved at the same step"
        )
    first = checkpoints[0]
    fingerprint = first.fingerprint
    shard = _distributed(first, "the first checkpoint")
    under_way = first.epoch >= 0 and not all(c.ended for c in checkpoints)
    return Source(
        num_replicas=shard.num_replicas,
        shuffle=shard.shuffle,
        seed=shard.seed,
        sampler_drop_last=shard.drop_last,
        dataset_length=fingerprint["dataset_length"],
        batch_size=fingerprint["batch_size"],
        drop_last=fingerprint["drop_last"],
        sampler_epoch=first.record.sampler_epoch if under_way else None,
        # an epoch that ended has yielded all its batches (check_consistent)
        consumed=tuple(_position(f"rank {r}'s checkpoint", c)[2] for r, c in enumerate(checkpoints)),
        sample_seed=_sample_seed(checkpoints) if under_way else None,
        after=Continuation.of(checkpoints),
    )


def _sample_seed(checkpoints: Sequence[Checkpoint]) -> int | None:
    """The per-sample seed of the interrupted epoch (seed_per_sample), the same on every
    rank, or None when the option is off."""
    if not checkpoints[0].fingerprint.get("seed_per_sample", False):
        return None
    # NOTE [ per-sample root ] in _rng/per_sample.py
    seeds = [checkpoint.base_seed if checkpoint.record.sample_root is None else checkpoint.record.sample_root for checkpoint in checkpoints]
    if len(set(seeds)) > 1:
        raise ValueError(
            f"the ranks' loaders drew different base seeds for the run ({seeds}): "
            "with seed_per_sample=True a sample's draws follow the base seed, so no rank "
            "can draw a sample as its old rank did. Give every rank's loader the same "
            "generator seed (torch.Generator().manual_seed(seed)) to reshard exactly"
        )
    if seeds[0] is None:
        raise CheckpointFormatError("the checkpoints of an epoch under way hold no base seed")
    return epoch_seed(seeds[0], checkpoints[0].epoch)


def rebatch_allowed(allow_mismatch: Iterable[str]) -> bool:
    """Whether ``reshard(..., allow_mismatch=...)`` lets the new loaders' batch size
    differ from the old run's: the one difference it can take."""
    names = (allow_mismatch,) if isinstance(allow_mismatch, str) else tuple(allow_mismatch)
    if isinstance(allow_mismatch, str) or set(names) - {"batch_size"}:
        raise ValueError(
            f"reshard(allow_mismatch={names!r}): only 'batch_size' may differ from the old "
            "run's loaders, as allow_mismatch=('batch_size',); build the loaders with the old "
            "run's other arguments"
        )
    return "batch_size" in names


def new_batch_size(source: Source, built: int | None, rebatch: bool) -> int | None:
    """The batch size of the loaders ``make_loader`` builds (``built``) when it is not the
    old run's and ``rebatch`` allows it; None when it is the old run's."""
    if built == source.batch_size:
        return None
    if built is None:
        raise CheckpointMismatchError(
            f"batch_size: {source.batch_size} in the old run's checkpoints / None in the loader "
            "make_loader built: build it with batch_size= (torch's batching over the sampler it is given)"
        )
    if not rebatch:
        raise CheckpointMismatchError(
            f"batch_size: {source.batch_size} in the old run's checkpoints / {built} in the loader "
            f"make_loader built. Pass reshard(..., allow_mismatch=('batch_size',)) to deal the rest "
            f"of the interrupted epoch in batches of {built} (re-partitioned: each remaining sample "
            f"read once, docs/elastic.md), or build the loaders with batch_size={source.batch_size}"
        )
    return built


def check_reached(source: Source, positions: Sequence[tuple[int, bool, int]]) -> None:
    """Refuse a rank position past the end of an old rank's epoch (a loader of another
    batch size, loading the checkpoint, cannot tell)."""
    per_rank = rank_batches(source)
    for rank, (_, _, consumed) in enumerate(positions):
        if consumed > per_rank:
            raise CheckpointFormatError(
                f"rank {rank}'s checkpoint: loader state['yielded'] is {consumed} for an epoch "
                f"of {per_rank} batches of {source.batch_size}"
            )


def _batches(items: list[Any], fingerprint: dict[str, Any]) -> list[list[Any]]:
    size, drop_last = fingerprint["batch_size"], fingerprint["drop_last"]
    cut = [items[at : at + size] for at in range(0, len(items), size)]
    return cut[:-1] if cut and drop_last and len(cut[-1]) < size else cut


def rank_batches(source: Source) -> int:
    """The batches of one old rank's epoch (DistributedSampler gives every rank as many
    samples)."""
    n, size = source.dataset_length, source.num_replicas
    samples = -(-(n - size) // size) if source.sampler_drop_last and n % size else -(-n // size)
    return batch_count(samples, source.batch_size, source.drop_last)


def hosted(old_size: int, rank: int, world_size: int) -> range:
    """The logical ranks new rank ``rank`` of ``world_size`` hosts when ``world_size``
    divides ``old_size``: a contiguous block, so that concatenating the new ranks'
    batches in rank order concatenates the old ranks' in rank order."""
    per = old_size // world_size
    return range(rank * per, (rank + 1) * per)


def remaining(source: Source) -> list[int]:
    """The samples the old world would still have yielded in the interrupted epoch, in
    its global order (step by step, rank by rank), DistributedSampler's padding repeats
    left out."""
    if source.sampler_epoch is None:
        return []
    n, size = source.dataset_length, source.num_replicas
    plain = {"batch_size": source.batch_size, "drop_last": source.drop_last}
    per_rank = []
    for rank in range(size):
        order = list(sampler_for(source, size, rank, source.sampler_epoch))
        # position i of rank r's order is position r + i*N of the padded index list;
        # from n on, that list repeats its start
        positions = _batches(list(range(len(order))), plain)[source.consumed[rank]:]
        per_rank.append([[order[i] for i in batch if rank + i * size < n] for batch in positions])
    pool: list[int] = []
    for step in itertools.zip_longest(*per_rank, fillvalue=[]):
        for batch in step:
            pool.extend(batch)
    return pool


def share(pool: list[int], batch_size: int, rank: int, world_size: int) -> list[int]:
    """New rank ``rank``'s part of ``pool``: cut into batches of ``batch_size`` (only
    the last may be short), dealt round-robin, batch i to new rank i mod world_size."""
    batches = [pool[at : at + batch_size] for at in range(0, len(pool), batch_size)]
    return [index for batch in batches[rank::world_size] for index in batch]
