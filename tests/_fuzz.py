"""Checkpoint fuzzing shared by ``tests/test_checkpoint.py`` and
``stress/fuzz_checkpoints.py``: real states from several configurations, mutated one
field at a time, each mutant loaded into a fresh loader.

The property: a mutant either raises a named ``CheckpointFormatError`` /
``CheckpointMismatchError`` at ``load_state_dict`` (or at the first ``next()`` for what
only the data can tell, still as ``CheckpointFormatError``), or resumes the very stream
the original state resumes. Anything else (another exception, a crash, a different
stream) is a bug.
"""

from __future__ import annotations

import base64
import binascii
import copy
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DistributedSampler

import snaploader
from snaploader._format.checkpoint import resign, sha256_of
from snaploader.distributed import reshard
from snaploader._rng import twist
from snaploader._rng.kinds import parse as parse_objects

from ._datasets import Augmented
from ._iterable_datasets import IteratorStateStream, PairStateStream, PlainStream
from ._object_datasets import OwnGenerators, TorchShuffled, reseed_own
from ._streams import assert_same_stream, cut_state, generator, through_bytes

CLEAR = (snaploader.CheckpointFormatError, snaploader.CheckpointMismatchError)


@dataclass
class Case:
    """One configuration: how to build its loader, a real state, and what follows it."""

    name: str
    make: Callable[[], snaploader.DataLoader]
    state: dict[str, Any]
    expected: list[list[Any]]  # the rest of the cut epoch, then the next epoch


def _map_loader(workers: int, persistent: bool = False) -> Callable[[], snaploader.DataLoader]:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(
            Augmented(14), batch_size=3, shuffle=True, num_workers=workers,
            persistent_workers=persistent, generator=generator(5), timeout=60 if workers else 0,
        )

    return make


def _objects_loader() -> snaploader.DataLoader:
    # generator objects in the dataset: mutations of each snapshot's "objects" field
    return snaploader.DataLoader(
        OwnGenerators(14), batch_size=3, shuffle=True, num_workers=2,
        worker_init_fn=reseed_own, generator=generator(5), timeout=60,
    )


def _unordered_loader() -> snaploader.DataLoader:
    # in_order=False: the ledgers' counts are the position (any prefix of each share)
    return snaploader.DataLoader(
        Augmented(14), batch_size=3, shuffle=True, num_workers=2, in_order=False,
        generator=generator(5), timeout=60,
    )


def _distributed_loader() -> snaploader.DataLoader:
    # a DistributedSampler: its arguments are in the fingerprint ("distributed")
    dataset = Augmented(15)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
    return snaploader.DataLoader(dataset, batch_size=2, sampler=sampler, num_workers=2, generator=generator(5), timeout=60)


def _sampler_rngs_loader() -> snaploader.DataLoader:
    # a sampler shuffling with its own generator: the top-level "sampler_rngs" blob
    return snaploader.DataLoader(
        Augmented(14), batch_size=3, sampler=TorchShuffled(14), num_workers=2, generator=generator(5), timeout=60,
    )


def _per_sample_loader() -> snaploader.DataLoader:
    # seed_per_sample, cut in the second epoch: "sample_root" is not the epoch's base seed
    return snaploader.DataLoader(Augmented(14), batch_size=3, shuffle=True, generator=generator(5), seed_per_sample=True)


def _iter_loader(cls: type, workers: int) -> Callable[[], snaploader.DataLoader]:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(
            cls(n=13), batch_size=2, num_workers=workers, generator=generator(5),
            replay="allow", timeout=60 if workers else 0,
        )

    return make


