"""A worker's RNG states in a checkpoint: written raw, as the worker captured them
(NOTE [ raw RNG states ] in ``_format/build.py``), and read either raw or as the twist
codes of older checkpoints (``_rng/twist.py``: where a state is on its seed's path).
Codes expand exactly for every twist count and position tried, with gaussian caches
set; a resume through a JSON checkpoint is exact, from raw states and from the same
checkpoint written with codes; a crafted code is refused."""

from __future__ import annotations

import base64
import json
import random
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import snaploader
from snaploader._format.checkpoint import resign
from snaploader._rng import twist as _rngcode
from snaploader._rng.capture import capture_rng, check_rng
from snaploader._workers.logical_worker import seed_like_torch

from ._datasets import Augmented
from ._support import assert_same_stream, generator, mp_helpers  # noqa: F401

BASE, WORKER = 2**40 + 17, 3


def _seeded() -> bytes:
    seed_like_torch(BASE, WORKER)
    return capture_rng()


@contextmanager
def _saved_rngs() -> Iterator[None]:
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


@pytest.fixture
def seed() -> Iterator[bytes]:
    with _saved_rngs():
        yield _seeded()


def _parts(seed: bytes) -> tuple[bytes, bytes, bytes]:
    from snaploader._rng.capture import _seed_parts

    return _seed_parts(seed)


_MAX_SEARCH = 4096  # twists; the draws of these tests stay well within


def _twists_to(seed_part: bytes, part: int, words: bytes) -> int | None:
    """How many twists from ``seed_part``'s words ``words`` are, if within _MAX_SEARCH."""
    generator = _rngcode._twister(_rngcode._words(seed_part, part))
    for twists in range(1, _MAX_SEARCH + 1):
        generator.random_raw(624, output=False)
        if generator.state["state"]["key"].astype("<u4").tobytes() == words:
            return twists
    return None


def _coded(blob: bytes, seed: bytes) -> bytes:
    """``blob`` as a checkpoint written before states were stored raw holds it: each
    moved state found on its seed's path as a twist code (the layout in _rng/twist.py)."""
    seed_parts = _parts(seed)
    parts = _rngcode._parts(blob, seed_parts)
    flags, kept = blob[0], []
    for part in range(3):
        if flags & (1 << part):
            continue
        raw = parts[part]
        at = _rngcode._WORDS_AT[part]
        words = raw[at : at + _rngcode._WORDS_BYTES]
        twists = _twists_to(seed_parts[part], part, words) if _rngcode._codable(part) else None
        if twists is None:
            kept.append(raw)
            continue
        flags |= 1 << (_rngcode._CODED_SHIFT + part)
        kept.append(_rngcode._HEAD.pack(twists, zlib.crc32(words)) + raw[:at] + raw[at + _rngcode._WORDS_BYTES :])
    return bytes((flags,)) + b"".join(kept)


def _round_trip(seed: bytes) -> bytes:
    """The current states' code, after checking it expands to the raw capture."""
    raw = capture_rng(seed)
    coded = _coded(raw, seed)
    check_rng(coded, seeded=True)
    assert _rngcode.expand(coded, _parts(seed)) == raw
    return coded


def test_every_position_of_the_first_blocks_round_trips(seed: bytes) -> None:
    for _ in range(3 * 624 + 5):
        random.getrandbits(32)
        np.random.randint(0, 2**31)
        torch.randint(0, 2**31, ())
        coded = _round_trip(seed)
        assert coded[0] == 0b111000, "all three should be coded, none raw"
        assert len(coded) < 120


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 200_000),
    st.integers(0, 200_000),
    st.integers(0, 200_000),
    st.booleans(),
)
def test_many_twists_and_gaussian_caches_round_trip(py: int, npy: int, tch: int, gauss: bool) -> None:
    with _saved_rngs():
        _many_twists(py, npy, tch, gauss)


