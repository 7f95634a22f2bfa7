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

Runner slots are logical workers; pool slots are processes (NOTE [ logical workers ] in
``_workers/process_main.py``): logical worker ``w`` lives in process ``w % processes``. A process
answers its tasks in the order they were sent, whatever logical worker they are for,
so ``order[process]`` (the logical worker of each unanswered task, oldest first) says
whose answer comes next.

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
import resource
from collections import deque
import time
import warnings
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from typing import Callable, Final

import cloudpickle

from .._errors import WorkerCrashedError, WorkerRespawnedWarning, short_indices, user_stacklevel
from .._state.ledger import EpochProgress
from .exits import describe_exit, likely_cause, torch_wording
from .pool import Pool, WorkerProcess
from .process_main import copy_setup, fetch_mark, worker_main
from .messages import (
    Kind,
    Result,
    Task,
    UnreadablePayload,
    WorkerError,
    WorkerSetup,
    fds_of,
    loads_result,
)
from .._state.records import Resume
from .runner import Runner

# NOTE [ restart storms ]: deaths that are not a batch's fault (killed idle, or while
# starting or restoring) never end the run; repeated ones of a slot that has delivered
# nothing since are spaced out, from _BACKOFF_FIRST_S doubling up to _BACKOFF_MAX_S.
_BACKOFF_FIRST_S: Final = 0.05
_BACKOFF_MAX_S: Final = 2.0
# How long a result that failed to unpickle waits for its sender to be seen dead
# before the failure is taken for the user's: a sender killed right after sending
# closes its sockets an instant before it can be reaped.
_SENDER_DEATH_GRACE_S: Final = 1.0
# See NOTE [ fd budget ]: at most this many fds, and a quarter of the soft limit.
_FD_BUDGET_MAX: Final = 64


