"""DataLoader.state_dict()/load_state_dict() (_format/build.py, _format/parse.py): plain
data, size, never talking to a worker, validation of malformed checkpoints and
fingerprint checks."""

from __future__ import annotations

import copy
import io
import os
import pickle
import signal
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, RandomSampler

import snaploader
from snaploader._format import checkpoint as _checkpoint
from snaploader import CheckpointFormatError, CheckpointMismatchError
from snaploader._workers.pool import Pool, WorkerProcess

from ._datasets import DrawingRange, Range, Sleepy
from ._support import assert_same_stream, generator, take, through_bytes

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _assert_plain(value: Any, where: str = "state") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{where}: key {key!r}"
            _assert_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _assert_plain(item, f"{where}[{i}]")
    else:
        plain = (int, bool, str, bytes, float, torch.Tensor)
        assert value is None or isinstance(value, plain), f"{where}: {type(value)}"


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_dict_is_plain_data_that_survives_weights_only_load(num_workers: int) -> None:
    loader = snaploader.DataLoader(
        Range(20), batch_size=3, shuffle=True, num_workers=num_workers, generator=generator(0)
    )
    states = [loader.state_dict()]  # before any iteration
    iterator = iter(loader)
    states.append(loader.state_dict())  # started, nothing yielded
    take(iterator, 4)
    states.append(loader.state_dict())  # mid-epoch
    list(iterator)
    states.append(loader.state_dict())  # after the epoch
    for state in states:
        _assert_plain(state)
        loaded = through_bytes(state)
        assert _equal(loaded, state)
        snaploader.DataLoader(
            Range(20), batch_size=3, shuffle=True, num_workers=num_workers, generator=generator(1)
        ).load_state_dict(loaded)
    assert states[2]["yielded"] == 4 and states[2]["ended"] is False
    assert states[3]["ended"] is True


def _state_sizes(dataset: Dataset[int], num_workers: int) -> tuple[int, int]:
    """(pickle, torch.save) bytes of a mid-epoch state_dict once every worker has
    yielded a batch: the largest it gets. Without the self-check's digests: whether a
    prefetched batch's digest is in the state depends on timing (about 40 bytes each)."""
    loader = snaploader.DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=num_workers, generator=generator(0),
        check_resume=False,
    )
    iterator = iter(loader)
    take(iterator, num_workers + 1)  # batch k comes from worker k mod W
    state = loader.state_dict()
    del iterator
    assert len(state["workers"]) == num_workers
    assert all(ledger["yielded"] is not None for ledger in state["workers"])
    # How many prefetched batches had arrived (the self-check's digests, ~60 bytes
    # each) depends on timing, not on the dataset: count every worker's as arrived.
    assert all(entry is None or len(str(entry)) < 80 for entry in state["next_batches"])
    state["next_batches"] = [{"produced": 9, "digest": "0" * 24}] * num_workers
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return len(pickle.dumps(state)), len(buffer.getvalue())


@pytest.fixture(scope="module")
def sizes() -> dict[tuple[str, int, int], tuple[int, int]]:
    kinds: dict[str, type[Range]] = {"range": Range, "drawing": DrawingRange}
    runs = [("range", 100, 8), ("range", 10**7, 8), ("drawing", 10**7, 8), ("drawing", 10**7, 4)]
    return {(kind, n, w): _state_sizes(kinds[kind](n), w) for kind, n, w in runs}


def test_state_dict_size_is_independent_of_dataset_length(
    sizes: dict[tuple[str, int, int], tuple[int, int]],
) -> None:
    small, huge = sizes["range", 100, 8], sizes["range", 10**7, 8]
    # Only the fingerprint's dataset_length differs: a few bytes for a bigger int
    # (torch.save aligns the records of its zip file to 64 bytes).
    assert abs(huge[0] - small[0]) <= 8 and abs(huge[1] - small[1]) <= 128
    assert huge[0] < 64 * 1024 and huge[1] < 64 * 1024


def test_state_dict_size_is_linear_in_workers_and_bounded_per_worker(
    sizes: dict[tuple[str, int, int], tuple[int, int]],
) -> None:
    # Items that draw from all three RNGs: no worker's state can be left out.
    eight, four = sizes["drawing", 10**7, 8], sizes["drawing", 10**7, 4]
    for kind in (0, 1):  # pickle, torch.save
        per_worker = (eight[kind] - four[kind]) / 4
        # one snapshot per worker: three Mersenne Twister states of 2.5 KB
        assert 0 < per_worker <= 11 * 1024, (kind, per_worker)
        assert four[kind] - 4 * per_worker <= 8 * 1024  # the rest: rng_start, a few fields


def _forbid(*_: Any, **__: Any) -> Any:
    raise AssertionError("state_dict() talked to a worker")


