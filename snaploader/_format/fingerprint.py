"""What a checkpoint was taken from (the loader's fingerprint), and the comparison on
load that shows both sides of a difference and names the ``allow_mismatch`` key."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.utils.data import IterDataPipe
from torch.utils.data.distributed import DistributedSampler

from .._errors import CheckpointMismatchError

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

# Compared when the checkpoint has them: absent in format-3 checkpoints written before
# they were added. ``distributed``: torch's DistributedSampler's arguments (None for any
# other sampler), which is what snaploader.distributed needs to re-partition an epoch
# and what tells the checkpoint of one rank from another's.
OPTIONAL_KEYS: Final = ("distributed",)
DISTRIBUTED_FIELDS: Final = {"num_replicas": int, "rank": int, "shuffle": bool, "seed": int, "drop_last": bool}

# Compared always, the value given when the checkpoint lacks the key (written before it
# was added, when the behaviour it names did not exist). ``seed_per_sample``: each
# sample's draws come from its own states (_rng/per_sample.py); a stream taken with it
# is another stream, so it must not load silently into a loader without it, or back.
DEFAULTED_KEYS: Final = {"seed_per_sample": False}
CHECKED_KEYS: Final = FINGERPRINT_KEYS + OPTIONAL_KEYS + tuple(DEFAULTED_KEYS)
# Checked by a stateful sampler itself when it has ``_snaploader_check_resume``
# (a Mixture's: its weights and sources, mixture/state.py), not by the fingerprint.
SAMPLER_CHECKED_KEYS: Final = ("weights",)

# Recorded, never a mismatch: the processes do not define the stream, the logical
# workers do, and a checkpoint resumes exactly with any num_workers (docs/elastic.md).
# Nor does persistent_workers define the rest of an interrupted epoch (its ledger does:
# the epoch start and base seed persistent workers carried into it are in the
# checkpoint); the epochs after it follow the loading loader's setting.
_ANY_VALUE: Final = frozenset({"num_workers", "persistent_workers"})


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint was taken from; compared on load."""

    values: dict[str, Any]

    def mismatches(self, saved: Mapping[str, Any], allowed: frozenset[str]) -> list[str]:
        lines = []
        for key in CHECKED_KEYS:
            if key in allowed or key in _ANY_VALUE or (key in OPTIONAL_KEYS and key not in saved):
                continue
            theirs = saved.get(key, DEFAULTED_KEYS.get(key))
            if theirs != self.values[key]:
                lines.append(f"  {key}: {theirs!r} in checkpoint / {self.values[key]!r} in this loader")
        return lines




def check_fingerprint(saved: Mapping[str, Any], mine: Fingerprint, allowed: frozenset[str]) -> None:
    """Raise :class:`CheckpointMismatchError` showing both sides of each difference
    between the checkpoint's fingerprint ``saved`` and this loader's, unless allowed."""
    unknown = allowed - set(CHECKED_KEYS) - set(SAMPLER_CHECKED_KEYS)
    if unknown:
        raise ValueError(
            f"allow_mismatch names {sorted(unknown)}, which are not checked; "
            f"the checked names are {list(CHECKED_KEYS + SAMPLER_CHECKED_KEYS)}"
        )
    lines = mine.mismatches(saved, allowed)
    if lines:
        names = ", ".join(repr(line.split(":")[0].strip()) for line in lines) + ("," if len(lines) == 1 else "")
        raise CheckpointMismatchError(
            "the checkpoint was taken from a loader built differently:\n"
            + "\n".join(lines)
            + _another_rank(saved, mine)
            + "\nBuild the loader with the checkpoint's arguments to resume exactly, or "
            f"pass load_state_dict(state, allow_mismatch=({names})) to accept the "
            "difference knowingly (the resumed stream then differs from the original)"
        )


def _another_rank(saved: Mapping[str, Any], mine: Fingerprint) -> str:
    """A line for the one mismatch a framework makes rather than its user: another rank's
    state, of the same distributed sampler, given to this rank. Lightning's fit loop does
    it without snaploader's callback (it saves rank 0's loader state only and loads it on
    every rank); the callback saves every rank's. Empty for any other mismatch."""
    theirs, own = saved.get("distributed"), mine.values["distributed"]
    if not isinstance(theirs, dict) or own is None or theirs.get("rank") == own["rank"]:
        return ""
    if {k: v for k, v in theirs.items() if k != "rank"} != {k: v for k, v in own.items() if k != "rank"}:
        return ""  # another run's sampler
    return (
        f"\nThis is rank {own['rank']}'s loader, given rank {theirs['rank']}'s state: each rank "
        "resumes from its own. Lightning saves the loader state of rank 0 only and loads it on "
        "every rank: add snaploader.integrations.lightning.ExactResume() to the Trainer's "
        "callbacks, in the run that saves and the one that resumes (docs/lightning.md)"
    )




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
    seed_per_sample: bool = False,
) -> Fingerprint:
    try:
        length: int | None = len(dataset)
    except TypeError:
        length = None  # an iterable dataset without __len__
    if isinstance(dataset, IterDataPipe):
        # At num_workers=0 under torch.distributed the pipe is sharded in place, as torch
        # does, which changes its len(): not a fact of the loader's arguments.
        length = None
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
            "distributed": distributed_of(sampler),
            "seed_per_sample": seed_per_sample,
        }
    )


def distributed_of(sampler: Any) -> dict[str, Any] | None:
    """torch's DistributedSampler's arguments as plain data; None for another sampler
    (a subclass included: its order may not be DistributedSampler's)."""
    if type(sampler) is not DistributedSampler:
        return None
    return {key: kind(getattr(sampler, key)) for key, kind in DISTRIBUTED_FIELDS.items()}
