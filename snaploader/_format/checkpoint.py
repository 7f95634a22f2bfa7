"""The checkpoint as typed data: :class:`Checkpoint`, what ``_format/parse.py`` makes of
an untrusted state in one pass, and what everything after the parse reads (the loader's
checks, the restore plan, ``distributed``, ``inspect``). Also the integrity digest and
:func:`resign`, the one place that computes it for a whole state.

A checkpoint is JSON-safe plain data (dict with str keys, list, str, int, float, bool,
None; ``_format/plain.py``), so ``json.dumps`` and ``torch.load(weights_only=True)`` both take
it. It is untrusted input on load: ``_format/parse.py`` turns it into a typed
:class:`~snaploader._format.checkpoint.Checkpoint` (every field's type and range, the
integrity digest, blobs decoded once), then ``_format/restore.py``'s :func:`plan_restore`
compares it with the loader (the fingerprint, ``_format/schema.py``), replays the RNG
states' twist codes and plans the restore, all before anything forks; every problem is a
:class:`CheckpointFormatError` naming the key path.
Layout (version 3; version 2 is read too, see ``READABLE_VERSIONS``)::

    format         "snaploader"
    version        3
    digest         "sha256:<hex>" over the canonical JSON of the rest, each ledger
                   replaced by the SHA-256 of its own (checkpoint.digest_of)
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
    logical_workers the epoch's logical worker count (0: num_workers=0's main-process
                   contract); the stream's, whatever num_workers resumes it
                   (NOTE [ logical workers ] in _workers/worker_loop.py)
    skip           batches still to skip before the next one is yielded (a skip asked
                   with ``load_state_dict(skip=...)`` and not yet carried out; it
                   applies to the next epoch when ``ended``); absent in older files: 0
    shared_seed, sampler_epoch, in_order, item_offset, epoch_length, sample_root
                   the epoch's record (``_state/epoch_record.py``: each field's meaning,
                   its types and range, its default, which older files may lack it
                   and which are written only when not their default)
    sampler_rngs   base64 of the states of the generator objects the sampler and batch
                   sampler hold (encoded as a snapshot's objects, _rng/kinds.py): at the
                   epoch start, or for the next epoch when ``ended``
                   (_epoch/sampler_rngs.py); written only when they hold one (absent: an
                   older file's, loaded with them left as built; None is refused)
    next_batches   one None per ledger (NOTE [ one state per position ] in _format/checkpoint.py);
                   files written before 2026-12-03 may hold per worker {produced, digest}
                   of its next batch when it had already arrived, still checked after a
                   restore (the resume self-check, _workers/selfcheck.py)
    workers        one ledger per logical worker (see _state/ledger.py):
                   {worker, epoch_start, yielded, yielded_complete, exhausted, skipped}
                   (worker: its logical index, equal to its place in the list)
                   (skipped: map-style batches of the worker's share a skip passed
                   over since its last snapshot; absent in older files: 0), each snapshot
                   {rng (base64 of the raw states, _rng/capture.py; older files may hold
                   twist codes, _rng/twist.py), produced, data,
                   data_owner ("dataset", "iterator", or "both", torchdata's pair
                   of an iterable whose iterator is not the dataset: then data is
                   {"dataset": ..., "iterator": ...}; or None), complete, exhausted,
                   objects (base64 of the generator objects' states, _rng/kinds.py, or
                   None)};
                   yielded_complete is "same as yielded" when it is; epoch_start is
                   None unless resuming starts from it (nothing yielded yet, a replay
                   with no complete snapshot, an exhausted worker's last state)

Keys other than these at the top level are not snaploader's (NOTE [ foreign keys ] in
_format/checkpoint.py): not covered by the digest, not read.

User data (``data``, ``sampler_state.state``) is stored through ``_format/plain.py``'s ``encode``.

Adding a field: one the checkpoint keeps for an epoch is a field of the epoch's record
(``_state/epoch_record.py`` says how); the field tables below are derived from it. Any
other field gets a row in the tables here with the default that an older file's absence
of it means (``ADDED_TOP``), and its read in ``_format/parse.py`` and write in
``_format/build.py``; files without it keep loading, so the format version does not
change for it.
"""

