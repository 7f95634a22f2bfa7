"""What a valid checkpoint is: its keys, version and digest, the loader fingerprint,
and the checks that a state follows them (types, ranges, consistency), which
``_checkpoint.read_state`` runs before anything forks. The layout itself is described
in ``_format/codec.py``'s docstring.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final

import torch

from . import plain as _plain
from .fingerprint import DISTRIBUTED_FIELDS, FINGERPRINT_KEYS
from .._errors import CheckpointFormatError
from .._rng.objects import check_objects
from .._rng.capture import RngSource, check_rng

FORMAT: Final = "snaploader"
VERSION: Final = 3
# Version 2 lacks ``logical_workers`` (it was the fingerprint's num_workers) and each
# ledger's ``worker``; read_state fills both in.
READABLE_VERSIONS: Final = (2, 3)
SAME_AS_YIELDED: Final = "same as yielded"
_OWNERS: Final = (None, "dataset", "iterator")

# -- the digest ------------------------------------------------------------------------


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sha256_of(value: Any) -> str:
    return hashlib.sha256(_canonical(value)).hexdigest()


def digest_of(state: dict[str, Any], ledger_digests: list[str]) -> str:
    """The integrity digest: SHA-256 over the canonical JSON of ``state`` without its
    ``digest``, each ledger replaced by the SHA-256 of its own canonical JSON (so that a
    ledger that did not change since the last ``state_dict()`` is not hashed again)."""
    body = {key: value for key, value in state.items() if key != "digest"}
    body["workers"] = ledger_digests
    return "sha256:" + sha256_of(body)



# -- the checks ------------------------------------------------------------------------

_OPTIONAL_INT: Final = (int, type(None))
_OPTIONAL_STR: Final = (str, type(None))

_TOP_FIELDS: Final[dict[str, tuple[type, ...]]] = {
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
    "sampler_epoch": _OPTIONAL_INT,
    "next_batches": (list,),
    "workers": (list,),
}

_LEDGER_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "epoch_start": (dict, type(None)),
    "yielded": (dict, type(None)),
    "yielded_complete": (dict, str, type(None)),
    "exhausted": (bool,),
}

_TOP_FIELDS_3: Final = {**_TOP_FIELDS, "logical_workers": (int,)}
_LEDGER_FIELDS_3: Final = {"worker": (int,), **_LEDGER_FIELDS}

_SNAPSHOT_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "rng": (str,),
    "produced": (int,),
    "data_owner": _OPTIONAL_STR,
    "complete": (bool,),
    "exhausted": (bool,),
    "objects": (str, type(None)),
}


def _fail(where: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where} {problem}")


def _check_fields(where: str, value: Any, fields: dict[str, tuple[type, ...]]) -> None:
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


@dataclass(frozen=True)
class LoaderFacts:
    """What a checkpoint must agree with about the loader it is loaded into."""

    iterable: bool
    slots: int  # logical worker slots of the epoch the checkpoint describes
    dataset_has_protocol: bool  # and the loader uses it (state_protocol)
    batches_per_epoch: int | None  # map-style, when the sampler has a length
    state_protocol: bool = True  # the loader's option of that name
    logical: int = 1  # the loader's logical worker count (for its new epochs)


def validate(state: Any) -> None:
    """Raise :class:`CheckpointFormatError` naming the first problem in the structure
    of ``state`` (types, the digest, ranges that need no loader to judge)."""
    _check_fields("loader state", state, {"format": (str,), "version": (int,)})
    if state["format"] != FORMAT:
        raise _fail("loader state['format']", f"is {state['format']!r}, expected {FORMAT!r}")
    version = state["version"]
    if version not in READABLE_VERSIONS:
        raise _fail(
            "loader state['version']",
            f"is {version}; this snaploader reads versions {READABLE_VERSIONS}. Resume with "
            "the snaploader release that wrote it, or start the epoch afresh",
        )
    _check_fields("loader state", state, _TOP_FIELDS if version == 2 else _TOP_FIELDS_3)
    workers = state["workers"]
    for w, ledger in enumerate(workers):
        where = f"loader state['workers'][{w}]"
        _check_fields(where, ledger, _LEDGER_FIELDS if version == 2 else _LEDGER_FIELDS_3)
        if version > 2 and ledger["worker"] != w:
            raise _fail(f"{where}['worker']", f"is {ledger['worker']}; the ledger of logical worker {w} belongs at index {w}")
        complete = ledger["yielded_complete"]
        if isinstance(complete, str) and complete != SAME_AS_YIELDED:
            raise _fail(f"{where}['yielded_complete']", f"should be a snapshot, None or {SAME_AS_YIELDED!r}")
        for key in ("epoch_start", "yielded", "yielded_complete"):
            if isinstance(ledger[key], dict):
                _check_fields(f"{where}[{key!r}]", ledger[key], _SNAPSHOT_FIELDS)
                if "data" not in ledger[key]:
                    raise _fail(f"{where}[{key!r}]", "has no 'data' key")
    try:
        expected = digest_of(state, [sha256_of(ledger) for ledger in workers])
    except (TypeError, ValueError) as exc:
        raise _fail("loader state", f"holds something that is not plain data ({exc})") from None
    if state["digest"] != expected:
        raise _fail(
            "loader state['digest']",
            "does not match the state's contents: the checkpoint was modified or corrupted "
            "after state_dict() made it. Load an unmodified checkpoint",
        )
    for key in FINGERPRINT_KEYS:
        if key not in state["fingerprint"]:
            raise _fail("loader state['fingerprint']", f"has no {key!r} key")
    _check_distributed(state["fingerprint"].get("distributed"))
    if type(state["fingerprint"].get("seed_per_sample", False)) is not bool:
        raise _fail("loader state['fingerprint']['seed_per_sample']", "should be True or False (absent: False)")
    if state["rng_kind"] not in ("generator", "global"):
        raise _fail("loader state['rng_kind']", f"should be 'generator' or 'global', got {state['rng_kind']!r}")
    check_count("loader state['skip']", state.get("skip", 0))
    check_count("loader state['item_offset']", state.get("item_offset", 0))
    if state.get("epoch_length") is not None:
        check_count("loader state['epoch_length']", state["epoch_length"])
    if type(state.get("in_order", True)) is not bool:
        raise _fail("loader state['in_order']", f"should be True or False, got {state['in_order']!r:.60}")
    for w, ledger in enumerate(workers):
        check_count(f"loader state['workers'][{w}]['skipped']", ledger.get("skipped", 0))
    if version > 2 and state["logical_workers"] < 0:
        raise _fail("loader state['logical_workers']", f"is {state['logical_workers']}; expected >= 0")
    if state["epoch"] < -1 or state["yielded"] < 0:
        raise _fail("loader state", f"has epoch {state['epoch']} and yielded {state['yielded']}; epoch must be >= -1 and yielded >= 0")
    sampler_state = state["sampler_state"]
    if sampler_state is not None:
        _check_fields("loader state['sampler_state']", sampler_state, {"done": (bool,)})
        if "state" not in sampler_state:
            raise _fail("loader state['sampler_state']", "has no 'state' key")
    if len(state["next_batches"]) != len(workers):
        raise _fail("loader state['next_batches']", f"has {len(state['next_batches'])} entries for {len(workers)} workers")
    for w, entry in enumerate(state["next_batches"]):
        if entry is not None:
            where = f"loader state['next_batches'][{w}]"
            _check_fields(where, entry, {"produced": (int,), "digest": (str,)})
            if entry["produced"] < 1 or len(entry["digest"]) > 64:
                raise _fail(where, "is not a batch count >= 1 with a short digest")
    if state["epoch"] == -1:
        if not state["ended"] or state["yielded"] or workers or state["rng_start"] is not None:
            raise _fail("loader state", "describes no epoch (epoch -1) but holds an epoch's position")
        return
    if state["base_seed"] is None or not 0 <= state["base_seed"] < 2**63:
        raise _fail("loader state['base_seed']", f"should be an int in [0, 2**63), got {state['base_seed']!r}")
    if state["rng_start"] is None:
        raise _fail("loader state['rng_start']", "is None for an epoch that started")
    _check_generator_state("loader state['rng_start']", state["rng_start"])
    if state["rng_next"] is not None:
        _check_generator_state("loader state['rng_next']", state["rng_next"])
    if not state["drew_base_seed"] and not (state["fingerprint"].get("persistent_workers") and state["epoch"] > 0):
        raise _fail(
            "loader state['drew_base_seed']",
            "is False, but only persistent workers after the first epoch keep an earlier base seed",
        )
    if state["drew_base_seed"]:
        # The base seed is the epoch's first draw from rng_start: they must agree.
        source = RngSource(torch.Generator())
        source.set_state(_plain.unb64(state["rng_start"], "loader state['rng_start']"))
        if source.draw_base_seed() != state["base_seed"]:
            raise _fail(
                "loader state['base_seed']",
                "is not the seed that loader state['rng_start'] gives; one of them was edited",
            )
    if state["sampler_epoch"] is not None and state["sampler_epoch"] < 0:
        raise _fail("loader state['sampler_epoch']", f"is {state['sampler_epoch']}; expected >= 0")


def _check_distributed(value: Any) -> None:
    # Optional (absent in checkpoints written before it): None, or DistributedSampler's
    # arguments, which snaploader.distributed re-partitions an epoch from.
    if value is None:
        return
    where = "loader state['fingerprint']['distributed']"
    types: dict[str, tuple[type, ...]] = {key: (kind,) for key, kind in DISTRIBUTED_FIELDS.items()}
    _check_fields(where, value, types)
    if not 0 <= value["rank"] < value["num_replicas"]:
        raise _fail(where, f"has rank {value['rank']} of num_replicas {value['num_replicas']}; expected 0 <= rank < num_replicas")


def logical_workers_of(state: dict[str, Any]) -> int:
    """The logical worker count of a validated state (version 2: the saving loader's
    num_workers, which was the same thing then)."""
    if state["version"] == 2:
        value = state["fingerprint"]["num_workers"]
        if type(value) is not int or value < 0:
            raise _fail("loader state['fingerprint']['num_workers']", f"should be an int >= 0, got {value!r:.60}")
        return int(value)
    return int(state["logical_workers"])


def check_count(where: str, value: Any) -> None:
    # The skip fields came after version 2 was first written: absent means 0.
    if type(value) is not int or value < 0:
        raise _fail(where, f"should be an int >= 0, got {type(value).__name__} ({value!r:.60})")


def _check_generator_state(where: str, text: str) -> None:
    try:
        RngSource.check_state(_plain.unb64(text, where))
    except ValueError as exc:
        raise _fail(where, f"is not a generator state: {exc}") from None


def check_consistent(state: dict[str, Any], facts: LoaderFacts) -> None:
    """Raise :class:`CheckpointFormatError` unless the position agrees with itself and
    with the loader: a state that loads must resume the stream it was taken from."""
    workers = state["workers"]
    if state["epoch"] == -1:
        return
    if len(workers) != facts.slots:
        raise _fail(
            "loader state['workers']",
            f"has {len(workers)} ledgers for {facts.slots} logical worker slot(s) "
            f"(logical_workers {logical_workers_of(state)!r})",
        )
    turn, yielded = state["turn"], state["yielded"]
    in_order = state.get("in_order", True)
    if not 0 <= turn < facts.slots or (not facts.iterable and turn != 0):
        raise _fail("loader state['turn']", f"is {turn}; expected 0{'' if not facts.iterable else f' to {facts.slots - 1}'}")
    if facts.batches_per_epoch is not None:
        if yielded > facts.batches_per_epoch or (state["ended"] and yielded != facts.batches_per_epoch):
            raise _fail(
                "loader state['yielded']",
                f"is {yielded} for an epoch of {facts.batches_per_epoch} batches"
                f"{' that ended' if state['ended'] else ''}",
            )
        skip_from = 0 if state["ended"] else yielded
        if skip_from + state.get("skip", 0) > facts.batches_per_epoch:
            raise _fail(
                "loader state['skip']",
                f"is {state.get('skip', 0)}, past the end of an epoch of "
                f"{facts.batches_per_epoch} batches from batch {skip_from}",
            )
    produced = []
    for w, ledger in enumerate(workers):
        where = f"loader state['workers'][{w}]"
        for key in ("epoch_start", "yielded", "yielded_complete"):
            snapshot = ledger[key]
            if isinstance(snapshot, dict):
                _check_snapshot(f"{where}[{key!r}]", snapshot, facts)
        at = ledger["yielded"]
        skipped = ledger.get("skipped", 0)
        if skipped and facts.iterable:
            raise _fail(f"{where}['skipped']", "is set for an iterable dataset, whose skipped batches are produced")
        count = (0 if at is None else at["produced"]) + skipped
        produced.append(count)
        if ledger["exhausted"] != (at is not None and at["exhausted"]):
            raise _fail(f"{where}['exhausted']", "disagrees with its last snapshot's 'exhausted'")
        needs_start = at is None or not at["complete"]
        if not needs_start and ledger["epoch_start"] is not None:
            raise _fail(f"{where}['epoch_start']", "is set where resuming does not use it")
        complete = ledger["yielded_complete"]
        if (at is not None and at["complete"]) != (complete == SAME_AS_YIELDED):
            raise _fail(
                f"{where}['yielded_complete']",
                f"should be {SAME_AS_YIELDED!r} exactly when the last yielded snapshot is complete",
            )
        if isinstance(complete, dict) and (not complete["complete"] or complete["produced"] >= count - skipped):
            raise _fail(f"{where}['yielded_complete']", "should be a complete snapshot older than the last yielded one")
        if not facts.iterable and in_order:
            # Map-style batch k comes from worker k mod W: the counts are fixed.
            due = len(range(w, yielded, facts.slots))
            if count != due:
                raise _fail(f"{where}['yielded']", f"says {count} batch(es) produced; batch {yielded} of the epoch needs {due}")
        elif not facts.iterable and facts.batches_per_epoch is not None:
            # in_order=False: any prefix of the worker's share.
            share = len(range(w, facts.batches_per_epoch, facts.slots))
            if count > share:
                raise _fail(f"{where}['yielded']", f"says {count} batch(es) produced; its share of the epoch is {share}")
    if facts.iterable and state["ended"] and not all(ledger["exhausted"] for ledger in workers):
        raise _fail("loader state['ended']", "is True, but not every worker of the iterable ran dry")
    if sum(produced) != yielded:
        raise _fail("loader state['yielded']", f"is {yielded}, but the workers produced {sum(produced)} batch(es)")
    if facts.iterable and in_order:
        # The round-robin visits the slots not yet exhausted in order from slot 0: each
        # has produced the same number of batches, one more for those before ``turn``.
        live = [w for w, ledger in enumerate(workers) if not ledger["exhausted"]]
        rounds = {produced[w] - (1 if w < turn else 0) for w in live}
        if len(rounds) > 1 or any(r < 0 for r in rounds):
            raise _fail("loader state['workers']", f"hold batch counts {produced} that no round-robin at turn {turn} gives")


def _check_snapshot(where: str, snapshot: dict[str, Any], facts: LoaderFacts) -> None:
    owner = snapshot["data_owner"]
    if owner not in _OWNERS:
        raise _fail(f"{where}['data_owner']", f"is {owner!r}; expected one of {_OWNERS}")
    if snapshot["produced"] < 0:
        raise _fail(f"{where}['produced']", f"is {snapshot['produced']}; expected >= 0")
    if owner is not None and not facts.state_protocol:
        raise _fail(
            f"{where}['data_owner']",
            f"is {owner!r}: the checkpoint holds the dataset's own state, and this loader "
            "was built with state_protocol=False, which would resume without it. Build "
            "the loader with state_protocol=True to resume this checkpoint, or start "
            "the epoch afresh",
        )
    if not facts.iterable:
        expected_owner = "dataset" if facts.dataset_has_protocol else None
        if owner != expected_owner or not snapshot["complete"] or snapshot["exhausted"]:
            raise _fail(
                where,
                f"is not a map-style dataset's snapshot (data_owner {owner!r}, complete "
                f"{snapshot['complete']}, exhausted {snapshot['exhausted']}; expected "
                f"{expected_owner!r}, True, False)",
            )
    else:
        if owner == "dataset" and not facts.dataset_has_protocol:
            raise _fail(f"{where}['data_owner']", "is 'dataset', but this dataset has no state_dict()/load_state_dict()")
        if owner is None and facts.dataset_has_protocol:
            raise _fail(
                f"{where}['data_owner']",
                "is None, but this dataset has state_dict()/load_state_dict(); a checkpoint "
                "taken with state_protocol=False resumes only in a loader built with "
                "state_protocol=False",
            )
        if snapshot["complete"] and owner is None:
            raise _fail(f"{where}['complete']", "is True for a snapshot that holds no dataset or iterator state")
    try:
        check_rng(_plain.unb64(snapshot["rng"], f"{where}['rng']"), seeded=True)
    except ValueError as exc:
        raise _fail(f"{where}['rng']", f"is not an RNG state snaploader wrote: {exc}") from None
    try:
        _plain.decode(snapshot["data"], f"{where}['data']")
    except ValueError as exc:
        raise _fail(f"{where}['data']", f"cannot be decoded: {exc}") from None
    objects = snapshot["objects"]
    if objects is not None:
        try:
            check_objects(_plain.unb64(objects, f"{where}['objects']"))
        except ValueError as exc:
            raise _fail(f"{where}['objects']", f"is not a generator-object state snaploader wrote: {exc}") from None