def _many_twists(py: int, npy: int, tch: int, gauss: bool) -> None:
    seed = _seeded()
    for _ in range(py // 1000):
        random.getrandbits(32)
    random.getrandbits(32 * (py % 1000 + 1))  # one draw of many words
    np.random.randint(0, 2**32, size=npy, dtype=np.uint64)
    torch.rand(tch)
    if gauss:  # leaves a cached second gaussian in Python's and NumPy's, and torch's
        random.gauss(0.0, 1.0)
        np.random.standard_normal()
        torch.randn(1)
    flags = _round_trip(seed)[0]
    assert (flags | flags >> 3) & 0b111 == 0b111, f"a moved state stayed raw: flags {flags:#b}"


def test_a_code_for_another_seed_state_is_an_error(seed: bytes) -> None:
    random.random()
    coded = _coded(capture_rng(seed), seed)
    assert coded[0] & 0b1000
    seed_like_torch(BASE, WORKER + 1)
    other = _parts(capture_rng())
    with pytest.raises(ValueError, match="seed state other than this worker's"):
        _rngcode.expand(coded, other)


def _loader(workers: int) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        Augmented(48), batch_size=3, shuffle=True, num_workers=workers, generator=generator(7)
    )


def _rng_flags(state: dict[str, Any]) -> list[int]:
    return [base64.b64decode(w["yielded"]["rng"])[0] for w in state["workers"] if w["yielded"]]


def _as_older_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its workers' RNG states written as twist codes, as checkpoints were
    before states were stored raw, and re-signed."""
    state = json.loads(json.dumps(state))
    for w, ledger in enumerate(state["workers"]):
        with _saved_rngs():
            seed_like_torch(state["base_seed"], w)
            seed = capture_rng()
        for snapshot in (ledger[key] for key in ("epoch_start", "yielded", "yielded_complete")):
            if isinstance(snapshot, dict):
                snapshot["rng"] = base64.b64encode(_coded(base64.b64decode(snapshot["rng"]), seed)).decode()
    return resign(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_json_is_exact_from_raw_states_and_from_codes(workers: int, mp_helpers: None) -> None:  # noqa: F811
    expected = list(_loader(workers))
    loader = _loader(workers)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    # every worker moved all three generators, and they are stored as captured
    assert _rng_flags(state) and all(flags == 0 for flags in _rng_flags(state))
    older = _as_older_checkpoint(state)
    assert all(flags == 0b111000 for flags in _rng_flags(older))
    for checkpoint in (state, older):
        resumed = _loader(workers)
        resumed.load_state_dict(checkpoint)
        assert_same_stream(head + list(resumed), expected)


def _with_python_twists(twists: Callable[[int], int]) -> dict[str, Any]:
    """A re-signed older checkpoint (twist codes) whose worker 0 has its Python state's
    k (``twists`` of the true one) edited."""
    loader = _loader(2)
    iterator = iter(loader)
    next(iterator)
    state = _as_older_checkpoint(loader.state_dict())
    del iterator
    blob = bytearray(base64.b64decode(state["workers"][0]["yielded"]["rng"]))
    assert blob[0] & 0b1000
    blob[1:5] = twists(int.from_bytes(blob[1:5], "little")).to_bytes(4, "little")
    state["workers"][0]["yielded"]["rng"] = base64.b64encode(bytes(blob)).decode()
    return resign(state)


def test_a_twist_count_beyond_the_bound_is_refused(mp_helpers: None) -> None:  # noqa: F811
    state = _with_python_twists(lambda _: _rngcode.MAX_TWISTS + 1)
    with pytest.raises(snaploader.CheckpointFormatError, match=r"\['rng'\].*twists from the seed state"):
        _loader(2).load_state_dict(state)


def test_a_code_edited_within_the_bound_is_refused_by_load_state_dict(mp_helpers: None) -> None:  # noqa: F811
    # one twist further: well-formed, but not the state the worker had; the codes are
    # replayed in load_state_dict, so the refusal comes there, naming the key path
    state = _with_python_twists(lambda k: k + 1)
    resumed = _loader(2)
    with pytest.raises(snaploader.CheckpointFormatError, match=r"\['workers'\]\[0\]\['yielded'\]\['rng'\].*seed state other"):
        resumed.load_state_dict(state)