from __future__ import annotations

import hashlib
import json
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from .plain import check_depth  # distributed/resharded.py imports it from here
from .._errors import CheckpointFormatError
from .._state.epoch_record import COLUMNS, EpochRecord
from .._state.ledger import WorkerLedger

FORMAT: Final = "snaploader"
VERSION: Final = 3
# Version 2 lacks ``logical_workers`` (it was the fingerprint's num_workers) and each
# ledger's ``worker``; the parse fills both in (``_format/parse.py``, ``_upgrade``).
READABLE_VERSIONS: Final = (2, 3)
SAME_AS_YIELDED: Final = "same as yielded"

# NOTE [ checkpoint limits ]
# A load's work is bounded by the size of a plausible checkpoint, so that a crafted one
# is refused quickly instead of taking minutes or gigabytes: the nesting depth is
# checked before anything recursive runs (the digest's JSON encoding, the decoding of
# user state), the logical worker count is bounded, and so is the total number of
# Mersenne Twister twists the RNG states' codes ask to replay (``_rng/twist.py``; the
# writer never writes more, storing the rest raw). A dataset whose own state_dict() is
# nested deeper than MAX_DEPTH is refused when the checkpoint is made, not when it loads
# (both depth checks are _format/plain.py's, beside what a checkpoint may hold).


# -- the plain layout, field by field (what the parse checks before decoding) -----------

_OPTIONAL_INT: Final = (int, type(None))
_OPTIONAL_STR: Final = (str, type(None))

HEAD_FIELDS: Final[dict[str, tuple[type, ...]]] = {"format": (str,), "version": (int,)}
TOP_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "digest": (str,),
    "fingerprint": (dict,),
    "epoch": (int,),
    "ended": (bool,),
    "yielded": (int,),
    "turn": (int,),
    "rng_kind": (str,),
    "rng_start": _OPTIONAL_STR,
    "rng_next": _OPTIONAL_STR,
    "base_seed": _OPTIONAL_INT,
    "drew_base_seed": (bool,),
    "sampler_state": (dict, type(None)),
    "logical_workers": (int,),
    "skip": (int,),
    "sampler_rngs": _OPTIONAL_STR,
    "next_batches": (list,),
    "workers": (list,),
    **{name: column.kinds for name, _, column in COLUMNS},  # the epoch's record
}
LEDGER_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "worker": (int,),
    "epoch_start": (dict, type(None)),
    "yielded": (dict, type(None)),
    "yielded_complete": (dict, str, type(None)),
    "exhausted": (bool,),
    "skipped": (int,),
}
SNAPSHOT_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "rng": (str,),
    "produced": (int,),
    "data_owner": _OPTIONAL_STR,
    "complete": (bool,),
    "exhausted": (bool,),
    "objects": (str, type(None)),
}
FINGERPRINT_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "dataset_kind": (str,),
    "dataset_length": _OPTIONAL_INT,
    "batch_size": _OPTIONAL_INT,
    "num_workers": (int,),
    "drop_last": (bool,),
    "sampler": (str,),
    "batch_sampler": _OPTIONAL_STR,
    "persistent_workers": (bool,),
    "generator": (str,),
}
# NOTE [ foreign keys ]
# A framework may write its own note into the loader's state: Accelerate's stateful-loader
# path sets state["_iterator_finished"] after every batch (DataLoaderAdapter). A top-level
# key that is not in HEAD_FIELDS or TOP_FIELDS is not snaploader's: the digest does not
# cover it, the parse does not read it, and the state a loader returns after loading it
# does not carry it (it is rebuilt from the parse, _format/build.py's loaded_state: the
# framework writes its note again into the state it takes next). So such a key is never
# taken for corruption, and an edit of a field snaploader owns still is.

