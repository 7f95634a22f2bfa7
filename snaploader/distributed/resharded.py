"""Changing the world size at resume: the checkpoints of an N-rank run with torch's
``DistributedSampler``, resumed on M ranks (``docs/elastic.md``, "Changing the world
size").

Every new rank j of M calls :func:`reshard` with all N old ranks' ``state_dict()``\\ s
(per-rank files, or the entries of a DCP checkpoint) and a function that builds its
loader for a given sampler; it gets a :class:`ReshardedLoader`, iterated like a
loader. Which of two cases applies is decided by N and M, and by whether the loaders
``make_loader`` builds keep the old per-rank batch size:

- **hosting** (M divides N, the same batch size): rank j hosts the N/M logical ranks
  j*N/M ... (j+1)*N/M - 1, one snaploader loader each, loaded with that rank's
  checkpoint, and yields per step their batches concatenated (:func:`concat`). The new
  ranks' batches, concatenated in rank order, are the old global batches bit for bit,
  in this epoch and the next ones (the N-logical-rank stream goes on).
- **re-partition** (otherwise; or a new per-rank batch size, allowed by
  ``allow_mismatch=("batch_size",)``, whatever M: NOTE [ a new per-rank batch ]): the
  samples the old run would still have yielded in the interrupted epoch are pooled in
  its order and dealt out in batches of the new loaders' size (``rules.remaining``,
  ``rules.share``); rank j reads its share through a :class:`RemainderSampler`, then
  from the next epoch a plain ``DistributedSampler`` of M replicas. No sample of the
  epoch is lost or repeated; the augmentations drawn are not the old run's, unless
  the loaders draw per sample (``seed_per_sample=True``).

A :class:`ReshardedLoader`'s own ``state_dict()`` is plain data holding its loaders'
checkpoints, so it can be resharded again (or resumed on the same M).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from .._errors import CheckpointFormatError, CheckpointMismatchError
from .._format.checkpoint import sha256_of
from .._format.envelopes import ReshardedState, Rest, is_resharded, parse_resharded, resharded_state
from .._loader import DataLoader
from .continuation import continued, read_to_end
from .stream_world import is_stream_world, reshard_stream
from .rules import (
    Source, World, check_reached, gather, hosted, new_batch_size, rebatch_allowed, remaining, require_in_order,
    sampler_for, share,
)

__all__ = ["RemainderSampler", "ReshardedLoader", "concat", "reshard"]

LoaderFactory = Callable[[Sampler[int]], DataLoader[Any]]


class RemainderSampler(Sampler[int]):
    """The samples of an interrupted epoch dealt to this rank, in order."""

    def __init__(self, indices: Sequence[int]) -> None:
        self.indices = list(indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def concat(batches: Sequence[Any]) -> Any:
    """The hosted logical ranks' batches of one step as one batch, as if one rank had
    read them all: tensors and arrays concatenated along dim 0, dicts and tuples
    element by element, lists of strings (default_collate's) joined. One batch is
    returned as it is."""
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches))
    if isinstance(first, np.ndarray):
        return np.concatenate(list(batches))
    if isinstance(first, Mapping):
        return type(first)({key: concat([batch[key] for batch in batches]) for key in first})  # type: ignore[call-arg]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat(list(parts)) for parts in zip(*batches)))
    if isinstance(first, (list, tuple)):
        if all(isinstance(item, (str, bytes, int, float)) for item in first):
            return type(first)(itertools.chain.from_iterable(batches))
        return type(first)(concat(list(parts)) for parts in zip(*batches))
    raise TypeError(
        f"snaploader.distributed.concat cannot join batches of type {type(first).__qualname__}; "
        "pass reshard(..., combine=list) to get each step's hosted batches as a list, "
        "or a function of your own"
    )


def _build(make_loader: LoaderFactory, sampler: Sampler[int]) -> DataLoader[Any]:
    loader = make_loader(sampler)
    if not isinstance(loader, DataLoader) or loader.sampler is not sampler:
        raise TypeError(
            "make_loader(sampler) should return a new snaploader.DataLoader built with "
            f"sampler=<the sampler it is given>; got {type(loader).__qualname__}"
            f"{'' if not isinstance(loader, DataLoader) else f' with sampler {type(loader.sampler).__qualname__}'}"
        )
    return loader


def _remainder(make_loader: LoaderFactory, source: Source, rank: int, world_size: int) -> DataLoader[Any]:
    """The loader reading new rank ``rank``'s share of the interrupted epoch, drawing with
    that epoch's per-sample seed when the old run used seed_per_sample."""
    loader = continued(
        _build(make_loader, RemainderSampler(share(remaining(source), source.deal_size, rank, world_size))), source.after, rank, rest=True,
    )
    _check_source(source, loader)
    if loader._snaploader_options.seed_per_sample != (source.sample_seed is not None):
        raise CheckpointMismatchError(
            f"seed_per_sample: {source.sample_seed is not None} in the old run's checkpoints / "
            f"{loader._snaploader_options.seed_per_sample} in the loader make_loader built; build it with the old "
            "run's arguments"
        )
    if source.sample_seed is not None:
        loader._draw_with_sample_seed(sample_seed=source.sample_seed)
    return loader


class ReshardedLoader:
    """New rank ``rank`` of ``world_size``'s loader over an old run's checkpoints,
    made by :func:`reshard`. Iterate it as a loader and call :meth:`set_epoch` before
    each epoch as with a DistributedSampler: the first ``iter()`` goes on with the
    interrupted epoch (``epoch``), each later one is a new epoch.

    ``mode`` is "hosting" or "repartition"; ``logical_ranks`` the old ranks hosted
    (hosting); ``loaders`` the snaploader loaders now in use.
    """

    def __init__(
        self,
        *,
        mode: str,
        rank: int,
        world_size: int,
        make_loader: LoaderFactory,
        combine: Callable[[list[Any]], Any],
        loaders: list[DataLoader[Any]],
        epoch: int | None,
        logical_ranks: tuple[int, ...] = (),
        rest: tuple[Source, DataLoader[Any]] | None = None,
    ) -> None:
        self.mode, self.rank, self.world_size = mode, rank, world_size
        self.make_loader, self.combine = make_loader, combine
        self.loaders, self.epoch, self.logical_ranks = loaders, epoch, logical_ranks
        self._rest = rest  # re-partition: the interrupted epoch's source and loader
        self._set_epoch: int | None = None

    def __iter__(self) -> Iterator[Any]:
        if self._rest is not None and not self.loaders and not read_to_end(self._rest[1]):
            self.loaders = [self._rest[1]]
            return iter(self.loaders[0])
        if self._rest is not None:
            self.loaders, self._rest = [self._after()], None
        iterators: list[Iterator[Any]] = [iter(loader) for loader in self.loaders]
        if len(iterators) == 1:
            return iterators[0]
        return self._zipped(iterators)

    def _zipped(self, iterators: list[Iterator[Any]]) -> Iterator[Any]:
        for batches in itertools.zip_longest(*iterators):
            if any(batch is None for batch in batches):
                raise RuntimeError(
                    f"the hosted logical ranks {list(self.logical_ranks)} ran out of batches at "
                    "different steps; their loaders must yield as many batches per epoch"
                )
            yield self.combine(list(batches))

    def _after(self) -> DataLoader[Any]:
        assert self._rest is not None
        source = self._rest[0]
        epoch = self._set_epoch
        if epoch is None and source.sampler_epoch is not None:
            epoch = source.sampler_epoch + 1
        return continued(_build(self.make_loader, sampler_for(source, self.world_size, self.rank, epoch)), source.after, self.rank)

    def __len__(self) -> int:
        if self._rest is not None and not self.loaders:
            return len(self._rest[1])
        return len(self.loaders[0]) if self.loaders else 0

    def set_epoch(self, epoch: int) -> None:
        """Set the DistributedSampler epoch of the epochs to come (the interrupted
        epoch's own is its checkpoint's, whatever is set)."""
        self._set_epoch = epoch
        for loader in self.loaders:
            sampler = loader.sampler
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        """Plain data: this rank's loaders' checkpoints (hosting: one per logical rank,
        in order), or the interrupted epoch's source and the loader reading its share.
        Pass every new rank's to :func:`reshard` to resume, on any world size."""
        # Until the next epoch begins, the interrupted one's source says how it begins
        # (Source.after), whether its rest was read to the end or not.
        rest = None if self._rest is None else Rest(self._rest[0].to_plain(), self._rest[1].state_dict())
        return resharded_state(self.rank, self.world_size, [loader.state_dict() for loader in self.loaders], rest)

    def load_state_dict(self, state: Any, *, allow_mismatch: Iterable[str] = ()) -> None:
        raise TypeError(
            "a ReshardedLoader is resumed by snaploader.distributed.reshard(states, make_loader, "
            "rank=..., world_size=...) with every rank's state (from a DCP checkpoint: "
            "snaploader.distributed.dcp_states(path)), not by load_state_dict"
        )


def _unwrap(states: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ReshardedState]]:
    """The plain loader checkpoints in ``states`` (a ReshardedLoader's contributes its
    loaders'), and the ReshardedLoader states taken during a re-partitioned epoch."""
    flat: list[dict[str, Any]] = []
    during: list[ReshardedState] = []
    for place, state in enumerate(states):
        if not is_resharded(state):
            flat.append(state)
            continue
        parsed = parse_resharded(state, f"checkpoint {place} of the list (a ReshardedLoader's)")
        if parsed.rest is not None:
            during.append(parsed)
        flat.extend(parsed.loaders)
    return flat, during


