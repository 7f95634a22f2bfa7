"""_format/envelopes.py: a ReshardedLoader's state and the JSON text of a loader state
are parsed with the loader state's errors. Every edit of a ReshardedLoader's state is
refused, re-signed or not, with a CheckpointFormatError naming the place; text that is
not a loader state's JSON names where it was read and who writes it."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from snaploader import CheckpointFormatError
from snaploader._format.checkpoint import sha256_of
from snaploader._format.envelopes import (
    Rest, is_resharded, loader_state_as_json, loader_state_from_json, parse_resharded, resharded_state,
)

LOADER = {"format": "snaploader", "version": 3, "epoch": 2}  # a loader state's stand-in: parsed when loaded
SOURCE = {"epoch": 1, "consumed": [4, 4]}


def _resigned(state: dict[str, Any]) -> dict[str, Any]:
    body = {key: value for key, value in state.items() if key != "digest"}
    return {**body, "digest": "sha256:" + sha256_of(body)}


def test_a_resharded_state_reads_back_as_written() -> None:
    hosting = resharded_state(1, 3, [LOADER, LOADER], None)
    assert is_resharded(hosting) and not is_resharded(LOADER)
    parsed = parse_resharded(json.loads(json.dumps(hosting)), "here")
    assert (parsed.rank, parsed.world_size, parsed.loaders, parsed.rest) == (1, 3, (LOADER, LOADER), None)
    during = parse_resharded(resharded_state(0, 2, [LOADER], Rest(SOURCE, LOADER)), "here")
    assert during.loaders == () and during.rest == Rest(SOURCE, LOADER)


BAD_VALUES: list[Any] = [None, -1, 2**70, 1.5, "x", [], {}, [1, 2], {"source": 1}, True]


@pytest.mark.parametrize("rest", [None, Rest(SOURCE, LOADER)])
def test_every_edit_of_a_resharded_state_is_a_named_format_error(rest: Rest | None) -> None:
    state = resharded_state(1, 3, [] if rest else [LOADER], rest)
    rng = random.Random(0)
    for key in [k for k in state if k != "digest"] + ["extra"]:
        for value in BAD_VALUES:
            edited = copy.deepcopy(state)
            if edited.get(key) == value:
                continue
            edited[key] = value
            with pytest.raises(CheckpointFormatError, match="modified or corrupted|version|format"):
                parse_resharded(edited, "the state")  # not re-signed: the digest says so
            try:
                parse_resharded(_resigned(edited), "the state")
            except CheckpointFormatError as exc:
                assert str(exc).startswith("the state"), exc
            else:  # a re-signed edit that is still a ReshardedLoader state's
                assert (key, value) == ("world_size", 2**70), (key, value)
    # a digest edited, or deleted
    for digest in ["sha256:" + "0" * 64, None, 7]:
        with pytest.raises(CheckpointFormatError, match="modified or corrupted"):
            parse_resharded({**state, "digest": digest}, "the state")
    deep: Any = LOADER
    for _ in range(rng.randrange(200, 400)):
        deep = [deep]
    with pytest.raises(CheckpointFormatError, match="deep"):
        parse_resharded(_resigned({**state, "loaders": [deep]}), "the state")


@pytest.mark.parametrize(
    "text, says",
    [
        (7, "should be the loader state as a JSON string"),
        (b"{}", "should be the loader state as a JSON string"),
        ("{not json", "is not valid JSON"),
        ("[" * 100_000, "is not valid JSON"),
        ("[1, 2]", "holds a list, not a loader state"),
    ],
)
def test_text_that_is_not_a_loader_states_json_names_the_place_and_the_writer(text: Any, says: str) -> None:
    with pytest.raises(CheckpointFormatError, match=says) as raised:
        loader_state_from_json(text, "the file f.json", "the writer")
    assert str(raised.value).startswith("the file f.json") and "the writer" in str(raised.value)
    assert loader_state_from_json(loader_state_as_json(LOADER), "f", "w") == LOADER