# NOTE [ one state per position ]
# A state is a function of the position and the loader's arguments: the same dict, and
# so the same bytes, whether the position was reached fresh, after one resume or many,
# and whatever the workers had prefetched, so that checkpoints can be compared, deduped
# and saved again. What could differ is written canonically: a ledger's epoch start
# exactly when resuming starts from it (_format/build.py), never because an earlier
# checkpoint had one; next_batches as one None per ledger (older releases kept there the
# digests of the prefetched batches that had arrived when the call ran: timing; they are
# still checked when read, _workers/selfcheck.py); and a loaded state, until its epoch
# starts, as this version writes it (an older layout or twist codes rewritten, foreign
# keys left out). tests/test_state_per_position.py compares fresh and resumed states.

# Fields added to a version after it was first written: their absence means this.
ADDED_TOP: Final[dict[str, Any]] = {
    "skip": 0, "sampler_rngs": None,
    **{name: default for name, default, column in COLUMNS if not column.required},
}
ADDED_LEDGER: Final[dict[str, Any]] = {"skipped": 0}


@dataclass(frozen=True)
class DistributedArgs:
    """torch's ``DistributedSampler`` arguments as the checkpoint recorded them."""

    num_replicas: int
    rank: int
    shuffle: bool
    seed: int
    drop_last: bool


@dataclass(frozen=True)
class NextBatch:
    """A worker's next batch, already received when the checkpoint was taken: its
    produced count and digest, for the resume self-check (``_workers/selfcheck.py``)."""

    produced: int
    digest: str


@dataclass(frozen=True)
class SamplerPosition:
    """A stateful sampler's own state before the next batch (decoded), and whether it
    has nothing left this epoch."""

    state: Any
    done: bool


@dataclass(frozen=True)
class Checkpoint:
    """A loader state, parsed: every field checked and decoded, the digest verified,
    an older version upgraded. Nothing here has been compared with a loader yet
    (``_format/schema.py`` does that). RNG states are bytes; a worker snapshot's RNG
    states may still hold twist codes (``_rng/twist.py``), expanded once per load,
    after the cheap checks (``_format/restore.py``)."""

    version: int  # the version the file was written in
    digest: str
    fingerprint: MappingProxyType[str, Any]  # FINGERPRINT_KEYS, and "distributed" when recorded
    distributed: DistributedArgs | None
    epoch: int  # -1: no epoch started yet
    ended: bool
    yielded: int
    turn: int
    rng_kind: str
    rng_start: bytes | None
    rng_next: bytes | None
    base_seed: int | None
    drew_base_seed: bool
    sampler_state: SamplerPosition | None
    logical_workers: int
    skip: int
    record: EpochRecord  # shared_seed, sampler_epoch, in_order, item_offset, epoch_length, sample_root
    # The generator objects the sampler and batch sampler hold (_epoch/sampler_rngs.py),
    # encoded as a snapshot's objects: as of the epoch start (mid-epoch), or for the next
    # epoch (ended); None: they hold none, or the file predates them.
    sampler_rngs: bytes | None
    next_batches: tuple[NextBatch | None, ...]
    workers: tuple[WorkerLedger, ...]

    @property
    def slots(self) -> int:
        """The logical worker slots of the epoch it describes (0 workers: one slot)."""
        return max(1, self.logical_workers)

    @property
    def consumed(self) -> int:
        """Batches of the epoch that are behind the position: yielded, or skipped."""
        return self.yielded + self.skip


# -- the digest ------------------------------------------------------------------------


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_of(value: Any) -> str:
    return hashlib.sha256(_canonical(value)).hexdigest()


# NOTE [ canonical pieces ]
# The digest is over canonical JSON (sorted keys, no spaces, ASCII), and json.dumps
# is slow on what a checkpoint holds: it scans every character of a 10 KB base64 text
# for escapes (~23 us) and costs ~2 us a call besides. state_dict() writes the same
# bytes from pieces instead: a value's canonical JSON made once where it is made (a
# snapshot's when its ledger is first written, the epoch's fields once an epoch) and
# joined. piece() is json.dumps's C encoder, made once with the same settings;
# blob_piece() quotes a text that b64() made, whose alphabet JSON never escapes. Every load checks the digest through
# json.dumps itself (check_digest), so a piece that differed would fail every resume
# test rather than pass unnoticed; tests/test_checkpoint.py compares the two directly.


