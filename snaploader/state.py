"""The checkpoint format: plain data, versioned, fingerprinted, validated on load.

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
    workers       one ledger per worker (see ledger.py): snapshots as plain dicts
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from .errors import CheckpointFormatError, CheckpointMismatchError

FORMAT: Final = "snaploader"
VERSION: Final = 1

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
        if isinstance(ledger["yielded_complete"], str) and ledger["yielded_complete"] != "same as yielded":
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
