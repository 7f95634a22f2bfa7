"""A loader state restored: :func:`plan_restore`, the one function that turns the
untrusted state ``load_state_dict`` is given into a frozen :class:`Restore` plan, which
the loader only applies. Everything is decided here, before anything forks or any of the
loader's objects changes, and every checkpoint error is raised here:

- the parse (``_format/parse.py``: every field's type and range, the digest);
- the fingerprint (``_format/fingerprint.py``) and the consistency with the loader
  (``_format/schema.py``), the dataset's own ``check_state`` and a stateful sampler's
  own check of its state (a Mixture's weights and sources, ``allow_mismatch``);
- the RNG states' twist codes replayed, once;
- the resize to another batch size, dataset length or a stream sampler's world size
  (``_format/resize.py``);
- the skip (``_format/skip.py``) and the replay an iterable needs (``_state/replay.py``:
  refused here when the loader says ``replay="refuse"``);
- the state ``state_dict()`` returns until the next ``iter()``, built from the parse
  (``_format/build.py``'s ``loaded_state``), not the input re-signed.

The layout of a checkpoint is in ``_format/checkpoint.py``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from .build import loaded_state
from .checkpoint import Checkpoint
from .fingerprint import Fingerprint, check_fingerprint
from .parse import parse
from .resize import part_batches, resized, reworlded
from .schema import LoaderFacts, another_world, check_consistent, check_sampler_resume, check_seeds
from .skip import skip_count
from .._errors import CheckpointFormatError
from .._state.ledger import EpochStart, WorkerLedger
from .._state.protocol import check_own_states
from .._state.records import Snapshot
from .._state.replay import announce_replay
from .._rng.capture import RngSource
from .._rng.objects import ObjectRngs
from .._rng.raw import torch_state_tensor
from .._rng.twist import expand_for, has_codes

# -- reading a checkpoint ----------------------------------------------------------------


def _carried_dataset_state(ledgers: tuple[WorkerLedger, ...] | list[WorkerLedger], logical: int) -> Any:
    if logical != 0 or not ledgers:
        return None
    last = ledgers[0].yielded or ledgers[0].epoch_start
    if last is None or last.data_owner not in ("dataset", "both") or not last.complete:
        return None
    return last.data["dataset"] if last.data_owner == "both" else last.data


def _expanded(checkpoint: Checkpoint) -> list[WorkerLedger]:
    """The ledgers with their RNG states' twist codes replayed: once, here, after every
    cheap check passed, within the bound the parse checked (NOTE [ checkpoint limits ])."""
    base_seed = checkpoint.base_seed
    if base_seed is None:
        return list(checkpoint.workers)
    out = []
    for w, ledger in enumerate(checkpoint.workers):
        done: dict[int, Snapshot] = {}

        def expanded(snapshot: Snapshot | None, key: str) -> Snapshot | None:
            if snapshot is None or not isinstance(snapshot.rng, bytes) or not has_codes(snapshot.rng):
                return snapshot
            if id(snapshot) not in done:
                try:
                    rng = expand_for(snapshot.rng, base_seed, w)
                except ValueError as exc:
                    raise CheckpointFormatError(
                        f"loader state['workers'][{w}][{key!r}]['rng'] is not where logical worker {w}'s "
                        f"generators went from base seed {base_seed}: {exc}"
                    ) from None
                done[id(snapshot)] = replace(snapshot, rng=rng)
            return done[id(snapshot)]

        out.append(replace(
            ledger,
            epoch_start=expanded(ledger.epoch_start, "epoch_start"),
            yielded=expanded(ledger.yielded, "yielded"),
            yielded_complete=expanded(ledger.yielded_complete, "yielded_complete"),
            cache=[],
        ))
    return out


@dataclass(frozen=True)
class Target:
    """The loader a state is restored into, as the plan needs to know it (made by the
    loader at each ``load_state_dict``)."""

    facts: LoaderFacts
    fingerprint: Fingerprint
    persistent: bool  # persistent_workers
    dataset: Any
    index_sampler: Any  # the batch sampler iter() draws from; None for an iterable dataset
    source: RngSource  # the loader's generator, or the global one
    replay: str  # the replay option
    lossy: str | None  # why the dataset's own protocol is not used, when the loader decided so
    datapipe: bool  # the dataset is an IterDataPipe: each epoch draws a shared seed first
    # The generators the sampler holds (_epoch/sampler_rngs.py), whose states the
    # checkpoint's sampler_rngs are; None: not restored (an iterable dataset, or another
    # sampler allowed by allow_mismatch).
    sampler_objects: ObjectRngs | None


@dataclass(frozen=True)
class Restore:
    """What a validated checkpoint asks of a loader: the next epoch's start (resized and
    skipped, with the dataset state a finished epoch carries at num_workers=0), for a
    checkpoint taken between epochs the sampler state and the state to set on the
    loader's ``generator`` (decoded; None without one: the global RNG is the training
    loop's), the sampler's own generators' states, and what ``state_dict()`` returns
    until the next ``iter()``."""

    start: EpochStart
    sampler_state: dict[str, Any] | None
    generator_state: torch.Tensor | None
    sampler_rngs: tuple[tuple[int, bytes], ...]  # for target.sampler_objects.write
    published: dict[str, Any]


def plan_restore(state: Any, target: Target, allowed: frozenset[str], skip: Any, skip_to: Any) -> Restore:
    """Parse ``state``, check it against the loader ``target`` describes (differences in
    ``allowed`` accepted), and plan the resume from it, with ``load_state_dict``'s
    ``skip`` and ``skip_to``: :class:`CheckpointFormatError`,
    :class:`~snaploader.CheckpointMismatchError`, ``ValueError`` for a bad skip,
    :class:`~snaploader.ReplayRefusedError`, all raised here."""
    checkpoint, start, ledgers, sampler_rngs, world = _read(state, target, allowed)
    if target.facts.state_protocol and not checkpoint.ended:
        check_own_states(target.dataset, ledgers)
    if not start.record.in_order and (skip or skip_to is not None):
        raise ValueError(
            f"skip={skip}, skip_to={skip_to}: a skip counts batches in the fixed order, "
            f"and this checkpoint was taken in the middle of epoch {start.epoch} "
            "with in_order=False, whose yielded batches are not the first ones of the "
            "epoch. Skip from a checkpoint taken with in_order=True or at an epoch's end"
        )
    iterable = target.facts.iterable
    if not iterable and start.rng_start is not None:
        start = resized(start, checkpoint.fingerprint, target.fingerprint, target.index_sampler)
        if world is not None:
            start = reworlded(start, *world)
    batches = None if iterable else part_batches(target.index_sampler, start.record.item_offset, start.record.epoch_length)
    start = replace(start, skip=start.skip + skip_count(start, skip, skip_to, batches))
    if start.rng_start is not None:
        announce_replay(
            ledgers, target.dataset, target.replay, state_protocol=target.facts.state_protocol,
            lossy=target.lossy, warn=False,
        )
    ended = checkpoint.ended
    position = checkpoint.sampler_state
    published = loaded_state(checkpoint, ledgers, start.skip, target.source)
    return Restore(
        start=start,
        sampler_state=None if not ended or position is None else {"state": position.state, "done": position.done},
        generator_state=(
            torch_state_tensor(checkpoint.rng_next)
            if ended and checkpoint.rng_next is not None and target.source.generator is not None else None
        ),
        sampler_rngs=sampler_rngs,
        published=published,
    )


def _read(
    state: Any, target: Target, allowed: frozenset[str]
) -> tuple[Checkpoint, EpochStart, list[WorkerLedger], tuple[tuple[int, bytes], ...], tuple[int, bool] | None]:
    """Parse ``state`` and check it against the loader: the checkpoint, the start of
    the epoch it resumes (before a resize or a skip), its ledgers with their twist
    codes replayed, the sampler's generators' states matched to the sampler's, and
    ``another_world``'s answer for its sampler position (None: counted in this
    world's batches). The epoch it describes goes on with its own logical worker count,
    whatever this loader's ``num_workers``; the epochs after it have this loader's
    (``facts.logical_workers``; NOTE [ logical workers ] in _workers/worker_loop.py)."""
    mine, facts = target.fingerprint, target.facts
    checkpoint = parse(state)
    check_fingerprint(checkpoint.fingerprint, mine, allowed)
    saved = checkpoint.fingerprint
    world = None if facts.iterable else another_world(target.index_sampler, checkpoint.sampler_state)
    if (
        any(saved[key] != mine.values[key] for key in ("batch_size", "dataset_length"))
        or checkpoint.record.item_offset
        or checkpoint.record.epoch_length is not None
        or world is not None
    ):
        # an epoch part of another batch size or length (_format/resize.py), or one
        # counted in another world's batches: this loader's batch count says nothing of it
        facts = replace(facts, batches_per_epoch=None)
    check_consistent(checkpoint, facts)
    if not facts.iterable:
        check_sampler_resume(target.index_sampler, checkpoint.sampler_state, allowed, checkpoint.record.in_order or checkpoint.ended)
    if not checkpoint.ended:
        check_seeds(checkpoint, target.datapipe, target.dataset)
    logical = checkpoint.logical_workers
    # What a finished epoch carries at num_workers=0 is the dataset's data, read before
    # the twist codes are replayed (they change only the RNG states).
    carried = _carried_dataset_state(checkpoint.workers, logical) if checkpoint.ended else None
    ledgers = _expanded(checkpoint)
    held, blob = target.sampler_objects, checkpoint.sampler_rngs
    sampler_rngs = () if held is None or blob is None else tuple(held.matched(blob, "the sampler"))
    position = checkpoint.sampler_state
    sampler_state = None if position is None else {"state": position.state, "done": position.done}
    if checkpoint.ended:
        if target.persistent and checkpoint.epoch >= 0 and ledgers and logical == facts.logical_workers:
            start = EpochStart(
                epoch=checkpoint.epoch + 1,
                base_seed=checkpoint.base_seed,
                draw_base_seed=False,
                workers=[ledger.next_epoch() for ledger in ledgers],
                skip=checkpoint.skip,
                logical_workers=logical,
                record=checkpoint.record.next_epoch(),
            )
        else:
            start = EpochStart(epoch=checkpoint.epoch + 1, skip=checkpoint.skip, record=checkpoint.record.next_epoch())
        return checkpoint, replace(start, dataset_state=carried), ledgers, sampler_rngs, world
    expected = [None if e is None else (e.produced, e.digest) for e in checkpoint.next_batches]
    start = EpochStart(
        epoch=checkpoint.epoch,
        next_batches=expected,
        rng_start=checkpoint.rng_start,
        base_seed=checkpoint.base_seed,
        draw_base_seed=checkpoint.drew_base_seed,
        yielded=checkpoint.yielded,
        turn=checkpoint.turn,
        workers=ledgers,
        sampler_state=sampler_state,
        skip=checkpoint.skip,
        logical_workers=logical,
        record=checkpoint.record,
    )
    return checkpoint, start, ledgers, sampler_rngs, world