def _resume_during(during: list[ReshardedState], total: int, rank: int, world_size: int) -> tuple[Source, dict[str, Any]]:
    sizes = {state.world_size for state in during}
    ranks = sorted(state.rank for state in during)
    if len(during) != total or sizes != {world_size} or ranks != list(range(world_size)):
        raise CheckpointMismatchError(
            f"the checkpoints were taken during an epoch re-partitioned onto {sorted(sizes)} rank(s) "
            f"(ranks {ranks} of them given, {total} checkpoints in all): such an epoch resumes only "
            f"on the same world size, from all its ranks' checkpoints; got world_size={world_size}. "
            "Resume on that world size, and change it again from a checkpoint taken after the epoch"
        )
    mine = next(state.rest for state in during if state.rank == rank and state.rest is not None)
    source = Source.from_plain(mine.source, f"rank {rank}'s re-partition source")
    others = {sha256_of(state.rest.source) for state in during if state.rest is not None}
    if len(others) > 1:
        raise CheckpointMismatchError(
            "the ranks' checkpoints describe different re-partitioned epochs; pass checkpoints of one run, one step"
        )
    return source, mine.loader


def _epoch_of(world: World) -> int | None:
    first = world.checkpoints[0]
    if first.epoch < 0 or first.record.sampler_epoch is None:
        return None
    return first.record.sampler_epoch + (1 if all(c.ended for c in world.checkpoints) else 0)


