"""``pin_memory=True`` with worker processes: a thread receives and pins ahead
(``_workers/pinning.py``), and everything that holds without pinning still holds.

On this CPU machine the accelerator calls are faked and torch's pin function is a
stand-in that sleeps 4 ms a batch (``stress/_pin_standin.py``), so both loaders take
their pinning path; on a GPU ``stress/gpu_check.py`` runs the real one."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import snaploader
from snaploader._errors import WorkerRespawnedWarning
from snaploader._workers.pinning import THREAD_NAME
from stress._pin_standin import PinRecord, fake_pinning

from ._datasets import Augmented, Sleepy
from ._support import assert_same_stream, generator, states_meanwhile, take, through_bytes

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create"),
    pytest.mark.filterwarnings("ignore:an exact resume of Counting replays"),
]

Pair = namedtuple("Pair", ["x", "i"])


class PairItems(Dataset[Pair]):
    """Item i: a namedtuple of a random tensor drawn in the worker and i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Pair:
        return Pair(torch.rand(3) + i, i)


class Counting(IterableDataset[torch.Tensor]):
    """Each worker yields its share of range(n), with a random draw each."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        for i in range(me, self.n, workers):
            yield torch.tensor([float(i), torch.rand(()).item()])


class OwnPin:
    """A batch with its own pin_memory(), which torch's pin function calls."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.pinned_on: str | None = None

    def pin_memory(self) -> OwnPin:
        out = OwnPin(self.data.clone())
        out.pinned_on = threading.current_thread().name
        return out


def own_pin_collate(batch: list[torch.Tensor]) -> OwnPin:
    return OwnPin(torch.stack(batch))


def pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def loader(dataset: Any = None, **kwargs: Any) -> snaploader.DataLoader:
    args: dict[str, Any] = dict(batch_size=4, num_workers=2, shuffle=True, generator=generator(7))
    args.update(kwargs)
    return snaploader.DataLoader(PairItems(40) if dataset is None else dataset, **args)


@pytest.fixture
def pinning() -> Iterator[PinRecord]:
    with fake_pinning() as record:
        yield record


def test_the_stand_in_makes_both_loaders_pin() -> None:
    with fake_pinning() as record:
        assert torch.accelerator.is_available()
        list(torch.utils.data.DataLoader(PairItems(8), batch_size=4, num_workers=1, pin_memory=True))
    assert record.count() == 2 and len(record.threads()) == 1  # torch's pin thread
    assert threading.current_thread().name not in record.threads()
    assert not torch.accelerator.is_available()


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_pinned_stream_is_the_unpinned_one_and_torchs(pinning: PinRecord, num_workers: int) -> None:
    unpinned = list(loader(num_workers=num_workers))
    assert pinning.count() == 0
    pinned = list(loader(num_workers=num_workers, pin_memory=True))
    # every batch pinned once, by the pin thread, for the accelerator's device
    assert pinning.count() == len(pinned) == 10
    assert pinning.threads() == {THREAD_NAME} and {d for _, d in pinning.calls} == {"cuda"}
    assert all(type(batch) is Pair for batch in pinned)  # torch's handling of namedtuples
    assert_same_stream(pinned, unpinned)
    torchs = list(torch.utils.data.DataLoader(
        PairItems(40), batch_size=4, num_workers=num_workers, shuffle=True, generator=generator(7), pin_memory=True
    ))
    assert_same_stream(pinned, torchs)
    assert not pin_threads()


def test_without_workers_pins_in_the_calling_thread_as_torch(pinning: PinRecord) -> None:
    pinned = list(loader(num_workers=0, pin_memory=True))
    assert_same_stream(pinned, list(loader(num_workers=0)))
    assert pinning.threads() == {threading.current_thread().name} and not pin_threads()


def test_a_batchs_own_pin_memory_runs_on_the_pin_thread(pinning: PinRecord) -> None:
    batches = list(loader(Augmented(12), collate_fn=own_pin_collate, pin_memory=True))
    assert [b.pinned_on for b in batches] == [THREAD_NAME] * 3
    plain = list(loader(Augmented(12), collate_fn=own_pin_collate))
    assert all(torch.equal(a.data, b.data) for a, b in zip(batches, plain))


def test_batches_are_pinned_ahead_during_the_training_step(pinning: PinRecord) -> None:
    # The old code pinned inside next(): no batch beyond the one returned was pinned.
    iterator = iter(loader(pin_memory=True, prefetch_factor=2))
    next(iterator)
    deadline = time.monotonic() + 10.0
    while pinning.count() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # the "training step"
    assert pinning.count() >= 3, "the pin thread did not pin the next batches during the step"
    del iterator


