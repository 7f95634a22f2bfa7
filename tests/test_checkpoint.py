"""The checkpoint as untrusted input, and as plain data: fuzzed real states from every
kind of loader either fail with a named error or resume the same stream; states are
JSON-safe; state_dict() taken from another thread is always one that resumes exactly."""

from __future__ import annotations

import io
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import RandomSampler, default_collate

import snaploader
from snaploader._format import checkpoint as _checkpoint
from snaploader._format.checkpoint import _canonical, joined, piece, resign

from ._datasets import Augmented, StatefulSampler
from ._fuzz import CONFIGS, Case, assert_resumes, build_case, check_integers, check_one
from ._support import assert_same_stream, epochs, generator, mp_helpers, states_meanwhile, through_bytes  # noqa: F401

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
    # three raw states (NOTE [ raw RNG states ]: 7.5 KB, 10 KB in base64), and no
    # epoch-start copy
    assert max(per_worker) < 10_500, per_worker
    assert all(ledger["epoch_start"] is None for ledger in state["workers"])
    saved = io.BytesIO()
    torch.save(state, saved)
    assert saved.tell() <= 100 * 1024, "the size docs/performance.md promises at 8 workers"


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
    with states_meanwhile(loader) as taken:
        got = list(loader)
    assert_same_stream(got, expected)
    # every distinct position sampled resumes the rest of the epoch exactly
    by_position = {(s["epoch"], s["yielded"], s["ended"]): s for s in taken if s["epoch"] == 0}
    assert len(by_position) > 3, sorted(by_position)
    for (_, yielded, ended), state in sorted(by_position.items()):
        resumed = make()
        resumed.load_state_dict(state)
        rest = [] if ended else list(resumed)
        assert_same_stream(rest, expected[yielded:], f"resumed at {yielded}")


class _PausingShuffle(RandomSampler):
    """A RandomSampler that calls ``pause`` before drawing its permutation: iter() is
    then between the base seed's draw and the permutation's while it runs."""

    def __init__(self, dataset: Augmented, source: torch.Generator, pause: Callable[[], None]) -> None:
        super().__init__(dataset, generator=source)
        self.pause = pause

    def __iter__(self) -> Iterator[int]:
        self.pause()
        yield from super().__iter__()


def _boundary_loader(
    num_workers: int, persistent: bool, seed: int, pause: Callable[[], None] = lambda: None
) -> snaploader.DataLoader:
    dataset = Augmented(8)
    source = generator(seed)
    return snaploader.DataLoader(
        dataset, batch_size=2, sampler=_PausingShuffle(dataset, source, pause), num_workers=num_workers,
        persistent_workers=persistent, generator=source,
    )


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_state_dict_from_another_thread_at_epoch_starts_resumes_exactly(
    num_workers: int, persistent: bool
) -> None:
    # NOTE [ epoch start ]: while iter() draws the next epoch's base seed and
    # permutation, the state says "epoch ended" and must carry the generator's state
    # from before those draws, never after some of them.
    expected = epochs(_boundary_loader(num_workers, persistent, 1), 4)
    taken: dict[tuple[Any, ...], dict[str, Any]] = {}
    stop, last_end, took = threading.Event(), threading.Event(), threading.Event()

    def pause() -> None:
        for _ in range(2):  # the second state is read wholly after the base seed's draw
            took.clear()
            took.wait(5.0)

    loader = _boundary_loader(num_workers, persistent, 1, pause)

    def hammer() -> None:
        while not stop.is_set():
            state = loader.state_dict()
            # one state per position (not per digest: the self-check's digests change too)
            taken.setdefault((state["epoch"], state["ended"], state["yielded"], state["rng_next"]), state)
            took.set()
            if state["epoch"] == 2 and state["ended"]:
                last_end.set()

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        got = epochs(loader, 3)
        last_end.wait(5.0)
    finally:
        stop.set()
        thread.join()
    assert_same_stream(sum(got, []), sum(expected[:3], []))
    at_start = [s for s in taken.values() if s["ended"] or s["yielded"] == 0]
    assert {s["epoch"] for s in at_start if s["ended"]} >= {0, 1, 2}, "every boundary should be caught"
    for state in at_start + [s for s in taken.values() if s["yielded"] == 1][:2]:
        epoch = state["epoch"] + 1 if state["ended"] else state["epoch"]
        rest = [] if state["ended"] else expected[epoch][state["yielded"] :]
        resumed = _boundary_loader(num_workers, persistent, 99)  # its own generator is overwritten
        resumed.load_state_dict(state)
        where = f"resumed from epoch {state['epoch']}, {state['yielded']} yielded, ended {state['ended']}"
        got_rest = [] if state["ended"] else list(resumed)
        assert_same_stream(got_rest, rest, where)
        assert_same_stream(list(resumed), expected[epoch + 1] if not state["ended"] else expected[epoch], where + ": next epoch")


