"""The checkpoint format, all of it: build, validate, fingerprint, plain conversion.

A checkpoint is a dict of ints, str, bytes, bools, None, lists and dicts (and whatever
plain data a dataset's own ``state_dict()`` returns), so it survives
``torch.save`` / ``torch.load(weights_only=True)``. Layout (version 1)::

    format        "snaploader"
    version       1
    fingerprint   {dataset_kind, dataset_length, batch_size, num_workers, drop_last,
                   sampler, batch_sampler, persistent_workers, generator}
    epoch         index of the epoch this describes (-1: none started yet)
    ended         True when that epoch is over: the next iter() starts epoch + 1
    yielded       batches yielded in that epoch
    turn          iterable datasets: the worker whose batch comes next
    rng_kind      "generator" or "global": what the epoch's draws came from
    rng_start     that generator's state at the epoch start (a uint8 tensor)
    rng_next      the generator's state for the next epoch (a uint8 tensor), or None
    base_seed     the epoch's worker base seed; drew_base_seed: drawn this epoch
    sampler_state {state, done}: the stateful sampler's state before the next batch
                  (done: it has nothing left this epoch), or None
    sampler_epoch the sampler's ``epoch`` (DistributedSampler), or None
    workers       one ledger per worker slot (see _ledger.py):
                  {epoch_start, yielded, yielded_complete, exhausted}, each snapshot a
                  dict {rng (uint8 tensor), produced, data, data_owner, complete,
                  exhausted}; yielded_complete is "same as yielded" when it is
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from ._errors import CheckpointFormatError, CheckpointMismatchError, StateNotPlainDataError
from ._ledger import EpochProgress, EpochStart, WorkerLedger
from ._protocol import Snapshot
from ._rng import RngSource, rng_bytes

FORMAT: Final = "snaploader"
VERSION: Final = 1
_SAME_AS_YIELDED: Final = "same as yielded"

FINGERPRINT_KEYS: Final = (
    "dataset_kind",
    "dataset_length",
    "batch_size",
    "num_workers",
    "drop_last",
    "sampler",
    "batch_sampler",
    "persistent_workers",
    "generator",
)

_SNAPSHOT_FIELDS: Final = {
    "rng": (bytes, torch.Tensor),
    "produced": (int,),
    "data_owner": (str, type(None)),
    "complete": (bool,),
    "exhausted": (bool,),
}

_TOP_FIELDS: Final = {
    "format": (str,),
    "version": (int,),
    "fingerprint": (dict,),
    "epoch": (int,),
    "ended": (bool,),
    "yielded": (int,),
    "turn": (int,),
    "rng_kind": (str,),
    "rng_start": (bytes, torch.Tensor, type(None)),
    "rng_next": (bytes, torch.Tensor, type(None)),
    "base_seed": (int, type(None)),
    "drew_base_seed": (bool,),
    "sampler_epoch": (int, type(None)),
    "workers": (list,),
}


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint was taken from; compared on load."""

    values: dict[str, Any]

    def mismatches(self, saved: dict[str, Any], allowed: frozenset[str]) -> list[str]:
        lines = []
        for key in FINGERPRINT_KEYS:
            if key in allowed:
                continue
            if saved.get(key) != self.values[key]:
                lines.append(f"  {key}: {saved.get(key)!r} in checkpoint / {self.values[key]!r} in this loader")
        return lines


