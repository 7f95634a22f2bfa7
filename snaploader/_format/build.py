"""The checkpoint built from the ledger: :func:`build_state`, what ``state_dict()``
returns (the layout is in ``_format/checkpoint.py``'s docstring), and :func:`copy_state`.

``state_dict()`` may run after every training step, so it copies what is already made
rather than computing: each snapshot is made plain data once (its RNG states base64'd,
its user state encoded) and kept on the snapshot, each ledger's digest once per ledger,
the fields fixed for an epoch once per epoch, and the integrity digest is joined from
their canonical JSON (NOTE [ canonical pieces ] in ``_format/checkpoint.py``). What it
returns shares no dict or list with the loader, so it never changes afterwards (async
checkpoint writers rely on it), and editing it changes nothing in the loader.
"""

from __future__ import annotations

from typing import Any, Final

from . import plain as _plain
from .checkpoint import (
    FORMAT,
    SAME_AS_YIELDED,
    VERSION,
    Checkpoint,
    blob_piece,
    joined,
    piece,
    sha256_text,
)
from .fingerprint import CHECKED_KEYS, Fingerprint
from .._state.epoch_record import COLUMNS, EpochRecord
from .._state.ledger import EpochProgress, Position, WorkerLedger
from .._state.published import Seen
from .._state.records import Snapshot
from .._rng.capture import RngSource, rng_bytes

# NOTE [ raw RNG states ]
# state_dict() copies what the ledger holds; it searches, decodes and encodes nothing
# whose cost grows with how much a worker drew. A worker's RNG states go in as the
# worker captured them (_rng/capture.py: 2.5 KB for each moved generator, a flags bit
# for one still at its seed state), base64'd once per snapshot: about 10 KB a worker in
# the checkpoint whatever the dataset draws. Storing where a state is on its seed's
# path instead (_rng/twist.py, about 30 bytes) needs a search that walks every twist
# drawn (~1.4 us per 624 words), on this thread or, within a per-batch budget, in the
# worker, where a pipeline drawing 10,000 32-bit words a batch already outruns the
# 20 us a snapshot may cost (docs/performance.md). So checkpoints hold the raw states,
# and the twist codes of older checkpoints are still read.


def _sealed(snapshot: Snapshot, where: str) -> tuple[dict[str, Any], str]:
    """``snapshot`` as a checkpoint holds it, and that dict's canonical JSON: made once
    per (immutable) snapshot, kept on it (NOTE [ canonical pieces ])."""
    sealed = snapshot.sealed
    if sealed is not None:
        return sealed  # type: ignore[no-any-return]
    if snapshot.data is not None:
        _plain.check_plain(snapshot.data, f"{where}['data']")
    data = _plain.encode(snapshot.data)
    _plain.check_user_depth(data, f"{where}['data']")
    rng = _plain.b64(rng_bytes(snapshot.rng))  # as the worker captured it (NOTE [ raw RNG states ])
    objects = None if snapshot.objects is None else _plain.b64(snapshot.objects)
    out = {
        "rng": rng,
        "produced": snapshot.produced,
        "data": data,
        "data_owner": snapshot.data_owner,
        "complete": snapshot.complete,
        "exhausted": snapshot.exhausted,
        "objects": objects,
    }
    pieces = {key: piece(value) for key, value in out.items() if key not in ("rng", "objects")}
    pieces["rng"], pieces["objects"] = blob_piece(rng), blob_piece(objects)
    sealed = (out, joined(pieces))
    # A memo on a frozen record: the snapshot itself does not change.
    object.__setattr__(snapshot, "sealed", sealed)
    return sealed