def _shuffled(dataset: Any, num_workers: int, seed: int, persistent: bool = False) -> snaploader.DataLoader:
    """A shuffled loader of batch 2 over ``dataset``, its generator seeded with ``seed``."""
    return snaploader.DataLoader(
        dataset, batch_size=2, shuffle=True, num_workers=num_workers, generator=generator(seed),
        persistent_workers=persistent,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_returned_state_never_changes_and_shares_nothing(num_workers: int) -> None:
    # An async checkpoint writer reads the state while the loop goes on (docs/dcp.md).
    loader = _shuffled(Augmented(12), num_workers, 3, persistent=num_workers > 0)
    iterator = iter(loader)
    next(iterator)
    states = [loader.state_dict()]
    next(iterator)
    states.append(loader.state_dict())
    as_taken = [json.dumps(state) for state in states]
    list(iterator)
    states.append(loader.state_dict())  # the epoch ended
    as_taken.append(json.dumps(states[-1]))
    list(loader)
    assert [json.dumps(state) for state in states] == as_taken
    loaded = _shuffled(Augmented(12), num_workers, 3, persistent=num_workers > 0)
    loaded.load_state_dict(states[1])
    # editing what was given or returned changes nothing the loader holds
    states[1]["workers"][0]["yielded"]["produced"] = 99
    loaded.state_dict()["workers"][0]["yielded"]["produced"] = 98
    assert json.dumps(loaded.state_dict()) == as_taken[1]


class _NestedState(torch.utils.data.Dataset[torch.Tensor]):
    """Draws from the worker's RNGs, and has its own state of every kind a user's
    state_dict() may hold (nested, floats, non-ASCII text, bytes, a tuple, int keys)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.seen.append(index)
        return torch.rand(2) + index

    def state_dict(self) -> dict[str, Any]:
        return {"seen": list(self.seen), "mean": sum(self.seen) / max(1, len(self.seen)) + 0.1,
                "name": "caf\u00e9 \u2603", "raw": b"\x00\xff", "pair": (1, "a"), "by_index": {3: [-0.0, 1e300]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = list(state["seen"])


def _states_of_every_shape(num_workers: int) -> list[dict[str, Any]]:
    """States before any epoch, mid-epoch, at an epoch's end and loaded, from a loader
    whose dataset and sampler have states of their own."""
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(
            _NestedState(12), batch_size=2, sampler=StatefulSampler(12, 5), num_workers=num_workers,
            generator=generator(4), persistent_workers=num_workers > 0,
        )

    loader = make()
    states = [loader.state_dict()]
    iterator = iter(loader)
    next(iterator)
    states.append(loader.state_dict())
    next(iterator)
    states.append(loader.state_dict())
    list(iterator)
    states.append(loader.state_dict())
    loaded = make()
    loaded.load_state_dict(states[2])
    states.append(loaded.state_dict())
    return states


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_digest_state_dict_writes_is_the_one_a_load_checks(num_workers: int) -> None:
    # state_dict() joins the digest from pieces (NOTE [ canonical pieces ]); a load, and
    # resign(), compute it with json.dumps over the whole state: they must agree
    # whatever the state holds.
    for state in _states_of_every_shape(num_workers):
        assert state["digest"] == _checkpoint.resign(state)["digest"], (state["epoch"], state["yielded"])


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=_JSON_VALUES)
def test_a_piece_is_the_canonical_json_a_load_hashes(value: Any) -> None:
    assert piece(value).encode() == _canonical(value)
    if isinstance(value, dict):
        assert joined({key: piece(item) for key, item in value.items()}).encode() == _canonical(value)


def _changed_base64(text: str) -> str:
    """``text`` with one character changed to another base64 character: still a
    well-formed blob, another state."""
    at = len(text) // 2
    return text[:at] + ("A" if text[at] != "A" else "B") + text[at + 1:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_corrupted_blob_is_caught_by_the_digest(num_workers: int) -> None:
    loader = _shuffled(Augmented(12), num_workers, 3)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    state = loader.state_dict()
    del iterator
    corruptions: list[Callable[[dict[str, Any]], None]] = [
        lambda s: s["workers"][0]["yielded"].update(rng=_changed_base64(s["workers"][0]["yielded"]["rng"])),
        lambda s: s.update(rng_start=_changed_base64(s["rng_start"])),
    ]
    for corrupt in corruptions:
        bad = json.loads(json.dumps(state))
        corrupt(bad)
        assert bad != state
        fresh = _shuffled(Augmented(12), num_workers, 3)
        with pytest.raises(snaploader.CheckpointFormatError, match=r"\['digest'\].*modified"):
            fresh.load_state_dict(bad)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_editing_a_returned_state_changes_nothing_the_loader_returns_next(num_workers: int) -> None:
    # The state is copied out of what the loader keeps (each snapshot made plain once);
    # the copy must go as deep as the user's own state.
    loader = _shuffled(_NestedState(12), num_workers, 4, persistent=num_workers > 0)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    first = loader.state_dict()
    as_taken = json.dumps(first)
    first["workers"][0]["yielded"]["data"]["seen"].append(99)
    first["workers"][0]["yielded"]["data"]["mean"] = 0.0
    first["workers"][0]["yielded"]["rng"] = "edited"
    first["workers"][0]["skipped"] = 5
    first["fingerprint"]["batch_size"] = 7
    first["next_batches"].append(None)
    first["workers"].pop()
    assert json.dumps(loader.state_dict()) == as_taken
    del iterator


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_integer_field_huge_or_negative_is_refused_at_load(name: str, mp_helpers: None) -> None:  # noqa: F811
    # A re-signed sampler_epoch = 2**70 reached torch's DistributedSampler at the first
    # next() (OverflowError); every integer must be bounded by what torch and NumPy take.
    results = check_integers(_case(name))
    assert results
    bad = [f"{what}: {result}" for result, what in results if result not in ("clear", "identical")]
    assert not bad, "\n".join(bad)


def test_a_re_signed_huge_sampler_epoch_names_the_field() -> None:
    sampler = torch.utils.data.DistributedSampler(Augmented(8), num_replicas=2, rank=0, seed=5)
    loader = snaploader.DataLoader(Augmented(8), batch_size=2, sampler=sampler)
    iterator = iter(loader)
    next(iterator)
    state = resign({**loader.state_dict(), "sampler_epoch": 2**70})
    del iterator
    again = snaploader.DataLoader(Augmented(8), batch_size=2, sampler=torch.utils.data.DistributedSampler(Augmented(8), num_replicas=2, rank=0, seed=5))
    with pytest.raises(snaploader.CheckpointFormatError, match=r"loader state\['sampler_epoch'\]"):
        again.load_state_dict(state)
    # and within int64, the sampler's seed plus it must be a seed too
    state = resign({**state, "sampler_epoch": 2**63 - 3})
    with pytest.raises(snaploader.CheckpointFormatError, match=r"loader state\['sampler_epoch'\]"):
        again.load_state_dict(state)