def _check_fields(where: str, value: Any, fields: dict[str, tuple[type, ...]]) -> None:
    if not isinstance(value, dict):
        raise CheckpointFormatError(
            f"{where} should be a dict, got {type(value).__name__}; pass the dict that "
            "snaploader's DataLoader.state_dict() returned"
        )
    for key, types in fields.items():
        if key not in value:
            raise CheckpointFormatError(
                f"{where} has no {key!r} key; it was not made by snaploader's "
                "DataLoader.state_dict() or was edited"
            )
        item = value[key]
        # bool is an int subclass; an int field must not silently accept True.
        if not isinstance(item, types) or (isinstance(item, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise CheckpointFormatError(
                f"{where}[{key!r}] should be {names}, got {type(item).__name__} ({item!r:.60})"
            )


def validate(state: Any) -> None:
    """Raise :class:`CheckpointFormatError` naming the first problem in ``state``."""
    _check_fields("loader state", state, {"format": (str,), "version": (int,)})
    if state["format"] != FORMAT:
        raise CheckpointFormatError(
            f"loader state has format {state['format']!r}, expected {FORMAT!r}"
        )
    if state["version"] != VERSION:
        raise CheckpointFormatError(
            f"loader state has format version {state['version']}; this snaploader reads "
            f"version {VERSION}. Resume with the snaploader release that wrote it"
        )
    _check_fields("loader state", state, _TOP_FIELDS)
    for key in FINGERPRINT_KEYS:
        if key not in state["fingerprint"]:
            raise CheckpointFormatError(f"loader state['fingerprint'] has no {key!r} key")
    if state["rng_kind"] not in ("generator", "global"):
        raise CheckpointFormatError(
            f"loader state['rng_kind'] should be 'generator' or 'global', got {state['rng_kind']!r}"
        )
    for i, ledger in enumerate(state["workers"]):
        where = f"loader state['workers'][{i}]"
        _check_fields(
            where,
            ledger,
            {"epoch_start": (dict, type(None)), "yielded": (dict, type(None)),
             "yielded_complete": (dict, str, type(None)), "exhausted": (bool,)},
        )
        if isinstance(ledger["yielded_complete"], str) and ledger["yielded_complete"] != _SAME_AS_YIELDED:
            raise CheckpointFormatError(
                f"{where}['yielded_complete'] should be a snapshot dict, None or "
                f"'same as yielded', got {ledger['yielded_complete']!r:.60}"
            )
        for key in ("epoch_start", "yielded", "yielded_complete"):
            if isinstance(ledger[key], dict):
                _check_fields(f"{where}[{key!r}]", ledger[key], _SNAPSHOT_FIELDS)
                if "data" not in ledger[key]:
                    raise CheckpointFormatError(f"{where}[{key!r}] has no 'data' key")
    if "sampler_state" not in state:
        raise CheckpointFormatError("loader state has no 'sampler_state' key")
    sampler_state = state["sampler_state"]
    if sampler_state is not None:
        _check_fields("loader state['sampler_state']", sampler_state, {"done": (bool,)})
        if "state" not in sampler_state:
            raise CheckpointFormatError("loader state['sampler_state'] has no 'state' key")
    if state["yielded"] < 0 or state["epoch"] < -1:
        raise CheckpointFormatError(
            f"loader state has epoch {state['epoch']} and yielded {state['yielded']}; "
            "both must be non-negative (epoch -1: before the first epoch)"
        )


def check_fingerprint(state: dict[str, Any], mine: Fingerprint, allowed: frozenset[str]) -> None:
    unknown = allowed - set(FINGERPRINT_KEYS)
    if unknown:
        raise ValueError(
            f"allow_mismatch names {sorted(unknown)}, which are not checked; "
            f"the checked names are {list(FINGERPRINT_KEYS)}"
        )
    lines = mine.mismatches(state["fingerprint"], allowed)
    if lines:
        names = ", ".join(repr(line.split(":")[0].strip()) for line in lines)
        raise CheckpointMismatchError(
            "the checkpoint was taken from a loader built differently:\n"
            + "\n".join(lines)
            + "\nBuild the loader with the checkpoint's arguments to resume exactly, or "
            f"pass load_state_dict(state, allow_mismatch=({names},)) to accept the "
            "difference knowingly (the resumed stream then differs from the original)"
        )


# -- plain conversion -------------------------------------------------------------------


def rng_to_plain(blob: bytes) -> torch.Tensor:
    """RNG bytes as a uint8 tensor: torch.save stores tensors raw, while its pickle
    protocol 2 stores ``bytes`` as latin-1 text, 1.6 times larger."""
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def rng_from_plain(value: bytes | torch.Tensor) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
    return bytes(value)


def snapshot_to_plain(snapshot: Snapshot) -> dict[str, Any]:
    return {
        "rng": rng_to_plain(rng_bytes(snapshot.rng)),
        "produced": snapshot.produced,
        "data": snapshot.data,
        "data_owner": snapshot.data_owner,
        "complete": snapshot.complete,
        "exhausted": snapshot.exhausted,
    }


def snapshot_from_plain(plain: dict[str, Any]) -> Snapshot:
    return Snapshot(
        rng=rng_from_plain(plain["rng"]),
        produced=int(plain["produced"]),
        data=plain["data"],
        data_owner=plain["data_owner"],
        complete=bool(plain["complete"]),
        exhausted=bool(plain["exhausted"]),
    )


def ledger_to_plain(ledger: WorkerLedger) -> dict[str, Any]:
    def plain(snapshot: Snapshot | None) -> dict[str, Any] | None:
        return None if snapshot is None else snapshot_to_plain(snapshot)

    # Usually the newest complete snapshot is the newest one; say so, not twice.
    same = ledger.yielded_complete is not None and ledger.yielded_complete is ledger.yielded
    return {
        "epoch_start": plain(ledger.epoch_start),
        "yielded": plain(ledger.yielded),
        "yielded_complete": _SAME_AS_YIELDED if same else plain(ledger.yielded_complete),
        "exhausted": ledger.exhausted,
    }


def ledger_from_plain(plain: dict[str, Any]) -> WorkerLedger:
    def snap(value: dict[str, Any] | None) -> Snapshot | None:
        return None if value is None else snapshot_from_plain(value)

    yielded = snap(plain["yielded"])
    complete = plain["yielded_complete"]
    return WorkerLedger(
        epoch_start=snap(plain["epoch_start"]),
        yielded=yielded,
        yielded_complete=yielded if complete == _SAME_AS_YIELDED else snap(complete),
        exhausted=bool(plain["exhausted"]),
    )


_PLAIN_SCALARS = (int, float, bool, str, bytes, type(None), torch.Tensor)


def check_plain(value: Any, where: str) -> None:
    """Raise :class:`StateNotPlainDataError` unless ``value`` is checkpointable plain
    data: nested dicts (str/int keys), lists and tuples of ints, floats, bools, str,
    bytes, None and tensors."""
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise StateNotPlainDataError(
                    f"{where} has a key of type {type(key).__name__} ({key!r}); "
                    "use str or int keys so the checkpoint loads with weights_only=True"
                )
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    hint = ""
    if isinstance(value, np.ndarray):
        hint = " (convert NumPy arrays with torch.from_numpy or .tolist())"
    elif isinstance(value, np.generic):
        hint = " (convert NumPy scalars with .item())"
    elif isinstance(value, np.random.Generator):
        hint = " (save generator.bit_generator.state instead)"
    raise StateNotPlainDataError(
        f"{where} holds a {type(value).__module__}.{type(value).__qualname__}, which "
        f"torch.load(weights_only=True) refuses{hint}; return only dicts, lists, "
        "numbers, str, bytes, None and tensors from state_dict()"
    )


# -- building and reading a checkpoint ---------------------------------------------------


def fingerprint_of(
    *,
    dataset: Any,
    iterable: bool,
    batch_size: int | None,
    num_workers: int,
    drop_last: bool,
    sampler: Any,
    batch_sampler: Any,
    persistent_workers: bool,
    generator: torch.Generator | None,
) -> Fingerprint:
    try:
        length: int | None = len(dataset)
    except TypeError:
        length = None  # an iterable dataset without __len__
    return Fingerprint(
        {
            "dataset_kind": "iterable" if iterable else "map",
            "dataset_length": length,
            "batch_size": batch_size,
            "num_workers": num_workers,
            "drop_last": drop_last,
            "sampler": type(sampler).__qualname__,
            "batch_sampler": None if batch_sampler is None else type(batch_sampler).__qualname__,
            "persistent_workers": persistent_workers,
            "generator": "none" if generator is None else "given",
        }
    )


def build_state(
    fingerprint: Fingerprint, progress: EpochProgress | None, source: RngSource
) -> dict[str, Any]:
    """The checkpoint of a loader whose current (or last) epoch is ``progress``."""
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": dict(fingerprint.values),
        "rng_kind": source.kind,
    }
    if progress is None:
        state.update(
            epoch=-1, ended=True, yielded=0, turn=0, rng_start=None,
            base_seed=None, drew_base_seed=True, sampler_state=None,
            sampler_epoch=None, workers=[],
        )
    else:
        state.update(
            epoch=progress.epoch,
            ended=progress.ended,
            yielded=progress.yielded,
            turn=progress.turn,
            rng_start=rng_to_plain(progress.rng_start),
            base_seed=progress.base_seed,
            drew_base_seed=progress.drew_base_seed,
            sampler_state=progress.sampler_state(),
            sampler_epoch=progress.sampler_epoch,
            workers=[ledger_to_plain(ledger) for ledger in progress.workers],
        )
    ended = state["ended"]
    state["rng_next"] = (
        rng_to_plain(source.get_state()) if ended and source.generator is not None else None
    )
    return state


@dataclass(frozen=True)
class Restore:
    """What a validated checkpoint asks of a loader: the next epoch's start, and for a
    checkpoint taken between epochs, the sampler state and generator state to set."""

    start: EpochStart
    ledgers: list[WorkerLedger]
    sampler_state: Any
    rng_next: bytes | None


def read_state(
    state: Any, mine: Fingerprint, allowed: frozenset[str], slots: int, persistent: bool
) -> Restore:
    """Validate ``state`` against this loader and say how to resume from it."""
    validate(state)
    check_fingerprint(state, mine, allowed)
    ledgers = [ledger_from_plain(plain) for plain in state["workers"]]
    if len(ledgers) != slots:
        ledgers = []  # num_workers differs (allowed): workers start freshly seeded
    if state["ended"]:
        if persistent and state["epoch"] >= 0 and ledgers:
            start = EpochStart(
                epoch=state["epoch"] + 1,
                base_seed=state["base_seed"],
                draw_base_seed=False,
                workers=[ledger.next_epoch() for ledger in ledgers],
            )
        else:
            start = EpochStart(epoch=state["epoch"] + 1)
        rng_next = None if state["rng_next"] is None else rng_from_plain(state["rng_next"])
        return Restore(start, ledgers, state["sampler_state"], rng_next)
    start = EpochStart(
        epoch=state["epoch"],
        restore_rng=rng_from_plain(state["rng_start"]),
        base_seed=state["base_seed"],
        draw_base_seed=state["drew_base_seed"],
        yielded=state["yielded"],
        turn=state["turn"] if ledgers else 0,
        workers=ledgers or None,
        sampler_state=state["sampler_state"],
        sampler_epoch=state["sampler_epoch"],
    )
    return Restore(start, ledgers, None, None)