CONFIGS: dict[str, tuple[Callable[[], snaploader.DataLoader], int, int]] = {
    # name: (factory, epochs run before the cut epoch, batches into the cut epoch)
    "map-w0": (_map_loader(0), 0, 2),
    "map-w2-persistent": (_map_loader(2, persistent=True), 1, 3),
    "iter-protocol-w2": (_iter_loader(IteratorStateStream, 2), 0, 3),
    "iter-plain-w0": (_iter_loader(PlainStream, 0), 0, 3),
    "iter-pair-w2": (_iter_loader(PairStateStream, 2), 0, 3),  # data_owner "both"
    "map-objects-w2": (_objects_loader, 0, 2),
    "map-skip-w2": (_map_loader(2), 0, 1),
    "map-unordered-w2": (_unordered_loader, 0, 2),
    "map-distributed-w2": (_distributed_loader, 0, 1),
    "map-sampler-rngs-w2": (_sampler_rngs_loader, 1, 2),
    "map-per-sample-w0": (_per_sample_loader, 1, 2),
}
# Configurations whose state holds a pending skip: loaded with load_state_dict(skip=N)
# and taken again before iter() (what state_dict() returns meanwhile).
_PENDING_SKIP: dict[str, int] = {"map-skip-w2": 2}
_UNORDERED: frozenset[str] = frozenset({"map-unordered-w2"})


def _content(batch: Any) -> bytes:
    return bytes(batch.numpy().tobytes())


def _drain(loader: snaploader.DataLoader) -> list[list[Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [list(loader), list(loader)]


def build_case(name: str) -> Case:
    make, before, cut = CONFIGS[name]
    state = cut_state(make(), before, cut)
    if name in _PENDING_SKIP:
        skipping = make()
        skipping.load_state_dict(state, skip=_PENDING_SKIP[name])
        state = through_bytes(skipping.state_dict())
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(state))
    return Case(name, make, state, _drain(resumed))


# -- mutations -----------------------------------------------------------------------


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, prefix + (i,))
    return out


