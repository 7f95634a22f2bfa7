"""Worker processes seen from the main process: send, wait, receive, and survive deaths.

```
  send(slot, Task) ──► task pipe of the process hosting logical worker slot
                       (recorded as outstanding, and in the process's send order)
  next_result(slot): Pool.wait(result pipes + sentinels)
      ├─ Result ──► unpickled at once, while its sender lives ──► slot.received
      └─ death  ──► keep every complete result it sent, respawn the process with each
                    logical worker it hosted at the snapshot after its last received
                    batch, re-send what is outstanding, in the order first sent
                    (NOTE [ poison batch ], NOTE [ restart storms ])
```

Slots are logical workers; the pool's processes go by index (NOTE [ logical workers ] in
``_workers/worker_loop.py``): logical worker ``w`` lives in process ``w % processes``. A process
answers its tasks in the order they were sent, whatever logical worker they are for,
so ``order[process]`` (the logical worker of each unanswered task, oldest first) says
whose answer comes next.

- With ``pin_memory=True`` a subclass receives in a thread of its own and pins
  (``_workers/pinning.py``): ``_receive`` and ``_later`` are its hooks; here the
  receiving runs on the caller's thread.
- ``timeout > 0`` bounds each wait for a batch, as in torch. Otherwise the wait is on
  pipes and sentinels together, so it wakes on either a result or a death, never by
  polling.
- A result whose shared memory can no longer be opened because its sender died counts
  as never received, and so does every later result of that worker: results are
  accepted in the order they were sent or not at all. A result that fails to unpickle
  while its sender is alive is the user's error (a reconstructor that raises): it is
  raised, as the original exception, when its batch is due, and the worker lives on.
- NOTE [ fd budget ]: a result whose tensors travel through shared memory holds one fd
  per tensor in this process from unpickling until the user drops the batch. Results
  are read from a worker's pipe only while the received-but-not-yielded results hold
  fewer than ``fd_budget`` fds (the slot being waited for always gets its next one);
  the rest wait in the pipes, where they hold no fd here. Deaths are still seen at
  once (sentinels are always waited on), and a dead worker's pipe is drained whole.
"""

from __future__ import annotations

import pickle
from functools import partial
import threading
from collections import deque
import time
import warnings
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from typing import Callable, Final

import cloudpickle

from .._errors import WorkerCrashedError, WorkerRespawnedWarning, user_stacklevel
from .._state.ledger import EpochProgress
from .exits import Death, doing, worker_name
from .pool import FetchMarks, Pool, WorkerProcess, fd_budget
from .worker_loop import copy_setup, fetch_mark, worker_main
from .messages import (
    Kind,
    Result,
    Task,
    UnreadablePayload,
    WorkerSetup,
    fds_of,
    loads_result,
)
from .._state.records import Resume
from .runner import Runner, RunnerClosed

# NOTE [ restart storms ]: a death that is not a batch's fault (idle, starting,
# restoring) counts against no batch, but max_worker_retries + 1 deaths of a process in
# a row without a result end the run when its next batch is due (an OOM killer taking
# every restoring worker would loop forever). Repeated deaths are spaced out, from
# _BACKOFF_FIRST_S doubling up to _BACKOFF_MAX_S. A process that exits with a code
# before its entry point cannot start (spawn without the __main__ guard): it fails at once.
_BACKOFF_FIRST_S: Final = 0.05
_BACKOFF_MAX_S: Final = 2.0
# How long a result that failed to unpickle waits for its sender to be seen dead
# before the failure is taken for the user's: a sender killed right after sending
# closes its sockets an instant before it can be reaped.
_SENDER_DEATH_GRACE_S: Final = 1.0