def reshard(
    states: Sequence[dict[str, Any]],
    make_loader: LoaderFactory,
    *,
    rank: int,
    world_size: int,
    combine: Callable[[list[Any]], Any] = concat,
    allow_mismatch: Iterable[str] = (),
) -> ReshardedLoader:
    """New rank ``rank`` of ``world_size``'s loader, resuming the run whose ranks saved
    ``states`` (each rank's ``state_dict()``, or a :class:`ReshardedLoader`'s; in any
    order). ``make_loader(sampler)`` builds a new snaploader DataLoader with that
    sampler and the old run's other arguments (called once per loader needed).
    ``allow_mismatch=("batch_size",)`` lets its ``batch_size`` be a new per-rank batch:
    the rest of the interrupted epoch is then re-partitioned in batches of that size,
    whatever ``world_size`` (docs/elastic.md, "A new per-rank batch").

    Raises ``ValueError`` (for the checkpoints, a subclass: CheckpointFormatError, or
    CheckpointMismatchError when they do not make one world) naming what does not fit:
    a rank missing or given twice,
    checkpoints of different epochs or loaders, a sampler that is not torch's
    DistributedSampler, a hosting world whose ranks stand at different steps, a new
    batch size not allowed.

    A Mixture's checkpoints (its sampler deals one stream to the ranks) need none of
    that: ``make_loader(None)`` must build the loader over the mixture, and each new rank
    goes on from where the old ranks stood (``distributed/stream_world.py``)."""
    if type(world_size) is not int or type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} and world_size={world_size!r}: expected ints with 0 <= rank < world_size")
    rebatch = rebatch_allowed(allow_mismatch)
    flat, during = _unwrap(states)
    if not during and is_stream_world(flat):  # a Mixture's: one stream, any world size
        loader = reshard_stream(flat, make_loader, rank, world_size)
        return ReshardedLoader(
            mode="hosting", rank=rank, world_size=world_size, make_loader=make_loader, combine=combine,
            loaders=[loader], epoch=loader.epoch, logical_ranks=(rank,),
        )
    if during:
        source, state = _resume_during(during, len(states), rank, world_size)
        loader = _remainder(make_loader, source, rank, world_size)
        loader.load_state_dict(state)
        return ReshardedLoader(
            mode="repartition", rank=rank, world_size=world_size, make_loader=make_loader,
            combine=combine, loaders=[], epoch=source.sampler_epoch, rest=(source, loader),
        )
    world = gather(flat)
    built: dict[int, DataLoader[Any]] = {}
    if world.size % world_size == 0:
        first_rank = hosted(world.size, rank, world_size)[0]
        first = built[first_rank] = _build(make_loader, sampler_for(world.source, world.size, first_rank, None))
        if new_batch_size(world.source, first.batch_size, rebatch) is None:
            return _hosting(world, first, rank, world_size, make_loader, combine)
        # NOTE [ a new per-rank batch ]: hosted loaders would yield N/M old-run batches
        # per step, each of the new size; a new per-rank batch asks for M-rank batches of
        # that size, so the rest is dealt anew, as when M does not divide N.
    if world.source.sampler_epoch is not None:
        require_in_order(world.checkpoints)
    source = _check_world(world, make_loader, rebatch, built)
    if source.sampler_epoch is None:  # no epoch under way: the M-rank sampler now
        after = continued(_build(make_loader, sampler_for(source, world_size, rank, _epoch_of(world))), source.after, rank)
        return ReshardedLoader(
            mode="repartition", rank=rank, world_size=world_size, make_loader=make_loader,
            combine=combine, loaders=[after], epoch=_epoch_of(world),
        )
    return ReshardedLoader(
        mode="repartition", rank=rank, world_size=world_size, make_loader=make_loader,
        combine=combine, loaders=[], epoch=_epoch_of(world),
        rest=(source, _remainder(make_loader, source, rank, world_size)),
    )


