"""A world whose sampler deals one stream to its ranks (a Mixture's: rank r takes draws
r, r + W, ... of a stream every rank computes alike): its checkpoints, taken at one
training step, all stand at one position of the stream, so a world of another size
resumes from any of them, each new rank taking its own turn of the rest. ``reshard``
comes here for such checkpoints (``distributed/resharded.py``); nothing is re-dealt by
index as for a DistributedSampler (``distributed/rules.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from .._errors import CheckpointFormatError, CheckpointMismatchError
from .._format.checkpoint import Checkpoint
from .._format.parse import parse
from .._loader import DataLoader

# The samplers, by the fingerprint's name, whose state holds the stream's position and
# their [rank, world size], and that make a sampler for another rank
# (``_snaploader_for_rank``).
STREAM_SAMPLERS: Final = ("MixtureSampler",)


def is_stream_world(states: Sequence[Any]) -> bool:
    """Whether the first of ``states`` (loader states) was taken over such a sampler."""
    first = states[0] if states else None
    fingerprint = first.get("fingerprint") if isinstance(first, dict) else None
    return isinstance(fingerprint, dict) and fingerprint.get("sampler") in STREAM_SAMPLERS


def _position(checkpoint: Checkpoint, who: str) -> tuple[Any, ...]:
    sampler = checkpoint.sampler_state
    state = None if sampler is None else sampler.state
    if not isinstance(state, dict) or not isinstance(state.get("world"), list) or len(state["world"]) != 2:
        raise CheckpointFormatError(f"{who} has no stream position (its sampler state holds no [rank, world size])")
    if not checkpoint.record.in_order and not checkpoint.ended:
        raise CheckpointMismatchError(
            f"{who} was taken mid-epoch with in_order=False, whose yielded batches are not the "
            "first ones: another world size resumes from a checkpoint taken with in_order=True, "
            "or at an epoch's end"
        )
    rest = {key: value for key, value in state.items() if key != "world"}
    return checkpoint.epoch, checkpoint.ended, checkpoint.yielded, repr(sorted(rest.items())), tuple(state["world"])


def reshard_stream(
    states: Sequence[dict[str, Any]], make_loader: Callable[[Any], DataLoader[Any]], rank: int, world_size: int
) -> DataLoader[Any]:
    """New rank ``rank`` of ``world_size``'s loader, going on from the old ranks'
    ``states`` (every old rank's, taken at one step): they must all stand at one
    position; ``make_loader(None)`` is built once to find the sampler, whose
    ``_snaploader_for_rank`` makes this rank's, and ``make_loader(that)`` is loaded."""
    seen: dict[int, tuple[Any, ...]] = {}
    size = None
    for place, state in enumerate(states):
        who = f"checkpoint {place} of the list"
        try:
            checkpoint = parse(state)
        except CheckpointFormatError as exc:
            raise CheckpointFormatError(f"{who}: {exc}") from None
        position = _position(checkpoint, who)
        old_rank, old_size = position[-1]
        if size is None:
            size = old_size
        if old_size != size or old_rank in seen:
            raise CheckpointMismatchError(
                f"{who} is rank {old_rank} of {old_size}: pass every rank's checkpoint of one run once"
            )
        if seen and position[:-1] != next(iter(seen.values()))[:-1]:
            raise CheckpointMismatchError(
                f"{who} (rank {old_rank}) stands elsewhere in the stream than rank {next(iter(seen))}'s: "
                "pass the checkpoints every rank saved at one training step"
            )
        seen[old_rank] = position
    if size is None or len(seen) != size:
        missing = sorted(set(range(size or 1)) - set(seen))
        raise CheckpointMismatchError(f"the checkpoints lack rank(s) {missing} of the old world of {size}: pass every rank's")
    probe = make_loader(None)
    for_rank = getattr(probe.sampler, "_snaploader_for_rank", None)
    if for_rank is None:
        raise TypeError(
            f"make_loader(None) built a loader over {type(probe.sampler).__name__}; the checkpoints were "
            f"taken over {', '.join(STREAM_SAMPLERS)}: build the loader over the same dataset"
        )
    loader = make_loader(for_rank(rank, world_size))
    loader.load_state_dict(states[0])
    return loader
