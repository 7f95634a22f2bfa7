"""A mixture's position as plain data, and its checks: the sampler's ``state_dict()``
read back from an untrusted checkpoint into :class:`MixtureState` (every field's type
and range), and compared with the mixture it is loaded into (its weights, its sources
and their lengths), so that a changed mixture resumes only when the user said so.

The state, O(number of sources)::

    seed        the mixture's seed (None: not drawn yet, before the first epoch)
    drawn       samples the mixture has drawn in all, over every rank (the stream's position)
    epoch_left  samples left to draw in the epoch under way, over every rank (0: none under way)
    world       [rank, world size] of the loader that took it
    weights     the weights in force at ``drawn`` (a schedule's result there)
    scheduled   whether the weights came from a schedule
    sources     per source ever drawn from, removed ones kept:
                [pass, offset in the pass, the pass's length, the length of the passes
                 this epoch starts, samples drawn this epoch, the pass, offset and pass
                 length the epoch started at]

A source's length is read at each epoch start: passes that begin in an epoch run over
the length it had when the epoch began, and a pass runs to the end of the length it
began with, so a source grown at a resume (``allow_mismatch=("dataset_length",)``)
gives its new items from the first pass that begins in the next epoch, as a grown
dataset does (docs/mixtures.md).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._errors import CheckpointFormatError, CheckpointMismatchError

Weights = Mapping[str, float]
Schedule = Callable[[int], Weights]

_KEYS: Final = ("seed", "drawn", "epoch_left", "world", "weights", "scheduled", "sources")
_CURSOR: Final = ("pass", "offset", "pass length", "epoch's length", "drawn this epoch", "epoch's first pass",
                  "epoch's first offset", "epoch's first pass length")


def checked_weights(weights: Any, names: tuple[str, ...], where: str) -> dict[str, float]:
    """``weights`` as a dict of floats over exactly ``names``, or a ``ValueError`` that
    says what is wrong with them (``where`` names them: the argument, or a schedule's call)."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"{where} should be a dict of source name to weight, got {type(weights).__name__}")
    unknown = sorted(set(weights) - set(names), key=str)
    if unknown:
        raise ValueError(f"{where} names {unknown}, which are not sources of this Mixture (its sources: {list(names)})")
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"{where} has no weight for the source(s) {missing}: give each source a weight (0 to leave one out)")
    out = {}
    for name in names:
        value = weights[name]
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{where}[{name!r}] should be a number, got {type(value).__name__}")
        value = float(value)
        if math.isnan(value) or math.isinf(value) or value < 0:
            raise ValueError(f"{where}[{name!r}] is {value}; a weight should be a finite number >= 0")
        out[name] = value
    if not any(out.values()):
        raise ValueError(f"{where} are all zero: at least one source needs a weight > 0")
    return out


@dataclass
class Cursor:
    """Where one source stands: the pass under way and how far into it."""

    pass_: int
    offset: int
    pass_length: int  # the pass's order runs over this many items
    length: int  # what the passes that begin this epoch run over: the length at the epoch start
    epoch_drawn: int = 0
    epoch_pass: int = 0
    epoch_offset: int = 0
    epoch_pass_length: int = 0

    @classmethod
    def new(cls, length: int) -> Cursor:
        """A source's cursor before its first draw."""
        return cls(0, 0, length, length, 0, 0, 0, length)

    def begin_epoch(self, length: int) -> None:
        self.length = length
        self.epoch_drawn, self.epoch_pass, self.epoch_offset, self.epoch_pass_length = 0, self.pass_, self.offset, self.pass_length

    def plain(self) -> list[int]:
        return [self.pass_, self.offset, self.pass_length, self.length, self.epoch_drawn, self.epoch_pass,
                self.epoch_offset, self.epoch_pass_length]


@dataclass(frozen=True)
class MixtureState:
    """A mixture sampler's state, checked (module docstring)."""

    seed: int | None
    drawn: int
    epoch_left: int
    world: tuple[int, int]
    weights: dict[str, float]
    scheduled: bool
    sources: dict[str, Cursor]


def _fail(key: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"the mixture's sampler state[{key!r}] {problem}: the checkpoint was not written by a "
        "Mixture's sampler, or was edited. Load the checkpoint taken with this Mixture"
    )


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(key, f"should be an int >= 0, got {value!r:.40}")
    return value


