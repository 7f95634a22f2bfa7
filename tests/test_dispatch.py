"""What is sent where, and what is yielded next (``_epoch/dispatch.py``), on its own: a
runner that keeps the tasks in memory stands in for the workers, so the order rules are
checked without a process (test_unordered.py and test_resume.py check them end to end)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from snaploader._epoch.dispatch import MapDispatch, by_position, pick, round_robin
from snaploader._state.ledger import WorkerLedger
from snaploader._state.records import Resume, Snapshot
from snaploader._workers.messages import Kind, Result, Task
from snaploader._workers.runner import Runner


class MemoryRunner(Runner):
    """Slots whose workers answer only when the test says so (``answer``)."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.sent: list[tuple[int, int]] = []  # (slot, key) in the order sent
        self.waits = 0

    def _transmit(self, slot: int, msg: Resume | Task) -> None:
        if isinstance(msg, Task):
            self.sent.append((slot, msg.key))

    def answer(self, slot: int) -> None:
        task = self.slots[slot].outstanding[0]
        self.accept(slot, Result(task.key, Kind.BATCH, task.indices, Snapshot(b"", 0)))

    def next_result(self, slot: int) -> tuple[Task, Result]:
        task, result, _ = self.slots[slot].pop()
        return task, result

    def wait_any(self, first: int) -> None:
        self.waits += 1
        self.answer(first)  # the fixed order's slot is the one that answers

    def settle(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None

    @property
    def worker_pids(self) -> list[int]:
        return []


class ListPlan:
    """An IndexPlan's take(), over a list of batches."""

    def __init__(self, batches: int, start: int = 0) -> None:
        self.left = [[k] for k in range(start, batches)]

    def take(self) -> list[int] | None:
        return self.left.pop(0) if self.left else None


def ledger(produced: int, exhausted: bool = False) -> WorkerLedger:
    if produced == 0 and not exhausted:
        return WorkerLedger()
    return WorkerLedger().record(Snapshot(b"", produced, exhausted=exhausted))


def test_in_order_sends_batch_k_to_slot_k_mod_w_keeping_prefetch_times_w_ahead() -> None:
    runner, plan = MemoryRunner(3), ListPlan(20)
    dispatch = MapDispatch(plan, 0, [0, 0, 0], prefetch=2, ordered=True)
    dispatch.top_up(runner, first_due=0)
    assert runner.sent == [(k % 3, k) for k in range(6)]
    dispatch.top_up(runner, first_due=2)  # two batches yielded: two more go out
    assert runner.sent[6:] == [(0, 6), (1, 7)]
    dispatch.top_up(runner, first_due=20)
    assert dispatch.done and dispatch.finished(20) and not dispatch.finished(19)
    assert [key for _, key in runner.sent] == list(range(20))


def test_a_restored_epoch_does_not_send_the_batches_its_counts_mark_yielded() -> None:
    # in_order=False checkpoint: slot 1 had yielded batches 1 and 3, slot 0 none; the
    # plan restarts at the first batch not yielded (0).
    runner = MemoryRunner(2)
    dispatch = MapDispatch(ListPlan(8), 0, [0, 2], prefetch=2, ordered=True)
    dispatch.top_up(runner, first_due=0)
    assert runner.sent == [(0, 0), (0, 2)]
    dispatch.top_up(runner, first_due=8)
    assert sorted(key for _, key in runner.sent) == [0, 2, 4, 5, 6, 7]


def test_out_of_order_a_slow_slot_does_not_stop_the_others() -> None:
    runner = MemoryRunner(2)
    dispatch = MapDispatch(ListPlan(40), 0, [0, 0], prefetch=2, ordered=False)
    dispatch.top_up(runner, first_due=0)
    assert runner.sent == [(0, 0), (1, 1), (0, 2), (1, 3)]
    # Slot 1 answers and its answers are yielded; slot 0 (batch 0) is stuck.
    for _ in range(5):
        runner.answer(1)
        runner.next_result(1)
        dispatch.top_up(runner, first_due=0)
    slot_1 = [key for slot, key in runner.sent if slot == 1]
    assert slot_1 == [1, 3, 5, 7, 9, 11, 13]  # each slot's own keys, in order
    # Slot 0's batches wait here, never more than prefetch of them sent to it; the
    # plan is drawn at most _WINDOW_FACTOR * prefetch * W past the first batch due.
    assert [key for slot, key in runner.sent if slot == 0] == [0, 2]
    assert dispatch.dispatched <= 8 * 2 * 2


@given(st.integers(1, 5), st.lists(st.integers(0, 6), min_size=5, max_size=5))
def test_by_position_ranks_slots_by_their_next_batch(slots: int, counts: list[int]) -> None:
    workers = [ledger(n) for n in counts[:slots]]
    ranked = by_position(workers)
    next_batch = [w + counts[w] * slots for w in range(slots)]
    assert sorted(ranked) == list(range(slots))
    assert [next_batch[w] for w in ranked] == sorted(next_batch)


def test_round_robin_starts_at_the_turn_and_skips_exhausted_slots() -> None:
    workers = [ledger(2), ledger(2, exhausted=True), ledger(1), ledger(1)]
    assert round_robin(workers, 2) == [2, 3, 0]
    assert round_robin(workers, 1) == [2, 3, 0]
    assert round_robin([ledger(0, exhausted=True)], 0) == []


def test_pick_takes_the_first_ready_slot_of_the_fixed_order_and_waits_when_none_is() -> None:
    runner = MemoryRunner(3)
    for slot in range(3):
        runner.send(slot, Task(slot, [slot]))
    runner.answer(2)
    assert pick(runner, [0, 1, 2]) == 2 and runner.waits == 0
    runner.answer(1)
    assert pick(runner, [0, 1, 2]) == 1  # the fixed order's preference among ready ones
    runner.slots[1].received.clear()
    runner.slots[2].received.clear()
    assert pick(runner, [0, 1, 2]) == 0 and runner.waits == 1