class ProcessRunner(Runner):
    """The logical workers of ``setup`` hosted by at most ``processes`` worker processes."""

    def __init__(
        self,
        setup: WorkerSetup,
        context: BaseContext,
        *,
        processes: int,
        timeout_s: float,
        max_retries: int,
    ) -> None:
        super().__init__(setup.logical)
        count = self.count
        self.processes = max(1, min(processes, count))
        self.hosted = [tuple(range(p, count, self.processes)) for p in range(self.processes)]
        # Per process: the logical worker of each task sent and not answered, oldest first.
        self.order: list[deque[int]] = [deque() for _ in range(self.processes)]
        self.iterable = setup.iterable
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        # Deaths per (epoch, slot, batch) while that batch was being fetched: the poison
        # batch verdict (NOTE [ poison batch ]).
        self.crashes: dict[tuple[int, int, int], int] = {}
        # Deaths per process since it last delivered a result (NOTE [ restart storms ]).
        self.storm = [0] * self.processes
        # process: (when, what happened for the warning or "" for none, the retry count)
        self.respawn_due: dict[int, tuple[float, str, str]] = {}
        self.fd_budget = fd_budget()
        # NOTE [ closed from another thread ]: load_state_dict() may stop the workers
        # while next() waits on them in another thread. Handling what a wait brought
        # (which may respawn a process) and close() exclude each other, and the waiter
        # sees ``closed`` after every wait, so it never respawns behind close() nor
        # reads pipes close() closed.
        self.lock = threading.RLock()
        self.closed = False
        self.held_fds = 0  # fds held by received, not yet yielded results
        payload: WorkerSetup | bytes = setup
        if context.get_start_method() != "fork":
            payload = cloudpickle.dumps(setup)
        elif self.processes < count:
            # Each hosted logical worker needs a copy (copy_setup): fail here, clearly,
            # without building one in this process when pickling alone shows it can be made.
            try:
                cloudpickle.dumps(setup)
            except Exception:
                copy_setup(setup, fresh=True)  # a deep copy, or the clear error
        self.pool = Pool(
            context, self.processes, worker_main, lambda p: (payload, p, self.hosted[p], count)
        )
        for process in range(self.processes):
            self.pool.start(process)

    @property
    def epoch(self) -> int:
        return -1 if self.progress is None else self.progress.epoch

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self.pool.workers if worker is not None]

    def _transmit(self, slot: int, msg: Resume | Task) -> None:
        if isinstance(msg, Task):
            self.order[slot % self.processes].append(slot)
        self._deliver(slot, msg)

    def _deliver(self, slot: int, msg: Resume | Task) -> None:
        worker = self.pool.workers[slot % self.processes]
        if worker is None:
            return  # being replaced; the respawn re-sends what is outstanding
        try:
            # A tensor in a dataset's state would travel through shared memory, and
            # sending one starts multiprocessing's resource sharer (a listener thread
            # and socket) in this process for good. A Resume is rare: send it by value.
            worker.send((slot, pickle.dumps(msg) if isinstance(msg, Resume) else msg))
        except OSError:
            pass  # it died; the receiver sees its sentinel and re-sends what is outstanding

    def begin_epoch(self, progress: EpochProgress) -> None:
        super().begin_epoch(progress)
        self.order = [deque() for _ in range(self.processes)]
        self.held_fds = 0

    def _unanswered(self, process: int) -> list[tuple[int, Task]]:
        """The tasks ``process`` owes, as (logical worker, task), in the order sent."""
        queues = {w: iter(self.slots[w].outstanding) for w in self.hosted[process]}
        return [(w, next(queues[w])) for w in self.order[process]]

    def next_result(self, slot: int) -> tuple[Task, Result]:
        state = self.slots[slot]
        self._wait_until(lambda: self.takes(state), slot)
        with self.lock:
            task, result, fds = state.pop()
            self.held_fds -= fds
        return task, result

    def wait_any(self, first: int) -> None:
        owed = (self.ready(s) or self.slots[s].outstanding or self.slots[s].received for s in range(self.count))
        if not any(owed):
            raise RuntimeError("the loader waits for a batch no worker owes (please report this)")
        self._wait_until(lambda: any(self.ready(slot) for slot in range(self.count)), first, anyone=True)

    def _wait_until(self, met: Callable[[], bool], slot: int, anyone: bool = False) -> None:
        """Receive until ``met()``, reading ``slot``'s answers whatever the fd budget;
        raise its failure when its failed batch is due, or a timeout."""
        state = self.slots[slot]
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        while not met():
            if state.failed is not None and not state.outstanding and not state.received:
                raise state.failed
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._receive(wait_s, slot, met)
            if not met() and deadline is not None and time.monotonic() >= deadline:
                waited = self.pool.workers[slot % self.processes]
                pid = waited.pid if waited is not None else "?"
                key = state.outstanding[0].key if state.outstanding else "?"
                what = f"worker {slot} (pid {pid}) to produce batch {key} of epoch {self.epoch}"
                if anyone:
                    what = f"any worker to produce a batch (in_order=False), the first in order being {what}"
                raise RuntimeError(
                    f"DataLoader timed out after {self.timeout_s:g} seconds waiting for "
                    f"{what}; raise timeout= or make the dataset faster"
                )

    def _receive(self, wait_s: float | None, slot: int, met: Callable[[], bool]) -> None:
        """Receive for up to ``wait_s``, or until ``met()``, while waiting for ``slot``."""
        self._pump(wait_s, slot)

    def poll(self) -> None:
        self._pump(0.0, None)

    def settle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(state.outstanding for state in self.slots):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return  # the next epoch restarts them from the ledger: slower, still exact
            self._pump(left_s, None)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.respawn_due.clear()
            self.pool.shutdown()

    # -- receiving -----------------------------------------------------------------

    def _pump(self, wait_s: float | None, waiting: int | None) -> None:
        """Wait up to ``wait_s`` for results or deaths, and handle what came. Results
        of slots other than ``waiting`` are read only within the fd budget
        (NOTE [ closed from another thread ])."""
        with self.lock:
            self._check_open()
            self._respawn_when_due()
            if self.respawn_due:
                until_s = max(0.0, min(due for due, _, _ in self.respawn_due.values()) - time.monotonic())
                wait_s = until_s if wait_s is None else min(wait_s, until_s)
            over = self.held_fds >= self.fd_budget
            mine = None if waiting is None else waiting % self.processes
            skip = {process for process in range(self.processes) if over and process != mine}
        try:
            readable, exited = self.pool.wait(wait_s, skip)
        except (OSError, ValueError):  # a pipe or process close() closed under the wait
            self._check_open()
            raise
        with self.lock:
            self._check_open()
            for worker in readable:
                if self.pool.holds(worker):
                    lost = self._drain(worker, 0, waiting)
                    if lost:
                        self._on_death(worker, lost)
            for worker in exited:
                self._on_death(worker)
            self._respawn_when_due()

    def _check_open(self) -> None:
        if self.closed:
            raise RunnerClosed("the worker processes were stopped while waiting for them")

    def _drain(self, worker: WorkerProcess, lost: int, waiting: int | None, whole: bool = False) -> int:
        """Accept, in order, the complete results waiting in ``worker``'s pipe (all of
        them when ``whole``, else within the fd budget); return how many could not be
        read (``lost`` of them before this call)."""
        order = self.order[worker.index]
        try:
            while worker.result.poll():  # also True at end-of-file: recv_bytes raises then
                slot = order[0] if order else -1
                if not whole and self.held_fds >= self.fd_budget and (slot != waiting or self.slots[slot].received):
                    break
                blob = worker.result.recv_bytes()
                if slot < 0:
                    raise RuntimeError(
                        f"worker process {worker.index} sent a result no task asked for; "
                        "the worker protocol is broken (please report this)"
                    )
                state = self.slots[slot]
                if lost:
                    lost += 1
                    continue
                try:
                    result = loads_result(blob)
                except UnreadablePayload as unreadable:
                    if self._sender_died(worker):
                        lost += 1
                        continue
                    result = unreadable.as_error(slot)
                except Exception:
                    lost += 1
                    continue
                self.storm[worker.index] = 0
                fds = fds_of(blob) if result.kind is Kind.BATCH else 0
                before = len(state.received)
                order.popleft()
                self.accept(slot, result, fds)
                if len(state.received) > before:
                    self.held_fds += fds
        except (EOFError, OSError):
            pass  # a torn last message: it died while sending; its sentinel tells
        return lost

    @staticmethod
    def _sender_died(worker: WorkerProcess) -> bool:
        return bool(wait([worker.process.sentinel], _SENDER_DEATH_GRACE_S))

    def _on_death(self, worker: WorkerProcess, lost: int = 0) -> None:
        if not self.pool.holds(worker):
            return  # already handled (seen both as a broken pipe and as a sentinel)
        process = worker.index
        lost = self._drain(worker, lost, None, whole=True)  # keep every complete result it sent
        if worker.process.is_alive():
            worker.process.kill()
        mark = self.pool.marks.get(process)
        self.pool.discard(process)
        exitcode = worker.process.exitcode
        # It answers in order: it answered the first ``lost`` outstanding tasks (the
        # answers were lost) and died on a later one, or idle. Its mark names the task
        # it was fetching (it may be past the first unanswered one when answers sent
        # after it were lost too): only that batch is to blame.
        unanswered = self._unanswered(process)[lost:]
        at = next((i for i, (w, t) in enumerate(unanswered) if fetch_mark(t.key, w, self.count) == mark), 0)
        slot, task = unanswered[at] if unanswered else (self.hosted[process][0], None)
        fetching = task is not None and mark == fetch_mark(task.key, slot, self.count)
        death = Death(
            worker.pid,
            exitcode,
            worker_name(slot, self.processes, self.count),
            doing(self.epoch, self.iterable, None if task is None else task.key,
                  None if task is None else task.indices, fetching, mark),
        )
        self.storm[process] += 1
        storm, most = self.storm[process], self.max_retries + 1
        if mark == FetchMarks.UNSTARTED and (exitcode or 0) > 0:
            self._fail_process(process, WorkerCrashedError(death.cannot_start()))
            return
        if fetching and task is not None:
            key = (self.epoch, slot, task.key)
            self.crashes[key] = self.crashes.get(key, 0) + 1
            if self.crashes[key] > self.max_retries:
                self._give_up(slot, WorkerCrashedError(death.poison(self.crashes[key], self.max_retries)), task)
                hosted = [self.slots[w] for w in self.hosted[process]]
                if all(state.failed is not None and not state.outstanding for state in hosted):
                    return  # nothing more is asked of this process
            retry = f"retry {self.crashes[key]} of {self.max_retries}"
        else:
            retry = "not counted against any batch (it had not started one)"
            if storm >= most:
                self._fail_process(process, WorkerCrashedError(death.storm(storm, self.max_retries)))
                return
        retry = f"{retry}; death {storm} in a row without a batch, of at most {most}"
        delay_s = 0.0
        if storm > 1:
            delay_s = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (storm - 2))
        said = "" if self.slots[slot].failed is not None else death.said()
        self.respawn_due[process] = (time.monotonic() + delay_s, said, retry)
        if delay_s == 0:
            self._respawn_when_due()

    def _fail_process(self, process: int, error: WorkerCrashedError) -> None:
        """Respawn ``process`` no more: each logical worker it hosts raises ``error``
        when its next batch is due (every batch before it is still yielded, so
        state_dict() then resumes at that batch), and owes nothing more."""
        for slot in self.hosted[process]:
            state = self.slots[slot]
            state.failed = error
            state.outstanding.clear()
        self.order[process].clear()

    def _give_up(self, slot: int, error: WorkerCrashedError, task: Task) -> None:
        # NOTE [ poison batch ]: raise when the failed batch is due (next_result), not
        # now, so that every batch before it is still yielded and state_dict() then
        # points at it. Only the tasks before it are produced again, by a new process,
        # because their results may have been lost with this one.
        state = self.slots[slot]
        state.failed = error
        dropped = 0
        while state.outstanding and state.outstanding[-1] is not task:
            state.outstanding.pop()
            dropped += 1
        if state.outstanding:
            state.outstanding.pop()
            dropped += 1
        order = self.order[slot % self.processes]
        for i in range(len(order) - 1, -1, -1):  # its last ``dropped`` entries go with them
            if dropped and order[i] == slot:
                del order[i]
                dropped -= 1

    def _respawn_when_due(self) -> None:
        now = time.monotonic()
        for process, (due, said, retry) in list(self.respawn_due.items()):
            if due > now:
                continue
            del self.respawn_due[process]
            new = self.pool.start(process)
            if self.progress is not None:
                for slot in self.hosted[process]:
                    received = [result.snapshot for _, result in self.slots[slot].received]
                    self._deliver(slot, self.progress.resume(slot, received))
            for slot, pending in self._unanswered(process):
                self._deliver(slot, pending)
            if said:
                message = f"{said}; respawned as pid {new.pid} from its snapshot, {retry}"
                self._later(partial(_warn_respawned, message))


def _warn_respawned(message: str) -> None:
    warnings.warn(message, WorkerRespawnedWarning, stacklevel=user_stacklevel())