def test_state_dict_does_not_touch_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    args: dict[str, Any] = dict(batch_size=2, shuffle=True, num_workers=2, prefetch_factor=2)
    expected = list(snaploader.DataLoader(Range(20), generator=generator(3), **args))
    loader = snaploader.DataLoader(Range(20), generator=generator(3), **args)
    iterator = iter(loader)
    got = take(iterator, 3)
    before = loader.state_dict()
    with monkeypatch.context() as patch:
        for name in ("wait", "start", "discard", "shutdown"):
            patch.setattr(Pool, name, _forbid)
        patch.setattr(WorkerProcess, "send", _forbid)
        for name in ("send", "recv", "poll", "send_bytes", "recv_bytes"):
            patch.setattr(type(iterator.runner.pool.workers[0].result), name, _forbid)  # type: ignore[union-attr]
        state = loader.state_dict()
        # even with every worker gone, the state is there and unchanged
        for worker in iterator.runner.pool.workers:  # type: ignore[union-attr]
            assert worker is not None
            os.kill(worker.pid, signal.SIGKILL)
            worker.process.join(10)
        assert _equal(loader.state_dict(), state)
    assert _equal(state, before)
    del iterator
    resumed = snaploader.DataLoader(Range(20), generator=generator(9), **args)
    resumed.load_state_dict(through_bytes(state))
    assert_same_stream(got + list(resumed), expected)


def test_state_dict_taken_while_workers_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = snaploader.DataLoader(
        Sleepy(12, sleep_from=4, sleep_s=2.0), batch_size=2, num_workers=2, generator=generator(0)
    )
    iterator = iter(loader)
    take(iterator, 2)  # items 0..3; the workers now sleep in batches 2 and 3
    with monkeypatch.context() as patch:
        patch.setattr(Pool, "wait", _forbid)
        patch.setattr(WorkerProcess, "send", _forbid)
        state = loader.state_dict()
    assert state["yielded"] == 2
    assert [ledger["yielded"]["produced"] for ledger in state["workers"]] == [1, 1]
    for worker in iterator.runner.pool.workers:  # type: ignore[union-attr]
        assert worker is not None and worker.process.is_alive()
        worker.process.kill()  # rather than waiting for them to wake up
    del iterator


# -- malformed checkpoints -----------------------------------------------------------


def _loader(**kwargs: Any) -> snaploader.DataLoader:
    args: dict[str, Any] = dict(batch_size=3, shuffle=True, num_workers=0, generator=generator(0))
    args.update(kwargs)
    dataset = args.pop("dataset", Range(10))
    return snaploader.DataLoader(dataset, **args)


@pytest.fixture(scope="module")
def good_state() -> dict[str, Any]:
    loader = _loader()
    iterator = iter(loader)
    take(iterator, 2)
    return loader.state_dict()


_TOP_KEYS = [
    "format", "version", "fingerprint", "epoch", "ended", "yielded", "turn", "rng_kind",
    "rng_start", "rng_next", "base_seed", "drew_base_seed", "sampler_state",
    "sampler_epoch", "workers", "digest",
]


# Each table below is one test that goes through all its cases (a test costs the
# leak check's garbage collections; a case costs microseconds).


def resign(state: Any) -> Any:
    """``state`` with its digest made to match its (edited) contents, as a deliberate
    editor would do, so that the checks behind the digest are reached."""
    try:
        if "digest" not in state:
            return state
        state["digest"] = _checkpoint.resign(state)["digest"]
    except Exception:
        pass  # too broken to sign: the structure checks before the digest answer
    return state


def _format_error(state: Any) -> str:
    with pytest.raises(CheckpointFormatError) as info:
        _loader().load_state_dict(resign(state))
    assert not isinstance(info.value, KeyError)
    return str(info.value)


def test_an_edit_without_the_digest_is_called_a_modification(good_state: dict[str, Any]) -> None:
    edits: list[Callable[[dict[str, Any]], Any]] = [
        lambda s: s.update(yielded=s["yielded"] + 1),
        lambda s: s.update(base_seed=s["base_seed"] + 1),
        lambda s: s["workers"][0]["yielded"].update(produced=0),
        lambda s: s["fingerprint"].update(batch_size=4),
    ]
    for edit in edits:
        state = copy.deepcopy(good_state)
        edit(state)
        with pytest.raises(CheckpointFormatError, match=r"\['digest'\].*modified"):
            _loader().load_state_dict(state)


def test_missing_key_is_named(good_state: dict[str, Any]) -> None:
    assert set(_TOP_KEYS) <= set(good_state)
    for key in _TOP_KEYS:
        state = copy.deepcopy(good_state)
        del state[key]
        assert repr(key) in _format_error(state), key


