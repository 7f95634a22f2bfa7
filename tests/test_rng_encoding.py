"""Twist codes (``_rng/twist.py``): a worker's RNG states stored as where they are on
their seed's path. Round trips are exact for every twist count and position tried,
with gaussian caches set; states off the path or beyond the bound stay raw and exact;
a resume through a JSON checkpoint is exact; a crafted code is refused."""

from __future__ import annotations

import base64
import json
import random
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
from snaploader._workers.runtime import seed_like_torch

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


@pytest.fixture(autouse=True)
def _new_paths() -> None:
    _rngcode._paths.clear()  # only states after the last one found are looked for


@pytest.fixture
def seed() -> Iterator[bytes]:
    with _saved_rngs():
        yield _seeded()


def _round_trip(seed: bytes) -> bytes:
    """The current states' code, after checking it expands to the raw capture."""
    raw = capture_rng(seed)
    coded = _rngcode.compact(raw, BASE, WORKER)
    check_rng(coded, seeded=True)
    assert _rngcode.expand(coded, _parts(seed)) == raw
    return coded


def _parts(seed: bytes) -> tuple[bytes, bytes, bytes]:
    from snaploader._rng.capture import _seed_parts

    return _seed_parts(seed)


def test_the_seed_state_is_computed_as_a_worker_captures_it(seed: bytes) -> None:
    assert b"".join(_rngcode.seed_state(BASE, WORKER)) == seed[1:]


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
    _rngcode._paths.clear()  # each example starts a new path: only later states are looked for
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


def test_a_state_off_the_seeds_path_stays_raw_and_exact(seed: bytes) -> None:
    np.random.seed(5)  # a worker_init_fn that reseeds NumPy
    np.random.random_sample(10)
    random.random()
    coded = _round_trip(seed)
    assert coded[0] == 0b1000 | 0b100, "Python coded, NumPy raw, torch at its seed"


def test_a_state_beyond_the_bound_stays_raw_and_exact(seed: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rngcode, "MAX_TWISTS", 8)
    monkeypatch.setattr(_rngcode, "_paths", type(_rngcode._paths)())
    torch.rand(624 * 4)  # 4 twists: coded
    assert _round_trip(seed)[0] & 0b100000
    torch.rand(624 * 10)  # 14: raw
    assert not _round_trip(seed)[0] & 0b100000
    torch.rand(1)
    assert not _round_trip(seed)[0] & 0b100000


def test_a_code_for_another_seed_state_is_an_error(seed: bytes) -> None:
    random.random()
    coded = _rngcode.compact(capture_rng(seed), BASE, WORKER)
    other = _rngcode.seed_state(BASE, WORKER + 1)
    with pytest.raises(ValueError, match="seed state other than this worker's"):
        _rngcode.expand(coded, other)


def _loader(workers: int) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        Augmented(48), batch_size=3, shuffle=True, num_workers=workers, generator=generator(7)
    )


def _coded_flags(state: dict[str, Any]) -> list[int]:
    return [base64.b64decode(w["yielded"]["rng"])[0] for w in state["workers"] if w["yielded"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_through_json_is_exact(workers: int, mp_helpers: None) -> None:  # noqa: F811
    expected = list(_loader(workers))
    loader = _loader(workers)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    assert _coded_flags(state) and all(flags == 0b111000 for flags in _coded_flags(state))
    resumed = _loader(workers)
    resumed.load_state_dict(state)
    assert_same_stream(head + list(resumed), expected)


def _with_python_twists(twists: Callable[[int], int]) -> dict[str, Any]:
    """A re-signed checkpoint whose worker 0 has its Python state's k (``twists`` of
    the true one) edited."""
    loader = _loader(2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    blob = bytearray(base64.b64decode(state["workers"][0]["yielded"]["rng"]))
    assert blob[0] & 0b1000
    blob[1:5] = twists(int.from_bytes(blob[1:5], "little")).to_bytes(4, "little")
    state["workers"][0]["yielded"]["rng"] = base64.b64encode(bytes(blob)).decode()
    state["digest"] = resign(state)["digest"]
    return state


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