def _replacements(old: Any, rng: random.Random) -> list[Any]:
    options: list[Any] = [None, True, False, -1, 0, 1, 2**62, -(2**31), "x", [], {}, 0.5]
    if isinstance(old, bool):
        options.append(not old)
    elif isinstance(old, int):
        options += [old + 1, old - 1, -old, old * 2 + 7]
    elif isinstance(old, str) and old:
        i = rng.randrange(len(old))
        flipped = "A" if old[i] != "A" else "B"
        options += [old[:i] + flipped + old[i + 1 :], old[: len(old) // 2], old + "AAAA"]
    elif isinstance(old, list):
        options += [old[:-1], old + old[-1:], list(reversed(old))]
    return options


def _object_states_only(old: Any, new: Any) -> bool:
    """True when ``new`` is a generator-object blob with the same paths and kinds as
    ``old`` and other state bytes: a generator state no check can tell from another
    (as with Mersenne Twister words), so only the digest can catch the edit."""
    if not (isinstance(old, str) and isinstance(new, str)) or old == new:
        return False
    try:
        before, after = (parse_objects(base64.b64decode(text, validate=True)) for text in (old, new))
    except (ValueError, binascii.Error):
        return False
    return [record[:2] for record in before] == [record[:2] for record in after]


def _snapshots(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    out = []
    for w, ledger in enumerate(state.get("workers") or []):
        for key in ("epoch_start", "yielded", "yielded_complete"):
            if isinstance(ledger, dict) and isinstance(ledger.get(key), dict):
                out.append(("workers", w, key))
    return out


def _checkable_offsets(field: str, blob: bytes) -> list[int]:
    """Byte offsets of a decoded blob whose edits a check can see: an RNG blob's flags
    and its twist codes' counts and CRCs (``_rng/twist.py``); a generator-object
    record's path length, path, kind and state size (``_rng/kinds.py``). Any other byte
    is part of some valid generator state, which no check can tell from another."""
    if field == "rng":
        offsets, at = [0], 1
        for part, size in enumerate(twist.part_sizes(blob[0])):
            if size is None:
                continue
            if blob[0] & (8 << part):
                offsets += list(range(at, at + 8))
            at = len(blob) if size < 0 else at + size
        return offsets
    offsets, at = [], 0
    while at + 2 <= len(blob):
        length = int.from_bytes(blob[at : at + 2], "little")
        head = at + 2 + length + 5  # path, then kind (1 byte) and size (4 bytes)
        offsets += list(range(at, min(head, len(blob))))
        at = head + int.from_bytes(blob[head - 4 : head], "little")
    return offsets


def mutate_decoded(state: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str, bool]:
    """A copy of ``state`` with one checkable byte of a decoded RNG or generator-object
    blob changed (or the blob cut short or extended), re-encoded, re-signed half the
    time; what was done; whether it was re-signed."""
    mutant = copy.deepcopy(state)
    choices = [(path, field) for path in _snapshots(mutant) for field in ("rng", "objects")
               if isinstance(_at(mutant, path).get(field), str)]
    if isinstance(mutant.get("sampler_rngs"), str):  # encoded as a snapshot's objects
        choices.append(((), "sampler_rngs"))
    path, field = rng.choice(choices)
    snapshot = _at(mutant, path)
    blob = bytearray(base64.b64decode(snapshot[field]))
    action = rng.random()
    if action < 0.15:
        blob = blob[: rng.randrange(len(blob))]
        what = f"cut {path + (field,)} to {len(blob)} bytes"
    elif action < 0.25:
        blob += bytes(rng.randrange(1, 9))
        what = f"extended {path + (field,)}"
    else:
        at = rng.choice(_checkable_offsets(field, bytes(blob)) or [0])
        old = blob[at]
        blob[at] = rng.choice([old ^ (1 << rng.randrange(8)), (old + 1) % 256, (old - 1) % 256, rng.randrange(256)])
        what = f"set byte {at} of decoded {path + (field,)} from {old} to {blob[at]}"
    snapshot[field] = base64.b64encode(bytes(blob)).decode()
    signed = rng.random() < 0.5
    if signed:
        mutant["digest"] = resign(mutant)["digest"]
        what += " (re-signed)"
    return mutant, what, signed


def _at(state: Any, path: tuple[Any, ...]) -> Any:
    here: Any = state
    for key in path:
        here = here[key]
    return here


def mutate(state: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str, bool]:
    """A copy of ``state`` with one value replaced, removed or added, re-signed half the
    time (a deliberate editor) unless it is inside the user's own state, what was done,
    and whether a deliberate editor's re-signing is a test of snaploader's checks (False
    for the edits described below, which only the digest can catch)."""
    mutant = copy.deepcopy(state)
    path = rng.choice(_paths(mutant))
    parent: Any = mutant
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    old_value = copy.deepcopy(parent[key])
    action = rng.random()
    if action < 0.1 and isinstance(parent, dict):
        del parent[key]
        what = f"removed {path}"
    elif action < 0.15 and isinstance(parent, dict):
        parent["unexpected"] = 1
        what = f"added a key beside {path}"
    else:
        new = rng.choice(_replacements(parent[key], rng))
        parent[key] = new
        what = f"set {path} to {new!r:.40}"
    # A deliberate editor's change to the user's own state (a dataset's or sampler's
    # state_dict()) is the user's protocol's to judge; snaploader's fields are not.
    # Nor can any check tell one Mersenne Twister state from another: every 624 words
    # are a valid state, and the same holds for a generator object's state bytes (same
    # paths and kinds). Such edits are the digest's to catch (unsigned ones below).
    # A pending skip is an instruction (load_state_dict(skip=...) writes it): a re-signed
    # one is a skip asked for, and changes the stream as documented.
    # A re-signed reordering of the whole ledger list is as coherent as a real state when
    # the counts allow it (ledgers carry no worker index yet): the digest's to catch.
    # The sampler's epoch is what set_epoch() gave a DistributedSampler, and the
    # checkpoint's wins at resume (docs/quickstart.md, DDP): a re-signed one is an epoch
    # asked for, drawn as asked; no check can tell it from the true one, since no index
    # of the permutation is stored. The digest's to catch too.
    # A checkpoint without the sampler's generator states is what a release before they
    # were recorded wrote, and loads with the sampler's generators left as built
    # (tests/test_sampler_rngs.py): a re-signed removal of them is such a file.
    # With seed_per_sample the epoch number is one of the per-sample seeds' inputs
    # (NOTE [ per-sample root ]): a re-signed one is an epoch asked for, as the sampler's.
    # Both hold wherever a loader state sits (a ReshardedLoader's holds one under "rest").
    per_sample = isinstance(mutant.get("fingerprint"), dict) and mutant["fingerprint"].get("seed_per_sample") is True
    users = (
        "data" in path or path[:2] == ("sampler_state", "state") or path == ("workers",)
        or path[-1:] in (("skip",), ("sampler_epoch",)) or (per_sample and path == ("epoch",))
        or (path[-1:] == ("sampler_rngs",) and what.startswith("removed"))
    )
    # The per-sample root is a seed as rng_start is a state: any base seed is one.
    rng_words = path[-1] in ("rng", "rng_start", "rng_next", "sample_root") or _object_states_only(old_value, parent.get(key) if isinstance(parent, dict) else None)
    signable = not users and not rng_words
    if signable and rng.random() < 0.5 and "digest" in mutant and isinstance(mutant.get("workers"), list):
        try:
            mutant["digest"] = resign(mutant)["digest"]
            what += " (re-signed)"
        except Exception:
            pass
    return mutant, what, signable


def outcome(case: Case, mutant: dict[str, Any]) -> str:
    """"clear", "identical", or a description of what went wrong."""
    loader = case.make()
    try:
        loader.load_state_dict(mutant)
    except CLEAR:
        return "clear"
    except Exception as exc:
        return f"load raised {type(exc).__name__}: {exc}"
    try:
        got = _drain(loader)
    except snaploader.CheckpointFormatError:
        return "clear"
    except Exception as exc:
        return f"iteration raised {type(exc).__name__}: {exc}"
    try:
        assert_resumes(case, got)
    except AssertionError as exc:
        return f"loaded silently and yielded a different stream ({exc})"
    return "identical"


def assert_resumes(case: Case, got: list[list[Any]]) -> None:
    """Assert that ``got`` (two epochs) is the stream ``case.state`` resumes."""
    expected = case.expected
    if case.name in _UNORDERED:
        # in_order=False yields whichever worker is ready: each epoch's batches are
        # fixed, their order is timing's
        got, expected = [sorted(epoch, key=_content) for epoch in got], [sorted(epoch, key=_content) for epoch in expected]
    assert_same_stream(got[0] + got[1], expected[0] + expected[1])


# What no integer field may hold: past int64 and uint64 (what torch and NumPy take), and
# below any field's range.
HUGE_AND_NEGATIVE: tuple[int, ...] = (2**62, 2**63, 2**64, 2**70, -1, -(2**63) - 1)


def integer_mutants(state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every integer field of ``state`` (snaploader's, not the user's own state) set to
    each of ``HUGE_AND_NEGATIVE`` in turn, re-signed as a deliberate editor would: each
    must fail clearly at load (or resume the same stream), never reach torch or NumPy."""
    out = []
    for path in _paths(state):
        value = _at(state, path)
        if type(value) is not int or "data" in path or path[:2] == ("sampler_state", "state"):
            continue
        for new in HUGE_AND_NEGATIVE:
            # a base seed is any 63-bit word (NOTE [ per-sample root ]): one in range is
            # a seed asked for, drawn as asked, not a bad integer
            if new == value or (path[-1] == "sample_root" and 0 <= new < 2**63):
                continue
            mutant = copy.deepcopy(state)
            parent = _at(mutant, path[:-1])
            parent[path[-1]] = new
            out.append((f"set {path} to {new} (re-signed)", resign(mutant)))
    return out


def check_integers(case: Case) -> list[tuple[str, str]]:
    """(outcome, what was done) of each of ``integer_mutants(case.state)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [(outcome(case, mutant), what) for what, mutant in integer_mutants(case.state)]


def check_one(case: Case, rng: random.Random) -> tuple[str, str]:
    """(outcome, what was done, with " (re-signed)" when it was) of one mutant: a field
    edit, or one fourth of the time an edit inside a decoded blob."""
    if (_snapshots(case.state) or "sampler_rngs" in case.state) and rng.random() < 0.25:
        mutant, what, _ = mutate_decoded(case.state, rng)
    else:
        mutant, what, _ = mutate(case.state, rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return outcome(case, mutant), what


# -- re-partitioned states (snaploader.distributed.reshard, 4 ranks onto 3) -------------


def _reshard_factory(sampler: Any) -> snaploader.DataLoader:
    return snaploader.DataLoader(Augmented(40), batch_size=3, sampler=sampler, generator=generator(1))


def _reshard_states(during: bool) -> list[dict[str, Any]]:
    """The 4 old ranks' states after a batch of epoch 2; with ``during``, the 3 new
    ranks' states after a batch of the re-partitioned epoch."""
    old = []
    for rank in range(4):
        sampler = DistributedSampler(Augmented(40), num_replicas=4, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(2)
        old.append(cut_state(_reshard_factory(sampler), 0, 1))
    if not during:
        return old
    new = []
    for rank in range(3):
        loader = reshard(old, _reshard_factory, rank=rank, world_size=3)
        iterator = iter(loader)
        next(iterator)
        new.append(through_bytes(loader.state_dict()))
        del iterator
    return new


def _reshard_make(states: list[dict[str, Any]]) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(reshard(states, _reshard_factory, rank=0, world_size=3))


@dataclass
class ReshardCase:
    """Every rank's states, one of which is mutated, and new rank 0's stream from them."""

    name: str
    states: list[dict[str, Any]]
    expected: list[Any]


def build_reshard_case(name: str) -> ReshardCase:
    states = _reshard_states(during=name == "reshard-during")
    return ReshardCase(name, states, _reshard_make(copy.deepcopy(states)))


def _resign_resharded(state: dict[str, Any]) -> dict[str, Any]:
    # the inner loader state's digest, then the ReshardedLoader state's own
    rest = state.get("rest")
    if isinstance(rest, dict) and isinstance(rest.get("loader"), dict) and "workers" in rest["loader"]:
        try:
            rest["loader"]["digest"] = resign(rest["loader"])["digest"]
        except Exception:
            pass
    body = {key: value for key, value in state.items() if key != "digest"}
    return {**body, "digest": "sha256:" + sha256_of(body)}


def check_one_reshard(case: ReshardCase, rng: random.Random) -> tuple[str, str]:
    """A field edit of one rank's state (re-signed half the time, its source too) and
    what new rank 0 makes of the states: "clear", "identical" or what went wrong."""
    place = rng.randrange(len(case.states))
    states = copy.deepcopy(case.states)
    if states[place].get("format") == "snaploader":
        mutant, what, _ = mutate(states[place], rng)
    else:
        mutant, what, signable = mutate({**states[place], "workers": []}, rng)  # a ReshardedLoader's
        mutant.pop("workers", None)
        # its own digest covers the loader state under "rest" too: re-signed by the same
        # rule as a loader state's (never the user's state, a pending skip, RNG words)
        if signable and (" (re-signed)" in what or rng.random() < 0.5):
            mutant = _resign_resharded(mutant)
            what = what.removesuffix(" (re-signed)") + " (re-signed)"
    states[place] = mutant
    what = f"state {place}: {what}"
    try:
        got = _reshard_make(states)
    except CLEAR:
        return "clear", what
    except Exception as exc:
        return f"reshard raised {type(exc).__name__}: {exc}", what
    try:
        assert_same_stream(got, case.expected)
    except AssertionError as exc:
        return f"resharded silently into a different stream ({str(exc)[:200]})", what
    return "identical", what


RESHARD_CONFIGS = ("reshard-old-ranks", "reshard-during")
