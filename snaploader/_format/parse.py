"""An untrusted loader state turned into a :class:`~snaploader._format.checkpoint.Checkpoint`
in one pass: :func:`parse`.

In order, each problem a :class:`CheckpointFormatError` naming the key path: the
nesting depth (before anything recursive runs; NOTE [ checkpoint limits ]), the format
and version, the upgrade of an older version (the one place that knows what an older
file lacks: :func:`_upgrade`), every field's type and range (counts and indices below
``MAX_COUNT``, seeds within torch's), the logical worker count against the ledgers,
each blob decoded once (base64, RNG states with their twist codes' headers,
generator-object records, user state), the facts that tie fields together without a
loader, the total twists the RNG states ask to replay; and last the integrity digest,
over snaploader's own fields (NOTE [ foreign keys ]), so that a malformed field is
named (with the digest's mismatch beside it when it has one). Every check before the
digest is bounded, so an unsigned edit costs no more than a signed one. Nothing a
loader decides is checked here (``_format/schema.py``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Final

import torch

from . import plain as _plain
from .checkpoint import (
    ADDED_LEDGER,
    ADDED_TOP,
    FINGERPRINT_FIELDS,
    HEAD_FIELDS,
    LEDGER_FIELDS,
    SNAPSHOT_FIELDS,
    TOP_FIELDS,
    FORMAT,
    READABLE_VERSIONS,
    SAME_AS_YIELDED,
    Checkpoint,
    DistributedArgs,
    NextBatch,
    SamplerPosition,
    check_digest,
)
from .fingerprint import DEFAULTED_KEYS, DISTRIBUTED_FIELDS, FINGERPRINT_KEYS
from .._errors import CheckpointFormatError
from .._options import MAX_LOGICAL_WORKERS
from .._rng.capture import RngSource, check_rng
from .._rng.objects import check_objects
from .._rng.twist import LOAD_TWISTS, code_twists
from .._state.epoch_record import COLUMNS, EpochRecord
from .._state.ledger import WorkerLedger
from .._state.records import Snapshot

_OWNERS: Final = (None, "dataset", "iterator", "both")

# torchdata's StatefulDataLoader.state_dict() keys (single- and multi-process iterators).
_TORCHDATA_KEYS: Final = frozenset({
    "_snapshot", "_main_snapshot", "_worker_snapshots", "_steps_since_snapshot", "_snapshot_step",
    "_num_yielded", "_sampler_iter_state", "_sampler_iter_yielded", "_index_sampler_state",
    "_iterator_finished", "_shared_seed", "_last_yielded_worker_id",
})
_SEED_RANGE: Final = range(-(2**63), 2**63)  # what torch.Generator.manual_seed takes
MAX_COUNT: Final = 2**62  # every count and index (NOTE [ checkpoint limits ])


def _fail(where: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where} {problem}")


def _fields(where: str, value: Any, fields: dict[str, tuple[type, ...]]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(
            where,
            f"should be a dict, got {type(value).__name__}; pass the dict that snaploader's "
            "DataLoader.state_dict() returned",
        )
    for key, types in fields.items():
        if key not in value:
            raise _fail(where, f"has no {key!r} key; it was not made by this snaploader or was edited")
        item = value[key]
        # bool is an int subclass; an int field must not silently accept True.
        if not isinstance(item, types) or (isinstance(item, bool) and bool not in types):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise _fail(f"{where}[{key!r}]", f"should be {names}, got {type(item).__name__} ({item!r:.60})")
    return value


def _at_least(where: str, value: int, low: int) -> int:
    """``value``, a count or index, checked against ``low`` and against ``MAX_COUNT``:
    what reaches torch, NumPy and ``itertools`` (int64, ``sys.maxsize``) with room for
    the sums and the epoch after it that the loader computes."""
    if value < low:
        raise _fail(where, f"is {value}; expected >= {low}")
    if value >= MAX_COUNT:
        raise _fail(where, f"is {value}; expected < 2**62, which no count or index of a real run reaches")
    return value


def _upgrade(state: dict[str, Any], version: int) -> dict[str, Any]:
    """``state`` as the current version writes it: what an older file lacks, filled in."""
    out = {**ADDED_TOP, **state}
    workers = out.get("workers")
    if isinstance(workers, list):
        out["workers"] = [{**ADDED_LEDGER, **ledger} if isinstance(ledger, dict) else ledger for ledger in workers]
    if version == 2:
        # Version 2's logical worker count was the saving loader's num_workers, and each
        # ledger's index its place in the list.
        fingerprint = _fields("loader state", out, {"fingerprint": (dict,)})["fingerprint"]
        count = fingerprint.get("num_workers")
        if type(count) is not int or count < 0:
            raise _fail("loader state['fingerprint']['num_workers']", f"should be an int >= 0, got {count!r:.60}")
        out["logical_workers"] = count
        if isinstance(workers, list):
            out["workers"] = [
                {**ledger, "worker": w} if isinstance(ledger, dict) else ledger for w, ledger in enumerate(out["workers"])
            ]
    return out


def parse(state: Any, verify_digest: bool = True) -> Checkpoint:
    """The typed checkpoint of ``state``, or a :class:`CheckpointFormatError` naming the
    first problem (see the module docstring for the order). ``verify_digest=False``
    only for showing an edited state (``snaploader inspect``), never for loading it."""
    _plain.check_depth(state)
    if isinstance(state, dict) and "format" not in state and _TORCHDATA_KEYS & state.keys():
        raise CheckpointFormatError(
            "loader state is a torchdata StatefulDataLoader checkpoint (it has torchdata's "
            f"keys {sorted(_TORCHDATA_KEYS & state.keys())[:3]}), which snaploader cannot "
            "resume from: it holds no worker RNG states. docs/migration.md, 'From "
            "torchdata's StatefulDataLoader', says how to switch (finish the epoch, then "
            "start the next one with snaploader)"
        )
    head = _fields("loader state", state, HEAD_FIELDS)
    if head["format"] != FORMAT:
        raise _fail("loader state['format']", f"is {head['format']!r}, expected {FORMAT!r}")
    version = head["version"]
    if version not in READABLE_VERSIONS:
        raise _fail(
            "loader state['version']",
            f"is {version}; this snaploader reads versions {READABLE_VERSIONS}. Resume with "
            "the snaploader release that wrote it, or start the epoch afresh",
        )
    _fields("loader state", state, {"digest": (str,), "workers": (list,)})
    # The fields are checked before the digest, so that a malformed one is named (the
    # digest alone can only say that something changed); every check is bounded (NOTE
    # [ checkpoint limits ]), so nothing an unsigned edit holds costs more.
    try:
        checkpoint = _checked(state, version)
    except CheckpointFormatError as exc:
        if verify_digest:
            try:
                check_digest(state)
            except CheckpointFormatError as digest:
                raise CheckpointFormatError(f"{exc}; and {digest}") from None
        raise
    if verify_digest:
        check_digest(state)
    return checkpoint


def _checked(state: dict[str, Any], version: int) -> Checkpoint:
    top = _fields("loader state", _upgrade(state, version), TOP_FIELDS)
    fingerprint, distributed = _fingerprint(top["fingerprint"])
    epoch = _at_least("loader state['epoch']", top["epoch"], -1)
    yielded = _at_least("loader state['yielded']", top["yielded"], 0)
    logical = _at_least("loader state['logical_workers']", top["logical_workers"], 0)
    if logical > MAX_LOGICAL_WORKERS:
        raise _fail("loader state['logical_workers']", f"is {logical}; snaploader runs at most {MAX_LOGICAL_WORKERS}")
    if top["rng_kind"] not in ("generator", "global"):
        raise _fail("loader state['rng_kind']", f"should be 'generator' or 'global', got {top['rng_kind']!r}")
    raw_workers = top["workers"]
    slots = max(1, logical)
    if epoch >= 0 and len(raw_workers) != slots:
        raise _fail(
            "loader state['workers']",
            f"has {len(raw_workers)} ledgers for {slots} logical worker slot(s) (logical_workers {logical})",
        )
    if len(top["next_batches"]) != len(raw_workers):
        raise _fail("loader state['next_batches']", f"has {len(top['next_batches'])} entries for {len(raw_workers)} workers")
    next_batches = tuple(_next_batch(w, entry) for w, entry in enumerate(top["next_batches"]))
    sampler_state = _sampler_position(top["sampler_state"])
    rng_start = None if top["rng_start"] is None else _generator_state("loader state['rng_start']", top["rng_start"])
    rng_next = None if top["rng_next"] is None else _generator_state("loader state['rng_next']", top["rng_next"])
    _at_least("loader state['skip']", top["skip"], 0)
    record = _record(top)
    if record.sampler_epoch is not None and distributed is not None and distributed.seed + record.sampler_epoch not in _SEED_RANGE:
        # DistributedSampler seeds its generator with seed + epoch at iter()
        raise _fail(
            "loader state['sampler_epoch']",
            f"is {record.sampler_epoch}; with the sampler's seed {distributed.seed} it makes a seed "
            "outside [-2**63, 2**63), which torch's DistributedSampler cannot use",
        )
    sample_root = record.sample_root
    if sample_root is not None and not (epoch >= 0 and 0 <= sample_root < 2**63):
        raise _fail("loader state['sample_root']", f"is {sample_root}; expected None, or a base seed in [0, 2**63) in an epoch that started")
    if "sampler_rngs" in state and state["sampler_rngs"] is None:
        # Absent, it is an older file's (the sampler's generators left as built); no
        # release writes it as None.
        raise _fail(
            "loader state['sampler_rngs']",
            "is None; snaploader writes it only when the sampler holds generators (their "
            "states) and leaves it out otherwise, so the checkpoint was edited. Load an "
            "unmodified checkpoint",
        )
    sampler_rngs = None if top["sampler_rngs"] is None else _objects_blob("loader state['sampler_rngs']", top["sampler_rngs"])
    if epoch == -1 and record.shared_seed is not None:
        raise _fail("loader state['shared_seed']", "is set, but the state describes no epoch (epoch -1)")
    if epoch == -1:
        if not top["ended"] or yielded or raw_workers or rng_start is not None:
            raise _fail("loader state", "describes no epoch (epoch -1) but holds an epoch's position")
    else:
        _check_epoch_start(top, fingerprint, rng_start)
    workers = tuple(_ledger(w, ledger) for w, ledger in enumerate(raw_workers))
    counts = [_produced(ledger) for ledger in workers]
    if sum(counts) != yielded:
        raise _fail("loader state['yielded']", f"is {yielded}, but the workers produced {sum(counts)} batch(es)")
    snapshots = {
        id(snapshot): snapshot.rng  # "same as yielded" is one snapshot, replayed once
        for ledger in workers
        for snapshot in (ledger.epoch_start, ledger.yielded, ledger.yielded_complete)
        if snapshot is not None and isinstance(snapshot.rng, bytes)
    }
    twists = sum(code_twists(rng) for rng in snapshots.values())
    if twists > LOAD_TWISTS:
        raise _fail(
            "loader state['workers']",
            f"hold RNG states {twists} twists from their seeds in all; snaploader writes at "
            f"most {LOAD_TWISTS} per checkpoint (NOTE [ checkpoint limits ])",
        )
    return Checkpoint(
        version=version,
        digest=top["digest"],
        fingerprint=MappingProxyType(fingerprint),
        distributed=distributed,
        epoch=epoch,
        ended=top["ended"],
        yielded=yielded,
        turn=_at_least("loader state['turn']", top["turn"], 0),
        rng_kind=top["rng_kind"],
        rng_start=rng_start,
        rng_next=rng_next,
        base_seed=top["base_seed"],
        drew_base_seed=top["drew_base_seed"],
        sampler_state=sampler_state,
        logical_workers=logical,
        skip=top["skip"],
        record=record,
        sampler_rngs=sampler_rngs,
        next_batches=next_batches,
        workers=workers,
    )


def _record(top: dict[str, Any]) -> EpochRecord:
    """The epoch's record, each field's range checked by its column (its types were)."""
    for name, _, column in COLUMNS:
        value, where = top[name], f"loader state[{name!r}]"
        if value is None or type(value) is bool:
            continue
        if column.low is not None:
            _at_least(where, value, column.low)
        if column.seed and value not in _SEED_RANGE:
            raise _fail(where, f"is {value}; expected an int in [-2**63, 2**63)")
    return EpochRecord(**{name: top[name] for name, _, _ in COLUMNS})


def _fingerprint(value: dict[str, Any]) -> tuple[dict[str, Any], DistributedArgs | None]:
    where = "loader state['fingerprint']"
    _fields(where, value, {key: FINGERPRINT_FIELDS[key] for key in FINGERPRINT_KEYS})
    choices = {"dataset_kind": ("map", "iterable"), "generator": ("none", "given")}
    for key, allowed in choices.items():
        if value[key] not in allowed:
            raise _fail(f"{where}[{key!r}]", f"is {value[key]!r:.60}; expected one of {allowed}")
    for key, low in (("dataset_length", 0), ("batch_size", 1), ("num_workers", 0)):
        if value[key] is not None:
            _at_least(f"{where}[{key!r}]", value[key], low)
    out = {key: value[key] for key in FINGERPRINT_KEYS}
    for key, default in DEFAULTED_KEYS.items():  # absent: written before the key was added
        out[key] = value.get(key, default)
        if type(out[key]) is not type(default):
            raise _fail(f"{where}[{key!r}]", f"is {out[key]!r:.60}; expected a {type(default).__name__} (absent: {default!r})")
    if "distributed" not in value:
        return out, None  # written before it was recorded: not compared
    shard = value["distributed"]
    out["distributed"] = None
    if shard is None:
        return out, None
    inner = f"{where}['distributed']"
    _fields(inner, shard, {key: (kind,) for key, kind in DISTRIBUTED_FIELDS.items()})
    out["distributed"] = {key: shard[key] for key in DISTRIBUTED_FIELDS}
    _at_least(f"{inner}['num_replicas']", shard["num_replicas"], 1)
    if not 0 <= shard["rank"] < shard["num_replicas"]:
        raise _fail(inner, f"has rank {shard['rank']} of num_replicas {shard['num_replicas']}; expected 0 <= rank < num_replicas")
    if value["dataset_length"] is None:
        raise _fail(f"{where}['dataset_length']", "is None, but a DistributedSampler reads its dataset's length")
    if shard["seed"] not in _SEED_RANGE:
        raise _fail(f"{inner}['seed']", f"is {shard['seed']}; torch seeds fit in 64 bits")
    return out, DistributedArgs(**{key: shard[key] for key in DISTRIBUTED_FIELDS})


def _next_batch(w: int, entry: Any) -> NextBatch | None:
    if entry is None:
        return None
    where = f"loader state['next_batches'][{w}]"
    _fields(where, entry, {"produced": (int,), "digest": (str,)})
    if not 1 <= entry["produced"] < MAX_COUNT or len(entry["digest"]) > 64:
        raise _fail(where, "is not a batch count >= 1 with a short digest")
    return NextBatch(entry["produced"], entry["digest"])


def _sampler_position(value: dict[str, Any] | None) -> SamplerPosition | None:
    if value is None:
        return None
    where = "loader state['sampler_state']"
    _fields(where, value, {"done": (bool,)})
    if "state" not in value:
        raise _fail(where, "has no 'state' key")
    return SamplerPosition(_decoded(f"{where}['state']", value["state"]), value["done"])


def _decoded(where: str, value: Any) -> Any:
    try:
        return _plain.decode(value, where)
    except ValueError as exc:
        raise _fail(where, f"cannot be decoded: {exc}") from None


def _unb64(where: str, text: str) -> bytes:
    try:
        return _plain.unb64(text, where)
    except ValueError:
        raise _fail(where, "is not valid base64") from None


def _objects_blob(where: str, text: str) -> bytes:
    blob = _unb64(where, text)
    try:
        check_objects(blob)
    except ValueError as exc:
        raise _fail(where, f"is not a generator-object state snaploader wrote: {exc}") from None
    return blob


def _generator_state(where: str, text: str) -> bytes:
    state = _unb64(where, text)
    try:
        RngSource.check_state(state)
    except ValueError as exc:
        raise _fail(where, f"is not a generator state: {exc}") from None
    return state


def _check_epoch_start(top: dict[str, Any], fingerprint: dict[str, Any], rng_start: bytes | None) -> None:
    base_seed = top["base_seed"]
    if base_seed is None or not 0 <= base_seed < 2**63:
        raise _fail("loader state['base_seed']", f"should be an int in [0, 2**63), got {base_seed!r}")
    if rng_start is None:
        raise _fail("loader state['rng_start']", "is None for an epoch that started")
    if not top["drew_base_seed"] and not (fingerprint["persistent_workers"] and top["epoch"] > 0):
        raise _fail(
            "loader state['drew_base_seed']",
            "is False, but only persistent workers after the first epoch keep an earlier base seed",
        )
    if top["drew_base_seed"]:
        # The base seed is the epoch's first draw from rng_start, or its second after an
        # IterDataPipe's shared seed: they must agree. (The shared seed itself may be
        # rank 0's, not a draw of this rank's generator: only its range is checked.)
        source = RngSource(torch.Generator())
        source.set_state(rng_start)
        if top["shared_seed"] is not None:
            source.draw_base_seed()
        if source.draw_base_seed() != base_seed:
            raise _fail("loader state['base_seed']", "is not the seed that loader state['rng_start'] gives; one of them was edited")


def _snapshot(where: str, value: dict[str, Any]) -> Snapshot:
    _fields(where, value, SNAPSHOT_FIELDS)
    if "data" not in value:
        raise _fail(where, "has no 'data' key")
    owner = value["data_owner"]
    if owner not in _OWNERS:
        raise _fail(f"{where}['data_owner']", f"is {owner!r:.60}; expected one of {_OWNERS}")
    rng = _unb64(f"{where}['rng']", value["rng"])
    try:
        check_rng(rng, seeded=True)
    except ValueError as exc:
        raise _fail(f"{where}['rng']", f"is not an RNG state snaploader wrote: {exc}") from None
    objects = None if value["objects"] is None else _objects_blob(f"{where}['objects']", value["objects"])
    data = _decoded(f"{where}['data']", value["data"])
    if owner == "both" and data is not None and not (isinstance(data, dict) and set(data) == {"dataset", "iterator"}):
        raise _fail(f"{where}['data']", "should be {'dataset': ..., 'iterator': ...} for data_owner 'both'")
    return Snapshot(
        rng=rng,
        produced=_at_least(f"{where}['produced']", value["produced"], 0),
        data=data,
        data_owner=owner,
        complete=value["complete"],
        exhausted=value["exhausted"],
        objects=objects,
    )


def _ledger(w: int, value: Any) -> WorkerLedger:
    where = f"loader state['workers'][{w}]"
    _fields(where, value, LEDGER_FIELDS)
    if value["worker"] != w:
        raise _fail(f"{where}['worker']", f"is {value['worker']}; the ledger of logical worker {w} belongs at index {w}")
    skipped = _at_least(f"{where}['skipped']", value["skipped"], 0)
    complete_value = value["yielded_complete"]
    if isinstance(complete_value, str) and complete_value != SAME_AS_YIELDED:
        raise _fail(f"{where}['yielded_complete']", f"should be a snapshot, None or {SAME_AS_YIELDED!r}")

    def snap(key: str) -> Snapshot | None:
        item = value[key]
        return _snapshot(f"{where}[{key!r}]", item) if isinstance(item, dict) else None

    start, at = snap("epoch_start"), snap("yielded")
    complete = at if complete_value == SAME_AS_YIELDED else snap("yielded_complete")
    if value["exhausted"] != (at is not None and at.exhausted):
        raise _fail(f"{where}['exhausted']", "disagrees with its last snapshot's 'exhausted'")
    if at is not None and at.complete and start is not None:
        raise _fail(f"{where}['epoch_start']", "is set where resuming does not use it")
    if (at is not None and at.complete) != (complete_value == SAME_AS_YIELDED):
        raise _fail(
            f"{where}['yielded_complete']",
            f"should be {SAME_AS_YIELDED!r} exactly when the last yielded snapshot is complete",
        )
    if complete is not None and complete is not at and (not complete.complete or complete.produced >= (0 if at is None else at.produced)):
        raise _fail(f"{where}['yielded_complete']", "should be a complete snapshot older than the last yielded one")
    return WorkerLedger(epoch_start=start, yielded=at, yielded_complete=complete, exhausted=value["exhausted"], skipped=skipped)


def _produced(ledger: WorkerLedger) -> int:
    return (0 if ledger.yielded is None else ledger.yielded.produced) + ledger.skipped
