"""One state per position: a loader's ``state_dict()`` is a function of its position and
its arguments, the same dict (and the same bytes through ``torch.save`` and ``json``)
whether the position was reached fresh, resumed once or resumed twice, whatever the
prefetch timing (NOTE [ one state per position ] in _format/checkpoint.py).

torchdata's own check of this (``test_fast_state_dict_request_skip_steps``: 4 persistent
workers, ``snapshot_every_n_steps=17``, cut at 19, the state two batches after the resume
compared with the uninterrupted run's) is the first case below."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snaploader

from ._datasets import Augmented
from ._iterable_datasets import DatasetStateStream, IteratorStateStream, PlainStream
from ._support import generator

_DATASETS = {
    "map": lambda: Augmented(20),
    "iterator": lambda: IteratorStateStream(40),
    "dataset": lambda: DatasetStateStream(40),
    "plain": lambda: PlainStream(40),
}


def _loader(kind: str, workers: int, persistent: bool, every: int) -> snaploader.DataLoader[Any]:
    kwargs: dict[str, Any] = dict(num_workers=workers, persistent_workers=persistent, generator=generator(3))
    if kind == "map":
        return snaploader.DataLoader(_DATASETS[kind](), batch_size=2, shuffle=True, **kwargs)
    return snaploader.DataLoader(_DATASETS[kind](), batch_size=2, snapshot_every=every, replay="allow", **kwargs)


def _states(loader: snaploader.DataLoader[Any], at: int, until: int) -> dict[int, dict[str, Any]]:
    """The loader's state at every position from ``at`` (where it stands, counted over
    epochs: each yielded batch and each epoch end is one position) to ``until``."""
    got = {at: loader.state_dict()}
    while at < until:
        for _ in loader:
            at += 1
            got[at] = loader.state_dict()
            if at >= until:
                return got
        at += 1
        got[at] = loader.state_dict()
    return got


def _bytes(state: dict[str, Any]) -> tuple[bytes, str]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue(), json.dumps(state)


def _check_chain(kind: str, workers: int, persistent: bool, every: int, cuts: list[int], total: int) -> None:
    fresh = _states(_loader(kind, workers, persistent, every), 0, total)
    at, resumed = 0, fresh[0]
    for cut in [*cuts, total]:
        loader = _loader(kind, workers, persistent, every)
        try:
            loader.load_state_dict(resumed)
            got = _states(loader, at, cut)
        finally:
            del loader  # persistent workers end with it, a failed check's too
        for position, state in got.items():
            assert state == fresh[position], f"{kind}: state at position {position} after resuming at {at} (cuts {cuts})"
            assert _bytes(state) == _bytes(fresh[position]), f"{kind}: bytes at position {position}"
        at, resumed = cut, got[cut]


def _total(kind: str) -> int:
    # two epochs: each yields its batches, then ends (one more position)
    return 2 * ((10 if kind == "map" else 20) + 1)


def test_torchdatas_skip_steps_case() -> None:
    # 4 persistent workers, a state every 17 batches, cut at 19, compared 2 batches on.
    kwargs: dict[str, Any] = dict(num_workers=4, persistent_workers=True, snapshot_every_n_steps=17)
    make = lambda: snaploader.DataLoader(IteratorStateStream(200), batch_size=1, **kwargs)  # noqa: E731
    loader = make()
    iterator = iter(loader)
    for _ in range(19):
        next(iterator)
    state = loader.state_dict()
    for _ in range(2):
        next(iterator)
    expected = loader.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    for _ in range(2):
        next(iterator)
    assert resumed.state_dict() == expected
    del iterator


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
@pytest.mark.parametrize("kind,every", [("map", 1), ("iterator", 3), ("dataset", 2), ("plain", 1)])
def test_resumed_once_and_twice_give_the_fresh_runs_states(kind: str, every: int, workers: int, persistent: bool) -> None:
    total = _total(kind)
    # cuts mid-epoch, at an epoch's end and right after it, and across the epoch
    # boundary; an iterable's at a complete snapshot (6: every 2 or 3 batches), resumed
    # past later incomplete ones
    half = total // 2
    cuts = [6, half - 2, half, half + 3] + ([30] if total > 31 else [])
    _check_chain(kind, workers, persistent, every, cuts, total)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(sorted(_DATASETS)),
    workers=st.sampled_from([0, 2]),
    persistent=st.booleans(),
    every=st.integers(1, 4),
    data=st.data(),
)
def test_any_cut_points(kind: str, workers: int, persistent: bool, every: int, data: st.DataObject) -> None:
    total = _total(kind)
    cuts = sorted(data.draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=2, unique=True), label="cuts"))
    _check_chain(kind, workers, persistent and workers > 0, every, cuts, total)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaded_state_comes_back_as_this_version_writes_it(workers: int) -> None:
    # A key that is not snaploader's: the state read back before iter() is the one a
    # fresh loader at that position gives.
    loader = _loader("iterator", workers, False, 3)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    state = loader.state_dict()
    del iterator
    edited = {**state, "_iterator_finished": False}
    again = _loader("iterator", workers, False, 3)
    again.load_state_dict(edited)
    assert again.state_dict() == state
