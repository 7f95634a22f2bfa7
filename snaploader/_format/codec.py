"""The checkpoint format, all of it: build, validate, fingerprint, plain conversion.

A checkpoint is JSON-safe plain data (dict with str keys, list, str, int, float, bool,
None; ``_format/plain.py``), so ``json.dumps`` and ``torch.load(weights_only=True)`` both take
it. It is untrusted input on load: :func:`read_state` checks every field's type, range
and consistency with the others and with the loader, and an integrity digest, before
anything forks; every problem is a :class:`CheckpointFormatError` naming the key path.
Layout (version 3; version 2 is read too, see ``_layout.READABLE_VERSIONS``)::

    format         "snaploader"
    version        3
    digest         "sha256:<hex>" over the rest (see :func:`digest_of`)
    fingerprint    {dataset_kind, dataset_length, batch_size, num_workers, drop_last,
                    sampler, batch_sampler, persistent_workers, generator,
                    distributed}: distributed is torch's DistributedSampler's
                   {num_replicas, rank, shuffle, seed, drop_last} or None for another
                   sampler; absent in older version-3 files (then not compared)
    epoch          index of the epoch this describes (-1: none started yet)
    ended          True when that epoch is over: the next iter() starts epoch + 1
    yielded        batches yielded in that epoch
    turn           iterable datasets: the worker whose batch comes next
    rng_kind       "generator" or "global": what the epoch's draws came from
    rng_start      base64 of that generator's state at the epoch start, or None
    rng_next       base64 of the generator's state for the next epoch, or None
    base_seed      the epoch's worker base seed; drew_base_seed: drawn this epoch
    sampler_state  {state, done}: the stateful sampler's state before the next batch
                   (done: it has nothing left this epoch), or None
    sampler_epoch  the sampler's ``epoch`` (DistributedSampler), or None
    logical_workers the epoch's logical worker count (0: num_workers=0's main-process
                   contract); the stream's, whatever num_workers resumes it
                   (NOTE [ logical workers ] in _workers/process_main.py)
    skip           batches still to skip before the next one is yielded (a skip asked
                   with ``load_state_dict(skip=...)`` and not yet carried out; it
                   applies to the next epoch when ``ended``); absent in older files: 0
    in_order       False when the epoch's batches may have been yielded out of the fixed
                   order (in_order=False): the ledgers' counts are then the position,
                   and ``yielded`` only their sum; absent in older files: True
    item_offset    sampler items consumed before the epoch's batch 0, for an epoch
                   resumed with another batch size (_epoch/resize.py); written only
                   when not 0 (absent: 0)
    epoch_length   the dataset length the epoch runs over when a resume changed it
                   (_epoch/resize.py); written only then (absent: the fingerprint's)
    next_batches   per worker, {produced, digest} of its next batch when it had already
                   arrived (the resume self-check, _workers/selfcheck.py), or None
    workers        one ledger per logical worker (see _state/ledger.py):
                   {worker, epoch_start, yielded, yielded_complete, exhausted, skipped}
                   (worker: its logical index, equal to its place in the list)
                   (skipped: map-style batches of the worker's share a skip passed
                   over since its last snapshot; absent in older files: 0), each snapshot
                   {rng (base64; moved states as twist codes, _rng/twist.py), produced, data,
                   data_owner, complete, exhausted,
                   objects (base64 of the generator objects' states, _rng/kinds.py, or
                   None)};
                   yielded_complete is "same as yielded" when it is; epoch_start is
                   None unless resuming needs it (nothing yielded yet, or a replay)

User data (``data``, ``sampler_state.state``) is stored through ``_plain.encode``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from . import plain as _plain
from .fingerprint import Fingerprint, check_fingerprint
from .schema import (
    FORMAT,
    SAME_AS_YIELDED,
    VERSION,
    LoaderFacts,
    check_consistent,
    digest_of,
    logical_workers_of,
    sha256_of,
    validate,
)
from .._state.ledger import EpochProgress, EpochStart, Position, WorkerLedger
from .._state.records import Snapshot
from .._rng.capture import RngSource, rng_bytes
from .._rng.twist import SEARCH_BUDGET_S, compact

# -- building a checkpoint ---------------------------------------------------------------


def _snapshot_to_plain(
    snapshot: Snapshot, where: str, seeded: tuple[int, int] | None, deadline: float = float("inf")
) -> dict[str, Any]:
    """``seeded``: (base seed, worker index) the snapshot's worker was seeded with, or
    None when unknown (its RNG states are then stored raw); ``deadline``: when to stop
    searching for their twist codes (_rng/twist.py)."""
    if snapshot.data is not None:
        _plain.check_plain(snapshot.data, f"{where}['data']")
    rng = rng_bytes(snapshot.rng)
    return {
        "rng": _plain.b64(rng if seeded is None else compact(rng, *seeded, deadline)),
        "produced": snapshot.produced,
        "data": _plain.encode(snapshot.data),
        "data_owner": snapshot.data_owner,
        "complete": snapshot.complete,
        "exhausted": snapshot.exhausted,
        "objects": None if snapshot.objects is None else _plain.b64(snapshot.objects),
    }


def _ledger_to_plain(
    ledger: WorkerLedger, worker: int, seeded: tuple[int, int] | None, deadline: float = float("inf")
) -> tuple[dict[str, Any], str]:
    """A ledger as plain data and its digest, computed once per (immutable) ledger."""
    if ledger.cache and ledger.cache[0][0]["worker"] == worker:
        return ledger.cache[0]
    ledger.cache.clear()
    where = f"worker {worker}'s state"

    def plain(snapshot: Snapshot | None, key: str) -> dict[str, Any] | None:
        return None if snapshot is None else _snapshot_to_plain(snapshot, f"{where}[{key!r}]", seeded, deadline)

    at = ledger.yielded
    # Resuming from a complete snapshot needs nothing else: keep the epoch start only
    # when nothing was yielded yet or a replay starts from it (half the size with
    # persistent workers, whose epoch start is a full snapshot).
    needs_start = at is None or not at.complete
    same = ledger.yielded_complete is at and at is not None
    # Oldest first: finding an RNG state on its seed's path resumes where the last
    # search stopped (_rng/twist.py), so a newer state first would leave the older raw.
    start = plain(ledger.epoch_start, "epoch_start") if needs_start else None
    complete = SAME_AS_YIELDED if same else plain(ledger.yielded_complete, "yielded_complete")
    out = {
        "worker": worker,
        "epoch_start": start,
        "yielded": plain(at, "yielded"),
        "yielded_complete": complete,
        "exhausted": ledger.exhausted,
        "skipped": ledger.skipped,
    }
    entry = (out, sha256_of(out))
    if time.monotonic() <= deadline:  # else a state may be raw for want of time: search again next call
        ledger.cache.append(entry)
    return entry


def _copy(value: Any) -> Any:
    # The cached ledger must not be handed out: a caller editing its state would edit it.
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy(item) for item in value]
    return value


def build_state(
    fingerprint: Fingerprint, progress: EpochProgress | None, source: RngSource, logical: int
) -> dict[str, Any]:
    """The checkpoint of a loader of ``logical`` logical workers whose current (or
    last) epoch is ``progress``. Reads ``progress.position`` once, so it is consistent
    from any thread."""
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": dict(fingerprint.values),
        "rng_kind": source.kind,
    }
    ledgers: list[tuple[dict[str, Any], str]] = []
    next_batches: list[dict[str, Any] | None] = []
    if progress is None:
        state.update(
            epoch=-1, ended=True, yielded=0, turn=0, rng_start=None,
            base_seed=None, drew_base_seed=True, sampler_state=None, sampler_epoch=None,
            skip=0, logical_workers=logical, in_order=True,
        )
    else:
        position: Position = progress.position
        sampler_state = position.sampler_state
        if sampler_state is not None:
            _plain.check_plain(sampler_state["state"], "the sampler's state_dict()")
            sampler_state = {"state": _plain.encode(sampler_state["state"]), "done": sampler_state["done"]}
        state.update(
            epoch=progress.epoch,
            ended=position.ended,
            yielded=position.yielded,
            turn=position.turn,
            rng_start=_plain.b64(progress.rng_start),
            base_seed=progress.base_seed,
            drew_base_seed=progress.drew_base_seed,
            sampler_state=sampler_state,
            sampler_epoch=progress.sampler_epoch,
            skip=position.skip,
            logical_workers=progress.logical,
            in_order=progress.in_order,
        )
        # Written only in an epoch part (_epoch/resize.py): an ordinary checkpoint is
        # unchanged, and has no such field for an edit to turn into one.
        if progress.item_offset:
            state["item_offset"] = progress.item_offset
        if progress.epoch_length is not None:
            state["epoch_length"] = progress.epoch_length
        deadline = time.monotonic() + SEARCH_BUDGET_S
        ledgers = [
            _ledger_to_plain(ledger, w, (progress.base_seed, w), deadline)
            for w, ledger in enumerate(position.workers)
        ]
        next_batches = [
            None if entry is None else {"produced": entry[0], "digest": entry[1]}
            for entry in progress.next_digests()
        ]
    state["rng_next"] = (
        _plain.b64(source.get_state()) if state["ended"] and source.generator is not None else None
    )
    state["next_batches"] = next_batches
    state["workers"] = [_copy(plain) for plain, _ in ledgers]
    state["digest"] = digest_of(state, [digest for _, digest in ledgers])
    return state



# -- reading a checkpoint ----------------------------------------------------------------


def _snapshot_from_plain(plain: dict[str, Any], where: str) -> Snapshot:
    return Snapshot(
        rng=_plain.unb64(plain["rng"], f"{where}['rng']"),
        produced=plain["produced"],
        data=_plain.decode(plain["data"], f"{where}['data']"),
        data_owner=plain["data_owner"],
        complete=plain["complete"],
        exhausted=plain["exhausted"],
        objects=None if plain.get("objects") is None else _plain.unb64(plain["objects"], f"{where}['objects']"),
    )


def _ledger_from_plain(plain: dict[str, Any], where: str) -> WorkerLedger:
    def snap(key: str) -> Snapshot | None:
        value = plain[key]
        return None if not isinstance(value, dict) else _snapshot_from_plain(value, f"{where}[{key!r}]")

    yielded = snap("yielded")
    return WorkerLedger(
        epoch_start=snap("epoch_start"),
        yielded=yielded,
        yielded_complete=yielded if plain["yielded_complete"] == SAME_AS_YIELDED else snap("yielded_complete"),
        exhausted=plain["exhausted"],
        skipped=plain.get("skipped", 0),
    )


def _carried_dataset_state(ledgers: list[WorkerLedger], logical: int) -> Any:
    if logical != 0 or not ledgers:
        return None
    last = ledgers[0].yielded or ledgers[0].epoch_start
    if last is None or last.data_owner != "dataset" or not last.complete:
        return None
    return last.data


@dataclass(frozen=True)
class Restore:
    """What a validated checkpoint asks of a loader: the next epoch's start, and for a
    checkpoint taken between epochs, the sampler state and generator state to set."""

    start: EpochStart
    ledgers: list[WorkerLedger]
    sampler_state: Any
    rng_next: bytes | None
    # num_workers=0 iterates the dataset object itself, so what its own state_dict()
    # held at the end of a finished epoch carries into the next, as in torch: the
    # loader's dataset is set to it (None: nothing to set).
    dataset_state: Any = None


def read_state(
    state: Any, mine: Fingerprint, allowed: frozenset[str], facts: LoaderFacts, persistent: bool
) -> Restore:
    """Validate ``state`` in full against this loader and say how to resume from it.
    The epoch it describes goes on with its own logical worker count, whatever this
    loader's ``num_workers``; the epochs after it have this loader's (``facts.logical``;
    NOTE [ logical workers ] in _workers/process_main.py)."""
    validate(state)
    check_fingerprint(state, mine, allowed)
    logical = logical_workers_of(state)
    saved = state["fingerprint"]
    if (
        any(saved[key] != mine.values[key] for key in ("batch_size", "dataset_length"))
        or state.get("item_offset", 0)
        or state.get("epoch_length") is not None
    ):
        # an epoch part of another batch size or length (_epoch/resize.py): this
        # loader's batch count says nothing of it
        facts = replace(facts, batches_per_epoch=None)
    check_consistent(state, replace(facts, slots=max(1, logical)))
    ledgers = [_ledger_from_plain(plain, f"loader state['workers'][{w}]") for w, plain in enumerate(state["workers"])]
    sampler_state = state["sampler_state"]
    if sampler_state is not None:
        sampler_state = {
            "state": _plain.decode(sampler_state["state"], "loader state['sampler_state']['state']"),
            "done": sampler_state["done"],
        }
    if state["ended"]:
        if persistent and state["epoch"] >= 0 and ledgers and logical == facts.logical:
            start = EpochStart(
                epoch=state["epoch"] + 1,
                base_seed=state["base_seed"],
                draw_base_seed=False,
                workers=[ledger.next_epoch() for ledger in ledgers],
                skip=state.get("skip", 0),
                logical=logical,
            )
        else:
            start = EpochStart(epoch=state["epoch"] + 1, skip=state.get("skip", 0))
        rng_next = None if state["rng_next"] is None else _plain.unb64(state["rng_next"], "rng_next")
        return Restore(start, ledgers, sampler_state, rng_next, _carried_dataset_state(ledgers, logical))
    expected = [None if e is None else (e["produced"], e["digest"]) for e in state["next_batches"]]
    start = EpochStart(
        epoch=state["epoch"],
        expected_digests=expected,
        restore_rng=_plain.unb64(state["rng_start"], "loader state['rng_start']"),
        base_seed=state["base_seed"],
        draw_base_seed=state["drew_base_seed"],
        yielded=state["yielded"],
        turn=state["turn"],
        workers=ledgers,
        sampler_state=sampler_state,
        sampler_epoch=state["sampler_epoch"],
        skip=state.get("skip", 0),
        logical=logical,
        in_order=state.get("in_order", True),
        item_offset=state.get("item_offset", 0),
        epoch_length=state.get("epoch_length"),
    )
    return Restore(start, ledgers, None, None)