def _refuse(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# json.dumps's own C encoder with _canonical's settings (sorted keys, compact, ASCII),
# made once: json.dumps builds one per call, which costs more than encoding a small value.
_ENCODER: Final = None if c_make_encoder is None else c_make_encoder(
    None, _refuse, encode_basestring_ascii, None, ":", ",", True, False, True
)


def piece(value: Any) -> str:
    """``value``'s canonical JSON, as ``_canonical`` makes it (as text)."""
    kind = type(value)
    if kind is int:
        return int.__repr__(value)  # what json writes for an int, without a call into it
    if value is None or kind is bool:
        return "null" if value is None else "true" if value else "false"
    if kind is str:
        return encode_basestring_ascii(value)  # what the encoder writes for a str
    if _ENCODER is None:
        return _canonical(value).decode("ascii")
    return "".join(_ENCODER(value, 0))


def blob_piece(text: str | None) -> str:
    """The canonical JSON of a base64 text made by ``plain.b64`` (or None)."""
    return "null" if text is None else '"' + text + '"'


# The sorted order of each set of keys joined, each key's canonical JSON with its colon:
# a checkpoint's dicts come in a few layouts, joined again at every call. Bounded: the
# keys are snaploader's.
_LAYOUTS: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {}
_MAX_LAYOUTS: Final = 64


def joined(pieces: dict[str, str]) -> str:
    """The canonical JSON of a str-keyed dict whose values' canonical JSON is ``pieces``."""
    keys = tuple(pieces)
    layout = _LAYOUTS.get(keys)
    if layout is None:
        layout = tuple((key, encode_basestring_ascii(key) + ":") for key in sorted(keys))
        if len(_LAYOUTS) < _MAX_LAYOUTS:
            _LAYOUTS[keys] = layout
    return "{" + ",".join([head + pieces[key] for key, head in layout]) + "}"


def sha256_text(canonical: str) -> str:
    """The SHA-256 of a canonical JSON text (ASCII), as ``sha256_of`` gives it for the value."""
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def owned(key: str) -> bool:
    """Whether a checkpoint's top-level ``key`` is snaploader's (NOTE [ foreign keys ])."""
    return (key in TOP_FIELDS or key in HEAD_FIELDS) and key != "digest"


def digest_of(state: dict[str, Any], ledger_digests: list[str]) -> str:
    """The integrity digest: SHA-256 over the canonical JSON of ``state``'s own fields
    (NOTE [ foreign keys ]) but its ``digest``, each ledger replaced by the SHA-256 of its
    own canonical JSON (so that a ledger that did not change since the last
    ``state_dict()`` is not hashed again)."""
    body = {key: value for key, value in state.items() if owned(key)}
    body["workers"] = ledger_digests
    return "sha256:" + sha256_of(body)


def check_digest(state: dict[str, Any], where: str = "loader state") -> None:
    """Raise unless ``state['digest']`` is the digest of the rest (``state`` has a
    ``workers`` list and a depth already checked)."""
    workers = state.get("workers")
    try:
        expected = digest_of(state, [sha256_of(ledger) for ledger in workers] if isinstance(workers, list) else [])
    except (TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"{where} holds something that is not plain data ({exc})") from None
    if state.get("digest") != expected:
        raise CheckpointFormatError(
            f"{where}['digest'] "
            "does not match the state's contents: the checkpoint was modified or corrupted "
            "after state_dict() made it. Load an unmodified checkpoint",
        )


def resign(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of the loader state ``state`` with its digest computed afresh: how a
    deliberate editor (and a test) makes an edited state that only the field checks can
    refuse. (A load's own state, a skip included, is built from the parse instead:
    ``_format/build.py``'s ``loaded_state``.)"""
    out = dict(state)
    out["digest"] = digest_of(out, [sha256_of(ledger) for ledger in out["workers"]])
    return out
