"""The checkpoint as untrusted input, and as plain data: fuzzed real states from every
kind of loader either fail with a named error or resume the same stream; states are
JSON-safe; state_dict() taken from another thread is always one that resumes exactly."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

import snaploader

from ._datasets import Augmented
from ._fuzz import CONFIGS, Case, assert_resumes, build_case, check_one
from ._support import assert_same_stream, generator, mp_helpers, through_bytes  # noqa: F401

_CASES: dict[str, Case] = {}


def _case(name: str) -> Case:
    if name not in _CASES:
        _CASES[name] = build_case(name)
    return _CASES[name]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_mutated_checkpoint_fails_clearly_or_resumes_the_same_stream(
    name: str, seed: int, mp_helpers: None  # noqa: F811
) -> None:
    result, what = check_one(_case(name), random.Random(seed))
    assert result in ("clear", "identical"), f"{name}: {what}: {result}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_is_json_safe_and_survives_json_and_weights_only(name: str, mp_helpers: None) -> None:  # noqa: F811
    case = _case(name)
    state = case.state
    text = json.dumps(state)
    assert json.loads(text) == state
    for copy in (json.loads(text), through_bytes(state)):
        loader = case.make()
        loader.load_state_dict(copy)
        assert_resumes(case, [list(loader), list(loader)])


def test_checkpoint_size_at_eight_workers_with_persistent_workers() -> None:
    # Every worker has drawn from all three global RNGs (the worst case), mid-way through
    # an epoch after the first: each ledger holds one snapshot, not two.
    loader = snaploader.DataLoader(
        Augmented(64), batch_size=2, num_workers=8, persistent_workers=True, generator=generator(0)
    )
    list(loader)
    iterator = iter(loader)
    for _ in range(12):
        next(iterator)
    state = loader.state_dict()
    per_worker = [len(json.dumps(ledger)) for ledger in state["workers"]]
    del iterator
    # three twist codes (_rng/twist.py), not three 2.5 KB states, and no epoch-start copy
    assert max(per_worker) < 600, per_worker
    assert all(ledger["epoch_start"] is None for ledger in state["workers"])
    assert len(json.dumps(state)) < 64 * 1024 / 8


def _slow_collate(batch: list[Any]) -> Any:
    time.sleep(0.002)  # lets the other thread run between (and during) batches
    return default_collate(batch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_from_another_thread_always_resumes_exactly(num_workers: int) -> None:
    make = lambda: snaploader.DataLoader(  # noqa: E731
        Augmented(40), batch_size=2, shuffle=True, num_workers=num_workers, generator=generator(1),
        collate_fn=_slow_collate,
    )
    expected = list(make())
    loader = make()
    taken: list[dict[str, Any]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            taken.append(loader.state_dict())

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        got = list(loader)
    finally:
        stop.set()
        thread.join()
    assert_same_stream(got, expected)
    # every distinct position sampled resumes the rest of the epoch exactly
    by_position = {(s["epoch"], s["yielded"], s["ended"]): s for s in taken if s["epoch"] == 0}
    assert len(by_position) > 3, sorted(by_position)
    for (_, yielded, ended), state in sorted(by_position.items()):
        resumed = make()
        resumed.load_state_dict(state)
        rest = [] if ended else list(resumed)
        assert_same_stream(rest, expected[yielded:], f"resumed at {yielded}")