def _fd_budget() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _FD_BUDGET_MAX
    return max(1, min(_FD_BUDGET_MAX, soft // 4))


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
        super().__init__(setup.num_workers)
        count = self.count
        self.processes = max(1, min(processes, count))
        self.hosted = [tuple(range(p, count, self.processes)) for p in range(self.processes)]
        # Per process: the logical worker of each task sent and not answered, oldest first.
        self.order: list[deque[int]] = [deque() for _ in range(self.processes)]
        self.iterable = setup.iterable
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        # Deaths per (epoch, slot, batch) while that batch was being fetched, and per
        # (epoch, slot, None) of a worker that exited by itself before taking a task:
        # only these lead to a verdict.
        self.crashes: dict[tuple[int, int, int | None], int] = {}
        self.storm = [0] * self.processes  # deaths per process since it last delivered a result
        # process: (when, what happened for the warning or "" for none, the retry count)
        self.respawn_due: dict[int, tuple[float, str, str]] = {}
        self.fd_budget = _fd_budget()
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
        self._wait_until(lambda: bool(state.received), slot)
        task, result, fds = state.pop()
        self.held_fds -= fds
        return task, result

    def wait_any(self, first: int) -> None:
        if not any(self.ready(slot) or self.slots[slot].outstanding for slot in range(self.count)):
            raise RuntimeError("the loader waits for a batch no worker owes (please report this)")
        self._wait_until(lambda: any(self.ready(slot) for slot in range(self.count)), first, anyone=True)

    def _wait_until(self, met: Callable[[], bool], slot: int, anyone: bool = False) -> None:
        """Receive until ``met()``, reading ``slot``'s answers whatever the fd budget;
        raise its failure when its failed batch is due, or a timeout."""
        state = self.slots[slot]
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        while not met():
            if state.failed is not None and not state.outstanding:
                raise state.failed
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._pump(wait_s, slot)
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
        self.respawn_due.clear()
        self.pool.shutdown()

    # -- receiving -----------------------------------------------------------------

    def _pump(self, wait_s: float | None, waiting: int | None) -> None:
        """Wait up to ``wait_s`` for results or deaths, and handle what came. Results
        of slots other than ``waiting`` are read only within the fd budget."""
        self._respawn_when_due()
        if self.respawn_due:
            until_s = max(0.0, min(due for due, _, _ in self.respawn_due.values()) - time.monotonic())
            wait_s = until_s if wait_s is None else min(wait_s, until_s)
        over = self.held_fds >= self.fd_budget
        mine = None if waiting is None else waiting % self.processes
        skip = {process for process in range(self.processes) if over and process != mine}
        readable, exited = self.pool.wait(wait_s, skip)
        for worker in readable:
            if self.pool.holds(worker):
                lost = self._drain(worker, 0, waiting)
                if lost:
                    self._on_death(worker, lost)
        for worker in exited:
            self._on_death(worker)
        self._respawn_when_due()

    def _drain(self, worker: WorkerProcess, lost: int, waiting: int | None, whole: bool = False) -> int:
        """Accept, in order, the complete results waiting in ``worker``'s pipe (all of
        them when ``whole``, else within the fd budget); return how many could not be
        read (``lost`` of them before this call)."""
        order = self.order[worker.slot]
        try:
            while worker.result.poll():  # also True at end-of-file: recv_bytes raises then
                slot = order[0] if order else -1
                if not whole and self.held_fds >= self.fd_budget and (slot != waiting or self.slots[slot].received):
                    break
                blob = worker.result.recv_bytes()
                worker.messages += 1
                if slot < 0:
                    raise RuntimeError(
                        f"worker process {worker.slot} sent a result no task asked for; "
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
                    result = self._unreadable_as_error(unreadable, slot)
                except Exception:
                    lost += 1
                    continue
                self.storm[worker.slot] = 0
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

    @staticmethod
    def _unreadable_as_error(unreadable: UnreadablePayload, slot: int) -> Result:
        # Its sender lives: the payload itself cannot be rebuilt here (a reconstructor
        # that raises). The user's error, raised when this batch is due, like one
        # raised in __getitem__; the snapshot after the batch came intact with it.
        error = WorkerError.capture(
            unreadable.error,
            origin=f"in the main process, unpickling the batch worker {slot} sent",
        )
        return Result(unreadable.key, Kind.ERROR, error, unreadable.snapshot)

    def _on_death(self, worker: WorkerProcess, lost: int = 0) -> None:
        if not self.pool.holds(worker):
            return  # already handled (seen both as a broken pipe and as a sentinel)
        process = worker.slot
        lost = self._drain(worker, lost, None, whole=True)  # keep every complete result it sent
        if worker.process.is_alive():
            worker.process.kill()
        mark = self.pool.marks.get(process)
        self.pool.discard(process)
        exitcode = worker.process.exitcode
        how = describe_exit(exitcode)
        cause = likely_cause(exitcode, worker.messages)
        # It answers in order: it answered the first ``lost`` outstanding tasks (the
        # answers were lost) and died on a later one, or idle. Its mark names the task
        # it was fetching (it may be past the first unanswered one when answers sent
        # after it were lost too): only that batch is to blame.
        unanswered = self._unanswered(process)[lost:]
        at = next((i for i, (w, t) in enumerate(unanswered) if fetch_mark(t.key, w, self.count) == mark), 0)
        slot, task = unanswered[at] if unanswered else (self.hosted[process][0], None)
        fetching = task is not None and mark == fetch_mark(task.key, slot, self.count)
        what = self._describe(slot, task, fetching)
        if fetching or (exitcode or 0) > 0:
            # A worker that exits with a code before taking a task killed itself (an
            # import that fails under spawn, os._exit in worker_init_fn): that repeats.
            key = (self.epoch, slot, task.key if fetching and task is not None else None)
            self.crashes[key] = self.crashes.get(key, 0) + 1
            if self.crashes[key] > self.max_retries:
                self._give_up(worker, slot, what, how, cause, self.crashes[key], task if fetching else None)
                hosted = [self.slots[w] for w in self.hosted[process]]
                if all(state.failed is not None and not state.outstanding for state in hosted):
                    return  # nothing more is asked of this process
            retry = f"retry {self.crashes[key]} of {self.max_retries}"
        else:
            retry = "not counted against any batch (it had not started one)"
        self.storm[process] += 1
        delay_s = 0.0
        if self.storm[process] > 1:
            delay_s = min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (self.storm[process] - 2))
        said = "" if self.slots[slot].failed is not None else f"{self._name(slot)} (pid {worker.pid}) {how} while {what}{cause}"
        self.respawn_due[process] = (time.monotonic() + delay_s, said, retry)
        if delay_s == 0:
            self._respawn_when_due()

    def _name(self, slot: int) -> str:
        if self.processes == self.count:
            return f"worker {slot}"
        return f"worker process {slot % self.processes} (hosting logical worker {slot})"

    def _give_up(
        self, worker: WorkerProcess, slot: int, what: str, how: str, cause: str, times: int,
        task: Task | None,
    ) -> None:
        retries = self.max_retries
        error = WorkerCrashedError(
            f"{torch_wording(worker.pid, worker.process.exitcode)} "
            f"{self._name(slot)} (pid {worker.pid}) {how} while {what}{cause}, {times} times in "
            f"a row; gave up after {retries} respawn(s) (max_worker_retries={retries}). "
            + ("The batch likely holds a sample that crashes the dataset code; "
               "state_dict() still resumes at this batch" if task is not None else
               "The worker cannot start")
        )
        if task is None:
            raise error
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
                warnings.warn(
                    f"{said}; respawned as pid {new.pid} from its snapshot, {retry}",
                    WorkerRespawnedWarning,
                    stacklevel=user_stacklevel(),
                )

    def _describe(self, slot: int, task: Task | None, fetching: bool) -> str:
        if task is None:
            return f"idle in epoch {self.epoch}"
        if self.iterable:
            batch = f"its batch {task.key} of epoch {self.epoch}"
        else:
            batch = f"batch {task.key} of epoch {self.epoch} (sample indices {short_indices(task.indices)})"
        return f"loading {batch}" if fetching else f"starting or restoring, before {batch}"