def _states_without_digests(state: dict[str, Any]) -> dict[str, Any]:
    # next_batches holds the self-check's digests of batches received so far: timing.
    return {k: v for k, v in state.items() if k not in ("next_batches", "digest")}


@pytest.mark.parametrize("iterable", [False, True])
def test_the_ledger_advances_when_a_batch_is_yielded_not_when_it_is_pinned(pinning: PinRecord, iterable: bool) -> None:
    dataset = Counting(30) if iterable else PairItems(40)
    plain, pinned = loader(dataset, shuffle=not iterable), loader(dataset, shuffle=not iterable, pin_memory=True)
    plain_it, pinned_it = iter(plain), iter(pinned)
    for step in range(6):
        next(plain_it), next(pinned_it)
        deadline = time.monotonic() + 10.0
        while pinning.count() < min(step + 3, 8) and time.monotonic() < deadline:
            time.sleep(0.005)  # let the pin thread run ahead of the yield
        assert pinning.count() >= min(step + 3, 8), "nothing was pinned ahead"
        assert _states_without_digests(pinned.state_dict()) == _states_without_digests(plain.state_dict())
    del plain_it, pinned_it


@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize("cut", [0, 3, 7])
def test_resume_with_pinning_is_exact(pinning: PinRecord, iterable: bool, cut: int) -> None:
    dataset: Any = Counting(30) if iterable else Augmented(40)
    shuffle = not iterable
    whole = list(loader(dataset, shuffle=shuffle, pin_memory=True))
    first = loader(dataset, shuffle=shuffle, pin_memory=True)
    iterator = iter(first)
    take(iterator, cut)
    state = through_bytes(first.state_dict())
    del iterator
    second = loader(dataset, shuffle=shuffle, pin_memory=True)
    second.load_state_dict(state)
    assert_same_stream(list(second), whole[cut:])
    assert not pin_threads()


def test_persistent_workers_keep_one_pin_thread_across_epochs(pinning: PinRecord) -> None:
    plain = loader(Augmented(24), persistent_workers=True)
    pinned = loader(Augmented(24), persistent_workers=True, pin_memory=True)
    threads = []
    for _ in range(3):
        assert_same_stream(list(pinned), list(plain))
        threads.append(tuple(pin_threads()))
    assert len(threads[0]) == 1 and threads == [threads[0]] * 3
    # An epoch abandoned midway: its workers (and pin thread) start afresh from the ledger.
    take(iter(plain), 2)
    take(iter(pinned), 2)
    assert_same_stream(list(pinned), list(plain))
    del pinned, plain
    _gone()


def _gone() -> None:
    import gc

    deadline = time.monotonic() + 10.0
    while pin_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    assert not pin_threads()


@pytest.mark.parametrize("how", ["close", "del", "abandon", "break_persistent", "load_state_dict"])
def test_no_pin_thread_is_left_behind(pinning: PinRecord, how: str) -> None:
    persistent = how == "break_persistent"
    source = loader(Augmented(40), pin_memory=True, persistent_workers=persistent)
    iterator = iter(source)
    take(iterator, 2)
    assert len(pin_threads()) == 1
    if how == "close":
        iterator.close()
        assert not pin_threads()  # at once: close() joins the thread
    elif how == "del":
        del iterator
    elif how == "abandon":
        for i, _ in enumerate(source):
            if i == 1:
                break
        del iterator
    elif how == "break_persistent":
        del iterator
        del source
    else:
        source.load_state_dict(source.state_dict())
        assert not pin_threads()
        with pytest.raises(RuntimeError, match="invalidated by load_state_dict"):
            next(iterator)
    _gone()


def test_load_state_dict_from_another_thread_while_batches_are_pinned(pinning: PinRecord) -> None:
    # A slow dataset: next() waits on the pin thread when the other thread loads a state.
    source = loader(Sleepy(40, sleep_from=8, sleep_s=0.05), batch_size=2, shuffle=False, pin_memory=True)
    whole = list(loader(Sleepy(40, sleep_from=40, sleep_s=0.0), batch_size=2, shuffle=False))
    iterator = iter(source)
    take(iterator, 3)
    state = source.state_dict()
    seen: list[BaseException] = []

    def consume() -> None:
        try:
            while True:
                next(iterator)
        except BaseException as exc:
            seen.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    time.sleep(0.2)
    source.load_state_dict(state)
    consumer.join(20.0)
    assert not consumer.is_alive()
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError) and "invalidated" in str(seen[0])
    assert not pin_threads()
    assert_same_stream(list(source), whole[3:])