def _fresh(plain: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
    """A copy of a sealed snapshot's dict for the caller (its values are str, int, bool
    and None, but for the user's own ``data``); None and ``SAME_AS_YIELDED`` as they are."""
    if type(plain) is not dict:
        return plain
    data = plain["data"]
    if type(data) is dict or type(data) is list:
        return {**plain, "data": copy_state(data)}
    return plain.copy()


def _ledger_to_plain(ledger: WorkerLedger, worker: int) -> tuple[dict[str, Any], str]:
    """A ledger as plain data (its snapshots as sealed, shared: copy before handing
    out) and its digest, computed once per (immutable) ledger."""
    # One read and one write of the memo, each atomic: state_dict() may run in two
    # threads at once (an async writer's and the loop's).
    cached = ledger.cache[:1]
    if cached and cached[0][0]["worker"] == worker:
        return cached[0]  # type: ignore[no-any-return]
    where = f"worker {worker}'s state"

    def sealed(snapshot: Snapshot | None, key: str) -> tuple[dict[str, Any] | None, str]:
        if snapshot is None:
            return None, "null"
        return _sealed(snapshot, f"{where}[{key!r}]")

    at = ledger.yielded
    # The epoch start is kept exactly when resuming starts from it (resume_from: nothing
    # yielded yet, or a replay with no complete snapshot to start from, or an exhausted
    # worker's): half the size with persistent workers, whose epoch start is a full
    # snapshot. A function of the position, not of how it was reached
    # (NOTE [ one state per position ]): a ledger restored from a checkpoint that left
    # it out holds no epoch start, and a fresh one at the same position must not write
    # its own.
    needs_start = at is None or (not at.complete and (at.exhausted or ledger.yielded_complete is None))
    start = sealed(ledger.epoch_start, "epoch_start") if needs_start else (None, "null")
    yielded = sealed(at, "yielded")
    if ledger.yielded_complete is at and at is not None:
        complete: tuple[dict[str, Any] | str | None, str] = (SAME_AS_YIELDED, piece(SAME_AS_YIELDED))
    else:
        complete = sealed(ledger.yielded_complete, "yielded_complete")
    out = {
        "worker": worker,
        "epoch_start": start[0],
        "yielded": yielded[0],
        "yielded_complete": complete[0],
        "exhausted": ledger.exhausted,
        "skipped": ledger.skipped,
    }
    pieces = {
        "worker": piece(worker),
        "epoch_start": start[1],
        "yielded": yielded[1],
        "yielded_complete": complete[1],
        "exhausted": piece(ledger.exhausted),
        "skipped": piece(ledger.skipped),
    }
    entry = (out, sha256_text(joined(pieces)))
    ledger.cache[:] = [entry]
    return entry


def _fresh_ledger(plain: dict[str, Any]) -> dict[str, Any]:
    out = plain.copy()
    out["epoch_start"] = _fresh(plain["epoch_start"])
    out["yielded"] = _fresh(plain["yielded"])
    out["yielded_complete"] = _fresh(plain["yielded_complete"])
    return out


def copy_state(value: Any) -> Any:
    """A copy of plain data (a checkpoint) sharing no dict or list with ``value``: what a
    loader hands out never changes when the loader goes on, nor what it keeps when the
    caller edits what it was given (an async checkpoint writer relies on the first)."""
    if isinstance(value, dict):
        return {key: copy_state(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copy_state(item) for item in value]
    return value


# The top-level blobs, whose canonical JSON is the base64 text quoted (NOTE
# [ canonical pieces ] in _format/checkpoint.py).
_TOP_BLOBS: Final = ("rng_start", "rng_next")
# The top-level fields a call reads from the position (the epoch's are made once an
# epoch, format, version and rng_kind once; fingerprint, next_batches and workers apart).
_PER_CALL: Final = ("ended", "yielded", "turn", "sampler_state", "skip", "rng_next")


def _epoch_fields(progress: EpochProgress) -> tuple[dict[str, Any], dict[str, str]]:
    """The checkpoint's fields fixed for ``progress``'s epoch, and their canonical
    JSON, made once per epoch."""
    cached = progress.cache.get("fields")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    fields: dict[str, Any] = {
        "epoch": progress.epoch,
        "rng_start": _plain.b64(progress.rng_start),
        "base_seed": progress.base_seed,
        "drew_base_seed": progress.drew_base_seed,
        "logical_workers": progress.logical_workers,
        # an epoch part's fields (_format/resize.py) and seed_per_sample's root are written
        # only when set: an ordinary checkpoint has none for an edit to turn into one
        **record_fields(progress.record),
    }
    made = (fields, _pieces(fields))
    progress.cache["fields"] = made
    return made


def record_fields(record: EpochRecord) -> dict[str, Any]:
    """The checkpoint's fields of the epoch's ``record``, in the record's order: a sparse
    one only when it is not its default."""
    out = {}
    for name, default, column in COLUMNS:
        value = getattr(record, name)
        if not (column.sparse and value == default):
            out[name] = value
    return out


def _pieces(fields: dict[str, Any]) -> dict[str, str]:
    return {key: blob_piece(value) if key in _TOP_BLOBS else piece(value) for key, value in fields.items()}


_CONSTANT: dict[str, dict[str, str]] = {}  # per rng_kind


def _constant_pieces(rng_kind: str) -> dict[str, str]:
    """The canonical JSON of the fields every checkpoint of this version has alike."""
    made = _CONSTANT.get(rng_kind)
    if made is None:
        made = _CONSTANT[rng_kind] = {"format": piece(FORMAT), "version": piece(VERSION), "rng_kind": piece(rng_kind)}
    return made


# The last fingerprint's canonical JSON: a loader's fingerprint rarely changes (its
# dataset's length may), so comparing is cheaper than encoding. One tuple, replaced
# whole, so that another thread's call can only miss it.
_last_fingerprint: tuple[dict[str, Any], str] = ({}, "")


def _fingerprint_piece(values: dict[str, Any]) -> str:
    global _last_fingerprint
    last = _last_fingerprint
    if last[0] == values:
        return last[1]
    made = piece(values)
    _last_fingerprint = (dict(values), made)
    return made


def build_state(fingerprint: Fingerprint, seen: Seen, source: RngSource, logical: int) -> dict[str, Any]:
    """The checkpoint of a loader of ``logical`` logical workers whose current (or
    last) epoch is ``seen.progress``, at ``seen.position``; with ``seen.rng_next``, the
    state ``source``'s next epoch draws from, when the epoch has ended (both read
    together by ``Publisher.read``: NOTE [ epoch start ] in _state/published.py); or
    a copy of ``seen.loaded``, the checkpoint loaded and not yet started.

    It copies what is already made: each snapshot is encoded once, the fields fixed
    for an epoch once an epoch, and the digest joins their canonical JSON (NOTE
    [ canonical pieces ]); what it returns shares no dict or list with the loader."""
    if seen.loaded is not None:
        return copy_state(seen.loaded)
    progress, position = seen.progress, seen.position
    values = fingerprint.values
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": copy_state(values),
        "rng_kind": source.kind,
    }
    ledgers: list[tuple[dict[str, Any], str]] = []
    if progress is None:
        fixed: dict[str, Any] = {
            "epoch": -1, "rng_start": None, "base_seed": None, "drew_base_seed": True, "logical_workers": logical,
            **record_fields(EpochRecord()),
        }
        fixed_pieces = _pieces(fixed)
        # No epoch begun: a position given says only the skip a load asked for.
        state.update(fixed, ended=True, yielded=0, turn=0, sampler_state=None, skip=0 if position is None else position.skip)
    else:
        fixed, fixed_pieces = _epoch_fields(progress)
        position = progress.position if position is None else position
        sampler_state = position.sampler_state
        if sampler_state is not None:
            _plain.check_plain(sampler_state["state"], "the sampler's state_dict()")
            encoded = _plain.encode(sampler_state["state"])
            _plain.check_user_depth(encoded, "the sampler's state_dict()")
            sampler_state = {"state": encoded, "done": sampler_state["done"]}
        state.update(
            fixed,
            ended=position.ended,
            yielded=position.yielded,
            turn=position.turn,
            sampler_state=sampler_state,
            skip=position.skip,
        )
        ledgers = [_ledger_to_plain(ledger, w) for w, ledger in enumerate(position.workers)]
    rng_next = seen.rng_next
    state["rng_next"] = _plain.b64(rng_next) if state["ended"] and rng_next is not None else None
    # The sampler's generators (_epoch/sampler_rngs.py): written only when it holds one.
    sampler_rngs = None if progress is None else progress.sampler_rngs_next if state["ended"] else progress.sampler_rngs
    if sampler_rngs is not None:
        state["sampler_rngs"] = _plain.b64(sampler_rngs)
    # One None per ledger: the prefetched batches' digests that older releases kept here
    # depended on what had arrived when the call ran (NOTE [ one state per position ]).
    state["next_batches"] = [None] * len(ledgers)
    # The digest (checkpoint.digest_of), from pieces: the fixed ones as made, the rest now.
    pieces = {
        **fixed_pieces,
        **_constant_pieces(source.kind),
        "fingerprint": _fingerprint_piece(values),
        **_pieces({key: state[key] for key in _PER_CALL}),
        **({} if sampler_rngs is None else {"sampler_rngs": blob_piece(state["sampler_rngs"])}),
        "next_batches": "[" + ",".join(["null"] * len(ledgers)) + "]",
        "workers": "[" + ",".join(['"' + digest + '"' for _, digest in ledgers]) + "]",
    }
    state["workers"] = [_fresh_ledger(plain) for plain, _ in ledgers]
    state["digest"] = "sha256:" + sha256_text(joined(pieces))
    return state


def loaded_state(
    checkpoint: Checkpoint, ledgers: list[WorkerLedger], skip: int, source: RngSource
) -> dict[str, Any]:
    """What ``state_dict()`` returns between ``load_state_dict()`` and the next ``iter()``:
    the checkpoint as this version writes it (NOTE [ one state per position ] in
    ``_format/checkpoint.py``), built from the parse like any other state: an older
    version's layout, twist codes (``ledgers``: expanded), keys snaploader does not own,
    an epoch start resuming does not use, come out as a fresh state at that position
    has them. ``skip``: the batches still to skip, a load's own included."""
    saved = checkpoint.fingerprint
    # in the order fingerprint_of writes them (torch.save's bytes follow a dict's order)
    fingerprint = Fingerprint({key: saved[key] for key in (*CHECKED_KEYS, *saved) if key in saved})
    seen = _unbegun(checkpoint, skip) if checkpoint.epoch < 0 else _begun(checkpoint, ledgers, skip)
    return build_state(fingerprint, seen, source, checkpoint.logical_workers)


def _begun(checkpoint: Checkpoint, ledgers: list[WorkerLedger], skip: int) -> Seen:
    """A checkpoint of an epoch begun, as ``build_state`` reads it: its progress at its
    position, ``ledgers`` its ledgers with their twist codes replayed."""
    sampler = checkpoint.sampler_state
    position = Position(
        yielded=checkpoint.yielded,
        turn=checkpoint.turn,
        workers=tuple(ledgers),
        ended=checkpoint.ended,
        sampler_state=None if sampler is None else {"state": sampler.state, "done": sampler.done},
        skip=skip,
    )
    assert checkpoint.rng_start is not None and checkpoint.base_seed is not None  # the parse's
    progress = EpochProgress(
        epoch=checkpoint.epoch,
        rng_start=checkpoint.rng_start,
        base_seed=checkpoint.base_seed,
        drew_base_seed=checkpoint.drew_base_seed,
        position=position,
        logical_workers=checkpoint.logical_workers,
        record=checkpoint.record,
        sampler_rngs=None if checkpoint.ended else checkpoint.sampler_rngs,
        sampler_rngs_next=checkpoint.sampler_rngs if checkpoint.ended else None,
    )
    return Seen(None, progress, position, checkpoint.rng_next if checkpoint.ended else None)


def _unbegun(checkpoint: Checkpoint, skip: int) -> Seen:
    """A checkpoint taken before any epoch began, as ``build_state`` reads it: the next
    epoch's generator state and the skip a load asked for."""
    return Seen(None, None, Position(yielded=0, turn=0, workers=(), skip=skip), checkpoint.rng_next)
