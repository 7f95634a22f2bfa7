"""Worker processes seen from the main process: send, wait, receive, and survive deaths.

```
  send(slot, Task) ──► task pipe of worker slot (recorded as outstanding)
  next_result(slot): Pool.wait(result pipes + sentinels)
      ├─ Result ──► unpickled at once, while its sender lives ──► slot.received
      └─ death  ──► keep every complete result it sent, respawn the slot from the
                    snapshot after its last received batch, re-send what is
                    outstanding (bounded retries per batch, NOTE [ poison batch ])
```

- ``timeout > 0`` bounds each wait for a batch, as in torch. Otherwise the wait is on
  pipes and sentinels together, so it wakes on either a result or a death, never by
  polling.
- A result whose shared memory can no longer be opened because its sender died counts
  as never received, and so does every later result of that worker: results are
  accepted in the order they were sent or not at all.
"""

from __future__ import annotations

import pickle
import time
import warnings
from multiprocessing.context import BaseContext

import cloudpickle

from ._errors import WorkerCrashedError, WorkerRespawnedWarning, short_indices, user_stacklevel
from ._ledger import resume_after
from ._pool import Pool, WorkerProcess, describe_exit, likely_cause
from ._protocol import Result, Resume, Task, WorkerSetup, loads_result
from ._runner import Runner
from ._worker import worker_main


class ProcessRunner(Runner):
    """``count`` worker processes, one slot each."""

    def __init__(
        self,
        setup: WorkerSetup,
        count: int,
        context: BaseContext,
        *,
        timeout_s: float,
        max_retries: int,
    ) -> None:
        super().__init__(count)
        self.iterable = setup.iterable
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        # Deaths per (epoch, slot, batch): only a batch that kills its worker again and
        # again is given up on.
        self.crashes: dict[tuple[int, int, int | None], int] = {}
        payload: WorkerSetup | bytes = setup
        if context.get_start_method() != "fork":
            payload = cloudpickle.dumps(setup)
        self.pool = Pool(context, count, worker_main, lambda slot: (payload, slot))
        for slot in range(count):
            self.pool.start(slot)

    @property
    def epoch(self) -> int:
        return -1 if self.progress is None else self.progress.epoch

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self.pool.workers if worker is not None]

    def _transmit(self, slot: int, msg: Resume | Task) -> None:
        worker = self.pool.workers[slot]
        if worker is None:
            return  # being replaced; the respawn re-sends what is outstanding
        try:
            # A tensor in a dataset's state would travel through shared memory, and
            # sending one starts multiprocessing's resource sharer (a listener thread
            # and socket) in this process for good. A Resume is rare: send it by value.
            worker.send(pickle.dumps(msg) if isinstance(msg, Resume) else msg)
        except OSError:
            pass  # it died; the receiver sees its sentinel and re-sends what is outstanding

    def next_result(self, slot: int) -> tuple[Task, Result]:
        state = self.slots[slot]
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        while not state.received:
            if state.failed is not None and not state.outstanding:
                raise state.failed
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._pump(wait_s)
            if not state.received and deadline is not None and time.monotonic() >= deadline:
                waited = self.pool.workers[slot]
                pid = waited.pid if waited is not None else "?"
                key = state.outstanding[0].key if state.outstanding else "?"
                raise RuntimeError(
                    f"DataLoader timed out after {self.timeout_s:g} seconds waiting for "
                    f"worker {slot} (pid {pid}) to produce batch {key} of epoch "
                    f"{self.epoch}; raise timeout= or make the dataset faster"
                )
        return state.received.popleft()

    def poll(self) -> None:
        self._pump(0.0)

    def settle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(state.outstanding for state in self.slots):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return  # the next epoch restarts them from the ledger: slower, still exact
            self._pump(left_s)

    def close(self) -> None:
        self.pool.shutdown()

    # -- receiving -----------------------------------------------------------------

    def _pump(self, wait_s: float | None) -> None:
        """Wait up to ``wait_s`` for results or deaths, and handle what came."""
        readable, exited = self.pool.wait(wait_s)
        for worker in readable:
            if self.pool.holds(worker):
                lost = self._drain(worker, 0)
                if lost:
                    self._on_death(worker, lost)
        for worker in exited:
            self._on_death(worker)

    def _drain(self, worker: WorkerProcess, lost: int) -> int:
        """Accept, in order, every complete result waiting in ``worker``'s pipe; return
        how many could not be read (``lost`` of them before this call)."""
        try:
            while worker.result.poll():
                blob = worker.result.recv_bytes()
                worker.messages += 1
                if lost:
                    lost += 1
                    continue
                try:
                    result = loads_result(blob)
                except Exception:
                    lost += 1
                    continue
                self.accept(worker.slot, result)
        except (EOFError, OSError):
            pass  # a torn last message: it died while sending; its sentinel tells
        return lost

    def _on_death(self, worker: WorkerProcess, lost: int = 0) -> None:
        if not self.pool.holds(worker):
            return  # already handled (seen both as a broken pipe and as a sentinel)
        slot = worker.slot
        lost = self._drain(worker, lost)  # keep every complete result it sent
        if worker.process.is_alive():
            worker.process.kill()
        self.pool.discard(slot)
        exitcode = worker.process.exitcode
        how = describe_exit(exitcode)
        cause = likely_cause(exitcode, worker.messages)
        state = self.slots[slot]
        # It answers in order: it answered the first ``lost`` outstanding tasks (the
        # answers were lost) and died on the next one, or idle.
        task = state.outstanding[lost] if len(state.outstanding) > lost else None
        key = (self.epoch, slot, None if task is None else task.key)
        self.crashes[key] = self.crashes.get(key, 0) + 1
        retries = self.max_retries
        what = self._describe(task)
        if self.crashes[key] > retries:
            error = WorkerCrashedError(
                f"worker {slot} (pid {worker.pid}) {how} while loading {what}"
                f"{cause}, {self.crashes[key]} times in a row; gave up after "
                f"{retries} respawn(s) (max_worker_retries={retries}). The batch likely "
                "holds a sample that crashes the dataset code; state_dict() still "
                "resumes at this batch"
            )
            if task is None:
                raise error
            # NOTE [ poison batch ]: raise when the failed batch is due (next_result),
            # not now, so that every batch before it is still yielded and state_dict()
            # then points at it. Only the tasks before it are produced again, by a new
            # process, because their results may have been lost with this one.
            state.failed = error
            while len(state.outstanding) > lost:
                state.outstanding.pop()
            if not state.outstanding:
                return
        new = self.pool.start(slot)
        if self.progress is not None:
            received = [result.snapshot for _, result in state.received]
            self._transmit(slot, resume_after(self.progress.workers[slot], received))
        for pending in state.outstanding:
            self._transmit(slot, pending)
        if state.failed is not None:
            return
        warnings.warn(
            f"worker {slot} (pid {worker.pid}) {how} while loading {what}{cause}; "
            f"respawned as pid {new.pid} from its snapshot, retry {self.crashes[key]} of "
            f"{retries}",
            WorkerRespawnedWarning,
            stacklevel=user_stacklevel(),
        )

    def _describe(self, task: Task | None) -> str:
        if task is None:
            return f"nothing (idle) in epoch {self.epoch}"
        if self.iterable:
            return f"its batch {task.key} of epoch {self.epoch}"
        return f"batch {task.key} of epoch {self.epoch} (sample indices {short_indices(task.indices)})"