def test_state_dict_from_another_thread_while_pinning(pinning: PinRecord) -> None:
    source = loader(Augmented(80), pin_memory=True)
    with states_meanwhile(source) as states:
        batches = list(source)
    assert states
    plain = loader(Augmented(80))
    whole, after = list(plain), list(plain)  # a state taken after the end resumes epoch 1
    assert_same_stream(batches, whole)
    for state in states[:: max(1, len(states) // 6)]:
        again = loader(Augmented(80), pin_memory=True)
        again.load_state_dict(state)
        rest = list(again)
        try:
            assert_same_stream(rest, whole[len(whole) - len(rest):])
        except AssertionError:
            assert_same_stream(rest, after, "a state taken at the end of epoch 0")


def test_an_exception_while_pinning_is_raised_at_that_batchs_turn() -> None:
    def bad(batch: Any) -> bool:
        return isinstance(batch, Pair) and 13 in batch.i.tolist()

    plain = list(loader(shuffle=False))
    with fake_pinning(fail=bad):
        source = loader(shuffle=False, pin_memory=True)
        iterator = iter(source)
        assert_same_stream(take(iterator, 3), plain[:3])
        with pytest.raises(RuntimeError, match="stand-in pin failed") as caught:
            next(iterator)
        assert "pin memory thread" in "\n".join(getattr(caught.value, "__notes__", []))
        # As torch's: the failed batch counts as taken, and the stream goes on after it.
        state = source.state_dict()
        assert_same_stream(list(iterator), plain[4:])
    resumed = loader(shuffle=False)
    resumed.load_state_dict(state)
    assert_same_stream(list(resumed), plain[4:])


def test_a_killed_worker_is_respawned_under_pinning(pinning: PinRecord) -> None:
    whole = list(loader(Augmented(40)))
    source = loader(Augmented(40), pin_memory=True)
    iterator = iter(source)
    got = take(iterator, 3)
    os.kill(iterator.worker_pids[1], signal.SIGKILL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got += list(iterator)
    assert_same_stream(got, whole)
    respawned = [w for w in caught if issubclass(w.category, WorkerRespawnedWarning)]
    assert respawned, "the respawn was not announced"
    # given on the training thread, pointing at the user's code (this file)
    assert all(w.filename == __file__ for w in respawned)


def test_timeout_holds_under_pinning(pinning: PinRecord) -> None:
    source = loader(Sleepy(20, sleep_from=4, sleep_s=1.5), batch_size=2, shuffle=False, pin_memory=True, timeout=0.5)
    iterator = iter(source)
    take(iterator, 2)
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        next(iterator)
    del iterator


def test_in_order_false_under_pinning(pinning: PinRecord) -> None:
    whole = list(loader(Augmented(40)))
    source = loader(Augmented(40), pin_memory=True, in_order=False)
    got = list(source)
    assert sorted(b[0, 0].item() for b in got) == sorted(b[0, 0].item() for b in whole)
    keyed = {b[0, 0].item(): b for b in whole}
    for batch in got:
        assert torch.equal(batch, keyed[batch[0, 0].item()])
    # a checkpoint taken with batches pinned ahead resumes the batches not yet yielded
    source = loader(Augmented(40), pin_memory=True, in_order=False)
    iterator = iter(source)
    first = take(iterator, 4)
    state = through_bytes(source.state_dict())
    del iterator
    resumed = loader(Augmented(40), pin_memory=True, in_order=False)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert sorted(b[0, 0].item() for b in first + rest) == sorted(keyed)
    for batch in first + rest:
        assert torch.equal(batch, keyed[batch[0, 0].item()])


def test_a_failure_of_the_pin_thread_itself_is_raised_not_waited_on(pinning: PinRecord, monkeypatch: pytest.MonkeyPatch) -> None:
    from snaploader._workers.pinning import PinningRunner

    def broken(self: PinningRunner, wait_s: float | None, waiting: int | None) -> None:
        raise OSError("the pipes broke")

    monkeypatch.setattr(PinningRunner, "_pump", broken)
    iterator = iter(loader(pin_memory=True))
    with pytest.raises(RuntimeError, match="pin memory thread failed: OSError") as caught:
        next(iterator)
    assert isinstance(caught.value.__cause__, OSError)
    del iterator, caught
    _gone()
