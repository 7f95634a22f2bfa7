"""``pin_memory=True`` with worker processes: results received and pinned in a thread of
their own, as torch's ``_pin_memory_loop`` does, so that the training thread neither
unpickles nor pins.

```
  result pipes + sentinels ──► pin thread: ProcessRunner._pump (wait, unpickle, accept,
                               deaths and respawns), then pins each received batch,
                               oldest first ──► slot.received[i] replaced, slot.pinned += 1
  training thread: send (under the lock) ──► task pipes
                   next_result(slot): waits on ``changed`` until slot's oldest answer
                   is pinned, takes it; the iterator then records it in the ledger
```

- One lock (the runner's ``RLock``) guards the slots, the pipes' bookkeeping and
  ``closed``; ``changed``, a condition on it, wakes the training thread when the pin
  thread has received or pinned something. Pinning itself runs outside the lock, so a
  send never waits for a copy; what was pinned is stored only if its answer is still
  the one waiting in that place (an epoch begun meanwhile replaced the slots).
- What is pinned ahead is bounded as what is received is: by the tasks outstanding
  (``prefetch_factor`` per worker) and the fd budget (NOTE [ fd budget ] in
  ``_workers/process_runner.py``).
- The ledger is the iterator's, and advances when a batch is yielded, never when it is
  pinned: the pin thread never touches it.
- An exception raised while pinning becomes an error answer for that batch, raised at
  its turn like a worker's exception (torch's pin thread wraps it the same way).
- Warnings that receiving gives (a respawned worker, the RNG census) are given on the
  training thread, when it next takes an answer or waits, pointing at the user's code.
- Nothing blocks forever: the pin thread's waits last at most ``_RECEIVE_INTERVAL_S``,
  then it checks its stop event; the training thread's waits too, then it checks
  ``closed``. ``close()`` sets the event, stops the workers (which ends any wait on
  their pipes) and joins the thread for at most ``_JOIN_TIMEOUT_S``. The thread is a
  daemon and holds the runner, never the iterator, so an abandoned iterator is still
  collected, and its finalizer closes this runner.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from multiprocessing.context import BaseContext
from typing import Any, Callable, Final

import torch
from torch.utils.data._utils import pin_memory as torch_pin_memory

from .._state.ledger import EpochProgress
from .._state.records import Resume
from .messages import Kind, Result, Task, WorkerError, WorkerSetup
from .process_runner import ProcessRunner
from .runner import RunnerClosed, Slot

# The pin thread wakes at least this often to see its stop event and which slot the
# training thread waits for; the training thread to see ``closed`` and its timeout.
_RECEIVE_INTERVAL_S: Final = 0.05
_JOIN_TIMEOUT_S: Final = 5.0
THREAD_NAME: Final = "snaploader_pin"


def pinned(result: Result, device: str | None) -> Result:
    """``result`` with its batch in pinned memory, by torch's own function (namedtuples,
    mappings, a batch's own ``pin_memory()``); an error answer if pinning raised."""
    if result.kind is not Kind.BATCH:
        return result
    try:
        data = torch_pin_memory.pin_memory(result.payload, device)
    except Exception as exc:
        error = WorkerError.capture(exc, f"in the pin memory thread for device {device}")
        return replace(result, kind=Kind.ERROR, payload=error)
    return replace(result, payload=data)