def read_state(state: Any) -> MixtureState:
    """``state`` (a ``MixtureSampler.state_dict()`` as loaded) checked into a :class:`MixtureState`."""
    if not isinstance(state, dict) or set(state) != set(_KEYS):
        got = sorted(state, key=str) if isinstance(state, dict) else type(state).__name__
        raise CheckpointFormatError(
            f"a Mixture sampler's state should be a dict with keys {list(_KEYS)}, got {got}: "
            "load a checkpoint taken from a loader over this Mixture"
        )
    seed = state["seed"]
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        raise _fail("seed", f"should be None or an int in [0, 2**64), got {seed!r:.40}")
    drawn = _count(state["drawn"], "drawn")
    epoch_left = _count(state["epoch_left"], "epoch_left")
    world = state["world"]
    if not (isinstance(world, (list, tuple)) and len(world) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in world)
            and 0 <= world[0] < world[1]):
        raise _fail("world", f"should be [rank, world size] with 0 <= rank < world size, got {world!r:.40}")
    if not isinstance(state["scheduled"], bool):
        raise _fail("scheduled", f"should be a bool, got {state['scheduled']!r:.40}")
    sources = state["sources"]
    if not isinstance(sources, dict) or not sources or not all(isinstance(name, str) for name in sources):
        raise _fail("sources", "should be a non-empty dict of source name to cursor")
    cursors = {}
    for name, cursor in sources.items():
        if not isinstance(cursor, (list, tuple)) or len(cursor) != len(_CURSOR):
            raise _fail("sources", f"[{name!r}] should be a list of {len(_CURSOR)} ints ({', '.join(_CURSOR)})")
        values = [_count(v, f"sources'][{name!r}") for v in cursor]
        c = Cursor(*values)
        if not (1 <= c.pass_length and c.offset <= c.pass_length and 1 <= c.length and 1 <= c.epoch_pass_length
                and c.epoch_offset <= c.epoch_pass_length
                and (c.epoch_pass, c.epoch_offset) <= (c.pass_, c.offset) and c.epoch_drawn <= drawn):
            raise _fail("sources", f"[{name!r}] is {list(cursor)}, which no mixture reaches")
        cursors[name] = c
    weights = state["weights"]
    if not isinstance(weights, dict) or not set(weights) <= set(cursors):
        raise _fail("weights", "should be a dict over the state's sources")
    try:
        checked = checked_weights(weights, tuple(weights), "the checkpoint's weights")
    except (TypeError, ValueError) as exc:
        raise _fail("weights", f"is not a valid set of weights ({exc})") from None
    return MixtureState(seed, drawn, epoch_left, (world[0], world[1]), checked, state["scheduled"], cursors)


def check_resume(saved: MixtureState, seed: int | None, lengths: Mapping[str, int], weights: dict[str, float],
                 scheduled: bool, allowed: Iterable[str]) -> None:
    """Raise :class:`CheckpointMismatchError` when the mixture a checkpoint is loaded into
    differs from the one it was taken from, unless the difference is allowed: another
    seed never; other weights or sources (added, removed) with ``"weights"``; a source of
    another length with ``"dataset_length"`` (grown only: a pass under way runs over the
    items it began with)."""
    allowed = frozenset(allowed)
    if seed is not None and saved.seed is not None and seed != saved.seed:
        raise CheckpointMismatchError(
            f"the checkpoint's mixture was drawn with seed={saved.seed}, this Mixture has seed={seed}: "
            f"build the Mixture with seed={saved.seed} to resume it"
        )
    lines = []
    for name, length in lengths.items():
        cursor = saved.sources.get(name)
        if cursor is None or cursor.length == length:
            continue
        needed = max(cursor.pass_length if cursor.offset < cursor.pass_length else 0, cursor.length if saved.epoch_left else 0)
        if length < needed:
            raise CheckpointMismatchError(
                f"source {name!r} has {length} items, fewer than the {needed} its pass under way (pass "
                f"{cursor.pass_}) or the epoch under way runs over: a source cannot shrink under them. Resume "
                "with the source as it was until its pass and the epoch are over, or start a new run"
            )
        if "dataset_length" not in allowed:
            lines.append(f"  source {name!r} length: {cursor.length} in checkpoint / {length} in this Mixture "
                         "(allow_mismatch 'dataset_length': its pass under way ends over the old items, the next one takes all)")
    if (weights, scheduled) != (saved.weights, saved.scheduled) and "weights" not in allowed:
        def shown(w: dict[str, float], s: bool) -> str:
            return ("a schedule giving " if s else "") + repr(w)
        lines.append(f"  weights: {shown(saved.weights, saved.scheduled)} in checkpoint / {shown(weights, scheduled)} in this "
                     f"Mixture, at {saved.drawn} samples drawn (allow_mismatch 'weights': the new weights choose "
                     "from here on, each source going on in its own order)")
    if lines:
        names = sorted({"dataset_length" if "length:" in line else "weights" for line in lines})
        raise CheckpointMismatchError(
            "the checkpoint was taken from a Mixture built differently:\n" + "\n".join(lines)
            + f"\nBuild the Mixture as it was to resume exactly, or pass load_state_dict(state, "
            f"allow_mismatch=({', '.join(repr(n) for n in names)},)) to accept the change"
        )
