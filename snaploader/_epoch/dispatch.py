"""Which batch is yielded next, and which are sent: the fixed order, or ``in_order=False``.

- The fixed order (``in_order=True``, and always at ``num_workers=0``): map-style batch
  k comes from slot k mod W, so the next batch is the first one not yet yielded
  (``_state/ledger.py``'s ``first_due``); an iterable's batches come round-robin from the slots not
  yet exhausted, from ``turn`` on.
- ``in_order=False`` with worker processes: the next batch is the next one of
  whichever slot has one received; when several have, the one the fixed order ranks
  first. The loader blocks only when none has (``Runner.wait_any``). As in torch,
  only the interleaving across workers follows timing: a slot's answers are accepted
  in the order its tasks were sent (``_workers/runner.py``), so each ledger stays a contiguous
  prefix of the slot's batches, and a checkpoint is per-worker counts. Map-style batch
  k (slot k mod W's (k // W)-th) was yielded iff k // W is below that slot's count.
- Map-style dispatch (:class:`MapDispatch`) draws the plan in its order and sends batch
  k to slot k mod W, leaving out the batches a restored checkpoint's counts mark as
  yielded (the plan restarts at the first batch not yet yielded). In order, it keeps
  ``prefetch * W`` batches sent past the first not yet yielded, as torch does. Out of
  order, each slot gets at most ``prefetch`` tasks sent and not yet yielded, and a
  batch drawn for a full slot waits here, so that a slow slot does not keep the
  others idle; the plan is drawn at most ``_WINDOW_FACTOR * prefetch * W`` batches
  past the first not yet yielded (index lists and, for a stateful sampler, its states
  are all that wait).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Final

from .._state.ledger import WorkerLedger, share_count
from .._workers.messages import Task
from .._workers.runner import Runner

_WINDOW_FACTOR: Final = 8


def by_position(workers: Sequence[WorkerLedger]) -> list[int]:
    """Map-style slots ranked by the fixed order: by the index of their next batch."""
    slots = len(workers)
    return sorted(range(slots), key=lambda w: w + share_count(workers[w]) * slots)


def round_robin(workers: Sequence[WorkerLedger], turn: int) -> list[int]:
    """Iterable slots not yet exhausted, in round-robin order from ``turn``."""
    slots = len(workers)
    order = [(turn + i) % slots for i in range(slots)]
    return [slot for slot in order if not workers[slot].exhausted]


def pick(runner: Runner, ranked: Sequence[int]) -> int:
    """The first slot of ``ranked`` (the fixed order's preference) whose next answer is
    ready, waiting for any when none is (``in_order=False``)."""
    if runner.ready(ranked[0]):
        return ranked[0]
    runner.poll()
    while True:
        for slot in ranked:
            if runner.ready(slot):
                return slot
        runner.wait_any(ranked[0])


class MapDispatch:
    """Sends one map-style epoch's batches (see the module docstring)."""

    def __init__(
        self, plan: Any, start: int, counts: Sequence[int], prefetch: int, ordered: bool, seed: int | None = None
    ) -> None:
        """``plan`` starts at batch ``start``; ``counts``: per slot, the batches of its
        share yielded before this epoch (re)started, which are not sent again; ``seed``:
        the epoch's per-sample seed each task carries (None: the option is off)."""
        self.plan = plan
        self.dispatched = start  # batches drawn from the plan: sent, held, or left out
        self.done = False  # the plan ran dry
        self.counts = list(counts)
        self.held: list[deque[Task]] = [deque() for _ in self.counts]
        self.prefetch = prefetch
        self.ordered = ordered
        self.seed = seed

    def finished(self, first_due: int) -> bool:
        """True when every batch of the epoch has been yielded."""
        return self.done and first_due >= self.dispatched

    def _room(self, runner: Runner, slot: int) -> bool:
        state = runner.slots[slot]
        return len(state.outstanding) + len(state.received) < self.prefetch

    def top_up(self, runner: Runner, first_due: int) -> None:
        """Send what the slots have room for; ``first_due``: the first batch not yet
        yielded."""
        slots = len(self.counts)
        for slot, held in enumerate(self.held):
            while held and self._room(runner, slot):
                runner.send(slot, held.popleft())
        window = self.prefetch * slots * (1 if self.ordered else _WINDOW_FACTOR)
        while not self.done and self.dispatched < first_due + window:
            if not self.ordered and all(self.held[s] or not self._room(runner, s) for s in range(slots)):
                return  # every slot has work enough: draw no further ahead
            indices = self.plan.take()
            if indices is None:
                self.done = True
                return
            key = self.dispatched
            self.dispatched += 1
            slot = key % slots
            if key // slots < self.counts[slot]:
                continue  # yielded before the checkpoint (in_order=False)
            if self.ordered or (not self.held[slot] and self._room(runner, slot)):
                runner.send(slot, Task(key, indices, self.seed))
            else:
                self.held[slot].append(Task(key, indices, self.seed))
