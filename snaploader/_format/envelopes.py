"""The envelopes a loader state travels in, written and parsed here, with the loader
state's errors (a :class:`CheckpointFormatError` naming the place and what to do):

- a ``ReshardedLoader``'s state (``distributed/resharded.py``): format
  ``"snaploader.distributed"``, version 1, its rank and world size, and either the
  loader states of the old ranks it hosts or, during a re-partitioned epoch, that
  epoch's source and the state of the loader reading this rank's share, all under a
  digest; parsed into a :class:`ReshardedState`;
- a loader state as JSON text: the DCP leaf (``distributed/dcp.py``) and the
  per-process files of ``integrations/accelerate.py``.

The loader states inside are parsed when a loader loads them (``_format/parse.py``);
a re-partition source's fields are ``distributed/rules.py``'s (``Source.from_plain``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from .checkpoint import sha256_of
from .plain import check_depth
from .._errors import CheckpointFormatError

RESHARDED_FORMAT: Final = "snaploader.distributed"
RESHARDED_VERSION: Final = 1
_RESHARDED_KEYS: Final = frozenset({"format", "version", "rank", "world_size", "loaders", "rest", "digest"})


@dataclass(frozen=True)
class Rest:
    """A re-partitioned epoch under way: its source (plain, ``Source.to_plain``) and
    the state of the loader reading this rank's share of it."""

    source: Any
    loader: dict[str, Any]


@dataclass(frozen=True)
class ReshardedState:
    """A ``ReshardedLoader``'s state, parsed: ``loaders`` (the hosted old ranks'
    states, in order) is empty when ``rest`` is set."""

    rank: int
    world_size: int
    loaders: tuple[Any, ...]
    rest: Rest | None


def resharded_state(rank: int, world_size: int, loaders: list[dict[str, Any]], rest: Rest | None) -> dict[str, Any]:
    """The plain state of a ``ReshardedLoader``, digest included."""
    body = {
        "format": RESHARDED_FORMAT,
        "version": RESHARDED_VERSION,
        "rank": rank,
        "world_size": world_size,
        "loaders": [] if rest is not None else loaders,
        "rest": None if rest is None else {"source": rest.source, "loader": rest.loader},
    }
    return {**body, "digest": "sha256:" + sha256_of(body)}


def is_resharded(state: Any) -> bool:
    """Whether ``state`` says it is a ``ReshardedLoader``'s (then it must parse)."""
    return isinstance(state, dict) and state.get("format") == RESHARDED_FORMAT


def parse_resharded(state: dict[str, Any], where: str) -> ReshardedState:
    """``state`` (one :func:`is_resharded` accepts), checked as the parse checks a
    loader state: its version, depth and digest first, then every field's type and
    range. ``where`` names it in the errors."""
    if state.get("format") != RESHARDED_FORMAT:
        raise CheckpointFormatError(f"{where} has format {state.get('format')!r:.40}, not {RESHARDED_FORMAT!r}")
    if state.get("version") != RESHARDED_VERSION:
        raise CheckpointFormatError(
            f"{where} has version {state.get('version')!r:.20}; this snaploader reads {RESHARDED_VERSION}: "
            "resume with the snaploader release that saved it"
        )
    check_depth(state, where)
    body = {key: value for key, value in state.items() if key != "digest"}
    try:
        intact = state.get("digest") == "sha256:" + sha256_of(body)
    except (TypeError, ValueError):
        intact = False
    if not intact:
        raise CheckpointFormatError(f"{where} was modified or corrupted after state_dict() made it")
    if set(state) != _RESHARDED_KEYS:
        raise CheckpointFormatError(f"{where} has the keys {sorted(state)}, not a ReshardedLoader state's")
    rank, size, loaders, rest = state["rank"], state["world_size"], state["loaders"], state["rest"]
    if type(rank) is not int or type(size) is not int or not 0 <= rank < size:
        raise CheckpointFormatError(
            f"{where} has rank {rank!r:.20} of world_size {size!r:.20}; expected ints with 0 <= rank < world_size"
        )
    if (
        not isinstance(loaders, list)
        or (rest is not None) == bool(loaders)
        or not all(isinstance(loader, dict) for loader in loaders)
    ):
        raise CheckpointFormatError(
            f"{where}['loaders'] should be a list of the hosted loaders' states, empty during a re-partitioned "
            "epoch (its 'rest' set) and only then"
        )
    if rest is not None and not (isinstance(rest, dict) and set(rest) == {"source", "loader"} and isinstance(rest["loader"], dict)):
        raise CheckpointFormatError(f"{where}['rest'] should be None or {{'source': ..., 'loader': <a loader state>}}")
    return ReshardedState(
        rank=rank, world_size=size, loaders=tuple(loaders),
        rest=None if rest is None else Rest(rest["source"], rest["loader"]),
    )


def loader_state_as_json(state: dict[str, Any]) -> str:
    """A loader state as the JSON text the DCP leaf and the per-process files hold."""
    return json.dumps(state)


def loader_state_from_json(text: Any, where: str, writer: str) -> dict[str, Any]:
    """The loader state that ``writer`` stored in ``where`` as JSON text (what
    :func:`loader_state_as_json` made); :class:`CheckpointFormatError` naming both
    when it is not text, not JSON, or not a dict."""
    if not isinstance(text, str):
        raise CheckpointFormatError(
            f"{where} should be the loader state as a JSON string (written by {writer}), got {type(text).__name__}"
        )
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointFormatError(
            f"{where} is not valid JSON ({str(exc)[:100]}); the checkpoint is damaged or was not written by {writer}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointFormatError(f"{where} holds a {type(state).__name__}, not a loader state (written by {writer})")
    return state