class PinningRunner(ProcessRunner):
    """A :class:`ProcessRunner` whose answers a thread of its own receives and pins."""

    def __init__(self, setup: WorkerSetup, context: BaseContext, *, device: str | None, **limits: Any) -> None:
        """``limits``: :class:`ProcessRunner`'s own (processes, timeout_s, max_retries)."""
        # As torch: the thread pins for the device that is current when iteration starts.
        index = torch.accelerator.current_device_index()
        super().__init__(setup, context, **limits)
        self.device = device
        self.changed = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.waiting: int | None = None  # the slot the training thread waits for
        self.broken: BaseException | None = None  # what ended the pin thread, if not close()
        self.deferred: deque[Callable[[], None]] = deque()  # _later calls made on the pin thread
        self.thread = threading.Thread(target=self._run, args=(index,), name=THREAD_NAME, daemon=True)
        self.thread.start()

    # -- the training thread -------------------------------------------------------

    def takes(self, state: Slot) -> bool:
        return state.pinned > 0

    def send(self, slot: int, msg: Resume | Task) -> None:
        with self.lock:
            super().send(slot, msg)

    def begin_epoch(self, progress: EpochProgress) -> None:
        with self.lock:
            super().begin_epoch(progress)

    def next_result(self, slot: int) -> tuple[Task, Result]:
        self._give_deferred()  # before the answer is taken: a warning raised as an error loses none
        return super().next_result(slot)

    def _receive(self, wait_s: float | None, slot: int, met: Callable[[], bool]) -> None:
        interval_s = _RECEIVE_INTERVAL_S if wait_s is None else min(wait_s, _RECEIVE_INTERVAL_S)
        with self.changed:
            self.waiting = slot
            self.changed.wait_for(lambda: met() or self._stopped() or self.ready(slot), interval_s)
            self.waiting = None
        self._give_deferred()
        self._check_running()

    def poll(self) -> None:
        self._give_deferred()  # the pin thread takes what arrives

    def settle(self, timeout_s: float) -> None:
        def settled() -> bool:
            return self._stopped() or not any(state.outstanding for state in self.slots)

        with self.changed:
            self.changed.wait_for(settled, timeout_s)
        self._give_deferred()
        self._check_running()

    def close(self) -> None:
        self.stop.set()
        super().close()
        with self.changed:
            self.changed.notify_all()
        if self.thread is not threading.current_thread():  # a gc finalizer may run on it
            self.thread.join(_JOIN_TIMEOUT_S)

    def _stopped(self) -> bool:
        return self.closed or self.broken is not None

    def _check_running(self) -> None:
        self._check_open()
        if self.broken is not None:
            raise RuntimeError(
                f"the DataLoader's pin memory thread failed: {self.broken!r} (please report this)"
            ) from self.broken

    def _later(self, call: Callable[[], None]) -> None:
        if threading.current_thread() is self.thread:
            self.deferred.append(call)
        else:
            call()

    def _give_deferred(self) -> None:
        while self.deferred:
            self.deferred.popleft()()

    # -- the pin thread -------------------------------------------------------------

    def _run(self, device_index: int) -> None:
        try:
            # As torch's pin thread: one intra-op thread, so a copy cannot take every core.
            torch.set_num_threads(1)
            torch.accelerator.set_device_index(device_index)
            while not self.stop.is_set():
                job = self._oldest_unpinned()
                self._pump(0.0 if job is not None else _RECEIVE_INTERVAL_S, self.waiting)
                with self.changed:
                    self.changed.notify_all()
                if job is None:
                    job = self._oldest_unpinned()
                if job is not None:
                    self._pin(*job)
        except RunnerClosed:
            pass
        except BaseException as exc:
            with self.changed:
                self.broken = exc
                self.changed.notify_all()

    def _oldest_unpinned(self) -> tuple[Slot, Task, Result] | None:
        """The received batch to pin next: the lowest key among each slot's oldest
        unpinned answer (the yield order, for map-style keys); answers without a
        batch count as pinned as they are."""
        best: tuple[Slot, Task, Result] | None = None
        with self.changed:
            for state in self.slots:
                before = state.pinned
                while state.pinned < len(state.received) and state.received[state.pinned][1].kind is not Kind.BATCH:
                    state.pinned += 1
                if state.pinned > before:
                    self.changed.notify_all()
                if state.pinned < len(state.received):
                    task, result = state.received[state.pinned]
                    if best is None or task.key < best[1].key:
                        best = (state, task, result)
        return best

    def _pin(self, state: Slot, task: Task, result: Result) -> None:
        done = pinned(result, self.device)
        with self.changed:
            if self.closed or not any(mine is state for mine in self.slots):
                return  # an epoch begun meanwhile, or close(): this answer is no longer wanted
            at = state.pinned
            if at < len(state.received) and state.received[at][1] is result:
                state.received[at] = (task, done)
                state.pinned += 1
            self.changed.notify_all()