def _hosting(
    world: World, first: DataLoader[Any], rank: int, world_size: int, make_loader: LoaderFactory,
    combine: Callable[[list[Any]], Any],
) -> ReshardedLoader:
    """New rank ``rank`` hosting its old ranks, ``first`` already built for the first."""
    if len(set(world.positions)) > 1:
        shown = ", ".join(f"rank {r}: {y} batches of epoch {e}{' (ended)' if ended else ''}" for r, (e, ended, y) in enumerate(world.positions))
        raise CheckpointMismatchError(
            f"hosting {world.size} ranks on {world_size} needs every old rank at the same step, "
            f"to keep the global batches; the checkpoints stand at {shown}. Pass the "
            "checkpoints every rank saved at one step"
        )
    logical = hosted(world.size, rank, world_size)
    loaders = [first] + [_build(make_loader, sampler_for(world.source, world.size, r, None)) for r in logical[1:]]
    for r, loader in zip(logical, loaders):
        loader.load_state_dict(world.states[r])
    return ReshardedLoader(
        mode="hosting", rank=rank, world_size=world_size, make_loader=make_loader, combine=combine,
        loaders=loaders, epoch=_epoch_of(world), logical_ranks=tuple(logical),
    )


def _check_world(world: World, make_loader: LoaderFactory, rebatch: bool, built: dict[int, DataLoader[Any]]) -> Source:
    """Re-partitioning loads no old rank's checkpoint, so each is checked as hosting
    would check it (the fingerprint: a grown dataset is refused; the position's
    consistency) by loading it into a loader that is then dropped (``built``: those
    already made for old ranks, by rank). Returns the source of the deal: the old
    world's, with the new batch size if the loaders have one."""
    new_size = None
    for rank, state in enumerate(world.states):
        probe = built.get(rank)
        if probe is None:
            probe = _build(make_loader, sampler_for(world.source, world.size, rank, None))
        new_size = new_batch_size(world.source, probe.batch_size, rebatch)
        try:
            probe.load_state_dict(state, allow_mismatch=() if new_size is None else ("batch_size",))
        except (CheckpointFormatError, CheckpointMismatchError) as exc:
            raise type(exc)(f"rank {rank}'s checkpoint: {exc}") from None
    if new_size is None:
        return world.source
    check_reached(world.source, world.positions)
    return replace(world.source, new_batch_size=new_size)


def _check_source(source: Source, loader: DataLoader[Any]) -> None:
    """The re-partition source must describe the loader now built (a ReshardedLoader's
    state records it apart from the loader's own checkpoint)."""
    try:
        length: int | None = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        length = None
    pairs = {
        "dataset_length": (source.dataset_length, length),
        "batch_size": (source.deal_size, loader.batch_size),
        "drop_last": (source.drop_last, loader.drop_last),
    }
    lines = [f"  {key}: {old!r} in checkpoint / {new!r} in this loader" for key, (old, new) in pairs.items() if old != new]
    if lines:
        raise CheckpointMismatchError(
            "the re-partitioned epoch was taken from loaders built differently:\n" + "\n".join(lines)
            + "\nBuild the loaders with the checkpoint's arguments to resume it (the batch_size its "
            "rest was dealt in: change it from a checkpoint taken after that epoch)"
        )