_WRONG_TYPES: list[tuple[str, Any]] = [
    ("format", 1), ("version", "1"), ("fingerprint", []), ("epoch", "0"), ("epoch", 0.0),
    ("ended", 0), ("yielded", True), ("yielded", None), ("turn", 1.5), ("rng_kind", None),
    ("rng_start", 7), ("rng_next", 5), ("base_seed", "7"), ("drew_base_seed", 1),
    ("sampler_epoch", "1"), ("workers", {}),
]


def test_wrong_type_is_named(good_state: dict[str, Any]) -> None:
    for key, value in _WRONG_TYPES:
        state = copy.deepcopy(good_state)
        state[key] = value
        message = _format_error(state)
        assert repr(key) in message and type(value).__name__ in message, (key, value, message)


_MALFORMED: list[tuple[Callable[[dict[str, Any]], Any], str]] = [
    (lambda s: s.update(version=1), "['version'] is 1"),
    (lambda s: s.update(version=4), "['version'] is 4"),
    (lambda s: s.pop("logical_workers"), "'logical_workers'"),
    (lambda s: s.update(logical_workers=-1), "['logical_workers'] is -1"),
    (lambda s: s["workers"][0].update(worker=1), "['worker'] is 1"),
    (lambda s: s.update(format="torchdata"), "'torchdata'"),
    (lambda s: s.update(rng_kind="other"), "rng_kind"),
    (lambda s: s.update(yielded=-1), "yielded"),
    (lambda s: s["fingerprint"].pop("batch_size"), "'batch_size'"),
    (lambda s: s["workers"][0].pop("yielded"), "'yielded'"),
    (lambda s: s["workers"][0].update(exhausted="no"), "'exhausted'"),
    (lambda s: s["workers"][0]["yielded"].pop("rng"), "'rng'"),
    (lambda s: s["workers"][0]["yielded"].update(produced="1"), "'produced'"),
    (lambda s: s["workers"][0]["yielded"].pop("data"), "'data'"),
    (lambda s: s["workers"].__setitem__(0, "ledger"), "workers'][0]"),
]


def test_malformed_content_is_named(good_state: dict[str, Any]) -> None:
    for change, fragment in _MALFORMED:
        state = copy.deepcopy(good_state)
        change(state)
        message = _format_error(state)
        assert fragment in message, (fragment, message)


def test_not_a_checkpoint() -> None:
    states: list[Any] = [None, [], "state", {}, {"format": "snaploader"}, {"format": "snaploader", "version": 1}]
    for state in states:
        _format_error(state)


def test_a_failed_load_leaves_the_loader_untouched(good_state: dict[str, Any]) -> None:
    expected = list(_loader())
    loader = _loader()
    state = copy.deepcopy(good_state)
    state["fingerprint"]["batch_size"] = 4
    with pytest.raises(CheckpointMismatchError):
        loader.load_state_dict(resign(state))
    assert_same_stream(list(loader), expected)


# -- fingerprint mismatches --------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "saved", "loading", "shown"),
    [
        ("dataset_length", {}, {"dataset": Range(11)}, ("10", "11")),
        ("batch_size", {}, {"batch_size": 4}, ("3", "4")),
        ("drop_last", {}, {"drop_last": True}, ("False", "True")),
        ("sampler", {}, {"shuffle": False}, ("RandomSampler", "SequentialSampler")),
        ("generator", {}, {"generator": None}, ("'given'", "'none'")),
    ],
)
def test_fingerprint_mismatch_shows_both_sides_and_can_be_allowed(
    key: str, saved: dict[str, Any], loading: dict[str, Any], shown: tuple[str, str]
) -> None:
    original = _loader(**saved)
    iterator = iter(original)
    take(iterator, 1)
    state = through_bytes(original.state_dict())
    del iterator
    loader = _loader(**{**saved, **loading})
    with pytest.raises(CheckpointMismatchError) as info:
        loader.load_state_dict(state)
    message = str(info.value)
    line = next(line for line in message.splitlines() if line.strip().startswith(key))
    assert shown[0] in line.split("/")[0] and shown[1] in line.split("/")[1], line
    assert "allow_mismatch" in message and repr(key) in message.split("allow_mismatch")[1]
    loader.load_state_dict(state, allow_mismatch=(key,))
    batches = list(loader)
    assert batches and loader.state_dict()["ended"]


def test_allow_mismatch_with_an_unknown_name_is_refused(good_state: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="dataset_lenght"):
        _loader().load_state_dict(good_state, allow_mismatch=("dataset_lenght",))


def test_sampler_kind_is_told_apart() -> None:
    state = _loader(sampler=RandomSampler(Range(10), replacement=True), shuffle=None).state_dict()
    with pytest.raises(CheckpointMismatchError, match="sampler"):
        _loader(shuffle=False, batch_sampler=None).load_state_dict(state)
