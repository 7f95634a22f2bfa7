"""A shard stream worker's state, read back from a checkpoint: untrusted plain data
turned once into a frozen :class:`ShardState`, every field checked (types, ranges, the
shard list it was taken over), so that a resume never reads past a shard's end or
loops on a bad cursor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import CheckpointFormatError, CheckpointMismatchError

# One unit of a worker's work: (shard index, offset of its first sample, how many
# samples to read from there; -1 to the end of the shard).
Work = tuple[int, int, int]
Split = tuple[int, int, int, int]  # rank, world size, worker, workers


class Stream(Protocol):
    """What a state is checked against: the stream it is loaded into."""

    @property
    def fingerprint(self) -> str: ...
    @property
    def urls(self) -> Sequence[str]: ...
    @property
    def shuffle_buffer(self) -> int: ...

_KEYS = ("shards", "seed", "split", "plan", "item", "offset", "left", "buffer", "draws")


@dataclass(frozen=True)
class ShardState:
    """Where one worker of a shard stream stands (``shards/stream.py``'s docstring)."""

    seed: int
    split: Split
    plan: tuple[Work, ...] | None
    item: int
    offset: int
    left: int
    buffer: tuple[tuple[int, int], ...]
    draws: int


def _fail(key: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"shard stream state['{key}'] {problem}; load an unedited checkpoint of this stream"
    )


def _int(state: dict[str, Any], key: str, low: int) -> int:
    value = state[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _fail(key, f"should be an int >= {low}, got {value!r}")
    return value


def _ints(value: Any, key: str, size: int) -> tuple[int, ...]:
    if (not isinstance(value, (list, tuple)) or len(value) != size
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise _fail(key, f"should hold lists of {size} ints, got {value!r}")
    return tuple(value)


def read_state(state: Any, stream: Stream, split: Split | None) -> ShardState:
    """``state`` checked against ``stream``; ``split``, when given, is the worker's own,
    which a state taken in another split (another world size) does not fit."""
    if not isinstance(state, dict) or set(state) != set(_KEYS):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise CheckpointFormatError(
            f"a shard stream state should be a dict with keys {list(_KEYS)}, got {got}; "
            "load a checkpoint taken with this ShardStream"
        )
    if state["shards"] != stream.fingerprint:
        raise CheckpointMismatchError(
            f"the checkpoint was taken over another shard list (or shuffle_shards): checkpoint: {state['shards']!r} / "
            f"this stream: {stream.fingerprint!r}. Build the ShardStream with the shards, in "
            "the order and with the shuffle_shards the checkpoint was taken with (new shards: resume, finish the epoch, "
            "then build the stream over the new list)"
        )
    seed = _int(state, "seed", 0)
    rank, world, worker, workers = _ints(state["split"], "split", 4)
    if not (0 <= rank < world and 0 <= worker < workers):
        raise _fail("split", f"should be [rank, world size, worker, workers] in range, got {state['split']!r}")
    if split is not None and (rank, world) != split[:2]:
        raise CheckpointMismatchError(
            f"the checkpoint's shard stream was split over {world} rank(s) (this was rank "
            f"{rank}); this stream is rank {split[0]} of {split[1]}. To resume on another world "
            "size, give every old rank's state to snaploader.shards.resplit (docs/shards.md)"
        )
    count = len(stream.urls)
    plan = None
    if state["plan"] is not None:
        if not isinstance(state["plan"], list):
            raise _fail("plan", f"should be None or a list, got {type(state['plan']).__name__}")
        plan = tuple(_ints(w, "plan", 3) for w in state["plan"])
        if not all(0 <= s < count and o >= 0 and c >= -1 for s, o, c in plan):
            raise _fail("plan", f"holds a work item out of range for {count} shards")
    length = len(plan) if plan is not None else len(range(rank, count, world)[worker::workers])
    item = _int(state, "item", 0)
    if item > length:
        raise _fail("item", f"is {item}, past this worker's {length} work item(s)")
    offset = _int(state, "offset", -1)
    left = _int(state, "left", -1)
    if not isinstance(state["buffer"], list):
        raise _fail("buffer", f"should be a list, got {type(state['buffer']).__name__}")
    buffer = tuple(_ints(ref, "buffer", 2) for ref in state["buffer"])
    if not all(0 <= s < count and o >= 0 for s, o in buffer):
        raise _fail("buffer", f"holds a reference out of range for {count} shards")
    if len(set(buffer)) != len(buffer):
        raise _fail("buffer", "holds a sample's reference twice")
    if len(buffer) > max(1, stream.shuffle_buffer):
        raise CheckpointMismatchError(
            f"the checkpoint's shuffle buffer holds {len(buffer)} samples, more than this "
            f"stream's shuffle_buffer={stream.shuffle_buffer}: build the stream with the "
            "shuffle_buffer the checkpoint was taken with"
        )
    draws = _int(state, "draws", 0)
    return ShardState(seed, (rank, world, worker, workers), plan, item, offset, left, buffer, draws)  # type: ignore[arg-type]
