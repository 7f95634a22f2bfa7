"""_rng/capture.py and _rng/raw.py: the RNG states a worker resumes from, encoded as
bytes; _format/plain.py: the check that a dataset's state is plain checkpoint data."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import snaploader
from snaploader import StateNotPlainDataError
from snaploader._rng import capture as _rng, raw as snapshot
from snaploader._format.plain import check_plain, decode, encode
from snaploader._rng.capture import capture_rng, restore_rng
from snaploader._rng.raw import RAW_RNG_ACCESS

from ._datasets import Range


def _draws() -> list[Any]:
    """Draws that read every part of the three states, cached gaussians included."""
    return [
        random.random(),
        random.gauss(0.0, 1.0),
        random.getrandbits(70),
        float(np.random.random_sample()),
        float(np.random.standard_normal()),
        np.random.randint(0, 2**31, size=3).tolist(),
        torch.rand(4).tolist(),
        torch.randn(3).tolist(),
    ]


def _np_state() -> Any:
    return np.random.get_state(legacy=True)


def _public_state() -> tuple[Any, ...]:
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = _np_state()
    return py, (kind, keys.tolist(), pos, has_gauss, gauss), torch.get_rng_state().tolist()


pytestmark = pytest.mark.usefixtures("keep_global_rngs")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), warmup=st.integers(0, 5), gauss_first=st.booleans())
def test_capture_restore_round_trip(seed: int, warmup: int, gauss_first: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    for _ in range(warmup):
        _draws()
    if gauss_first:  # leave a cached second gaussian in random and in NumPy
        random.gauss(0.0, 1.0)
        np.random.standard_normal()
    public = _public_state()
    blob = capture_rng()
    first = _draws()
    restore_rng(blob)
    assert _public_state() == public
    assert _draws() == first
    restore_rng(blob)
    assert capture_rng() == blob


_ONE_DRAW = {
    "python": lambda: random.random(),
    "python_gauss": lambda: random.gauss(0.0, 1.0),
    "numpy": lambda: np.random.random_sample(),
    "numpy_gauss": lambda: np.random.standard_normal(),
    "torch": lambda: torch.rand(1),
    "torch_gauss": lambda: torch.randn(1),
}


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.one_of(st.sets(st.sampled_from(sorted(_ONE_DRAW))), st.integers(0, 20)), min_size=1, max_size=12
    ),
    relative=st.booleans(),
)
def test_captures_between_partial_changes_restore_exactly(steps: list[Any], relative: bool) -> None:
    # capture_rng reuses what it encoded last for the states that did not change
    # (NOTE [ capture only what changed ]): after any mix of draws from some of the
    # generators, or a return to an earlier state, each capture must still be the state
    # it was taken in, and equal the capture of that state by a fresh encoding.
    random.seed(4)
    np.random.seed(4)
    torch.manual_seed(4)
    seed = capture_rng() if relative else None
    taken: list[tuple[bytes, tuple[Any, ...]]] = []
    for step in steps:
        if isinstance(step, int):  # back to a state captured before
            if taken:
                restore_rng(taken[step % len(taken)][0], seed)
        else:
            for name in sorted(step):
                _ONE_DRAW[name]()
        taken.append((capture_rng(seed), _public_state()))
    for blob, public in taken:
        _draws()
        restore_rng(blob, seed)
        assert _public_state() == public
        fresh = _rng.NativeRng(
            snapshot._PyRandomSlow(random._inst).read(),  # type: ignore[attr-defined]
            snapshot._NumpySlow(np.random.mtrand._rand).read(),
            torch.get_rng_state().clone(),
            seed,
        )
        _rng._last_torch = (b"", b"")  # forget what was encoded last
        _rng._last_encoding = (None, b"", b"", b"", b"")
        assert fresh.encode() == blob


def test_restore_sets_and_clears_the_cached_gaussians() -> None:
    random.seed(3)
    np.random.seed(3)
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    with_cache = capture_rng()
    assert random.getstate()[2] is not None and _np_state()[3] == 1
    cached = random.gauss(0.0, 1.0), float(np.random.standard_normal())
    without_cache = capture_rng()  # both caches were just consumed
    assert random.getstate()[2] is None and _np_state()[3] == 0

    restore_rng(with_cache)
    assert (random.gauss(0.0, 1.0), float(np.random.standard_normal())) == cached

    random.gauss(0.0, 1.0)  # fills the caches again
    np.random.standard_normal()
    restore_rng(without_cache)
    assert random.getstate()[2] is None and _np_state()[3] == 0


def test_raw_access_is_active_and_agrees_with_the_public_api() -> None:
    # NOTE [ raw RNG access ] in snapshot.py: on CPython with this NumPy the fast
    # path must be the one in use, and read and write what the public API does.
    assert RAW_RNG_ACCESS
    assert isinstance(snapshot._python_rng, snapshot._PyRandomRaw)
    assert isinstance(snapshot._numpy_rng, snapshot._NumpyRaw)
    slow_py = snapshot._PyRandomSlow(random._inst)  # type: ignore[attr-defined]
    slow_np = snapshot._NumpySlow(np.random.mtrand._rand)
    for seed in range(3):
        random.seed(seed)
        np.random.seed(seed)
        for _ in range(seed):
            random.gauss(0.0, 1.0)
            np.random.standard_normal()
        assert snapshot._python_rng.read() == slow_py.read()
        assert snapshot._numpy_rng.read() == slow_np.read()
        py_blob, np_blob = slow_py.read(), slow_np.read()
        _draws()
        snapshot._python_rng.write(py_blob)
        snapshot._numpy_rng.write(np_blob)
        assert slow_py.read() == py_blob and slow_np.read() == np_blob


def test_capture_is_compact_bytes() -> None:
    blob = capture_rng()
    assert isinstance(blob, bytes)
    # three Mersenne Twister states: 2 x ~2.5 KB (Python, NumPy) + torch's ~5 KB
    assert len(blob) <= 12 * 1024


def test_user_state_round_trips_exactly_through_json() -> None:
    # What a dataset's state_dict() returns comes back from a JSON-safe checkpoint as
    # it was returned: tuples stay tuples, bytes stay bytes, int keys stay ints.
    state = {
        "pos": 3,
        "t": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "empty": torch.empty(0, 2),
        "raw": b"\x00\xffab",
        "pair": (1, (2.5, None)),
        5: {"nested": [True, "s"]},
        "__snaploader__": "a user key that looks like the tag",
    }
    check_plain(state, "state")
    encoded = encode(state)
    back = decode(json.loads(json.dumps(encoded)), "state")
    assert set(back) == set(state) and back[5] == state[5] and back["pair"] == state["pair"]
    assert back["raw"] == state["raw"] and back["__snaploader__"] == state["__snaploader__"]
    for key in ("t", "empty"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])


def test_check_plain_accepts_plain_data() -> None:
    check_plain(
        {"a": [1, 2.5, True, None, "s", b"b", (3, 4)], 5: {"t": torch.zeros(2)}, "empty": {}},
        "state",
    )


def test_check_plain_names_the_key_path_and_type() -> None:
    for value, path, type_name in [
        ({"a": [1, {"b": np.int64(3)}]}, "state['a'][1]['b']", "numpy.int64"),
        ({"x": np.zeros(2)}, "state['x']", "numpy.ndarray"),
        ([{"g": np.random.default_rng(0)}], "state[0]['g']", "numpy.random._generator.Generator"),
        ({"s": {1, 2}}, "state['s']", "builtins.set"),
        ({"nested": {(1, 2): 3}}, "state['nested']", "tuple"),
    ]:
        with pytest.raises(StateNotPlainDataError) as info:
            check_plain(value, "state")
        message = str(info.value)
        assert path in message and type_name in message, message


class _NumpyStateRange(Range):
    """A dataset whose state_dict() holds a NumPy array (not plain data)."""

    def state_dict(self) -> dict[str, Any]:
        return {"order": np.arange(3)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dataset_state_not_plain_reaches_the_user(num_workers: int) -> None:
    # Whether the dataset runs in the main process or in a worker, the user sees the
    # StateNotPlainDataError naming the key, not a crash of the worker.
    loader = snaploader.DataLoader(
        _NumpyStateRange(6), batch_size=2, num_workers=num_workers, max_worker_retries=0
    )
    with pytest.raises(StateNotPlainDataError, match=r"\['order'\].*numpy\.ndarray"):
        list(loader)
