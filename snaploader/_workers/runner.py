"""What the iterator drives: W slots, one per logical worker, that take tasks and give
results in order. A slot is always a logical worker; worker processes go by their
index in the pool (``_workers/pool.py``), and one may host several slots.

Two implementations share this interface, so the iterator has no special case for
``num_workers=0``: :class:`~snaploader._workers.process_runner.ProcessRunner` (worker
processes, ``_workers/process_runner.py``) and
:class:`~snaploader._workers.inline_runner.InlineRunner` (the slots run in the main
process, ``_workers/inline_runner.py``); with ``pin_memory=True`` the worker processes'
runner is :class:`~snaploader._workers.pinning.PinningRunner`, which receives and pins
in a thread (``_workers/pinning.py``).

Per slot, this epoch: ``outstanding`` tasks were sent and not answered; ``received``
answers wait to be yielded. Answers are accepted strictly in the order the tasks were
sent, so a slot's ledger stays contiguous whatever the timing, and whatever order the
iterator takes the slots in (``in_order=False`` takes whichever is :meth:`Runner.ready`,
``_epoch/dispatch.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .._errors import WorkerCrashedError
from .._state.ledger import EpochProgress
from .._rng.objects import RngCensus
from .messages import Kind, Result, Task
from .._state.records import Resume, Snapshot


class RunnerClosed(Exception):
    """The runner was closed by another thread while this one waited on it (a
    ``load_state_dict()`` that invalidates the iterator): the iterator turns it into
    the error its ``next()`` documents."""


@dataclass
class Slot:
    """Per worker slot, this epoch: tasks sent and not answered, answers not yet yielded."""

    outstanding: deque[Task] = field(default_factory=deque)
    received: deque[tuple[Task, Result]] = field(default_factory=deque)
    sent: int = 0  # iterable: tasks sent this epoch (the worker-local batch key)
    done: bool = False  # iterable: its "exhausted" reply arrived; send nothing more
    failed: WorkerCrashedError | None = None  # raised when its next batch is due
    # Per received answer: the fds its tensors hold in this process (NOTE [ fd budget ]).
    held_fds: deque[int] = field(default_factory=deque)
    # How many of the oldest received answers are pinned (only a pinning runner pins).
    pinned: int = 0

    def pop(self) -> tuple[Task, Result, int]:
        """The oldest received answer, its task, and the fds it holds."""
        task, result = self.received.popleft()
        self.pinned = max(0, self.pinned - 1)
        return task, result, self.held_fds.popleft()


class Runner(ABC):
    """Worker slots that answer :class:`Task` messages in order, one Result each."""

    def __init__(self, logical: int) -> None:
        # The logical worker count these slots were started for (0: the main-process
        # contract, one slot).
        self.logical = logical
        self.count = max(1, logical)  # slots: one per logical worker (NOTE [ logical workers ])
        self.slots = [Slot() for _ in range(self.count)]
        self.progress: EpochProgress | None = None
        self.census: RngCensus | None = None  # the loader's view of the workers' generators

    def begin_epoch(self, progress: EpochProgress) -> None:
        """Forget the last epoch's tasks; ``progress`` is the ledger of the new one."""
        self.progress = progress
        self.slots = [Slot() for _ in range(self.count)]

    def busy(self) -> bool:
        """True while a slot still owes answers (an epoch abandoned midway)."""
        return any(slot.outstanding or slot.failed for slot in self.slots)

    def send(self, slot: int, msg: Resume | Task) -> None:
        if isinstance(msg, Task):
            if self.slots[slot].failed is not None:
                return  # after a poison batch: the iterator raises before this is due
            self.slots[slot].outstanding.append(msg)
        self._transmit(slot, msg)

    def accept(self, slot: int, result: Result, fds: int = 0) -> None:
        """Take ``result``, the answer to ``slot``'s oldest outstanding task, holding
        ``fds`` file descriptors in this process until it is yielded."""
        state = self.slots[slot]
        task = state.outstanding.popleft()
        if task.key != result.key:
            raise RuntimeError(
                f"worker {slot} answered task {result.key} where task {task.key} was due; "
                "the worker protocol is broken (please report this)"
            )
        if result.kind is Kind.EXHAUSTED:
            if state.done:
                return  # replies to tasks sent before the first "exhausted" arrived
            state.done = True
        elif state.done:
            return
        state.received.append((task, result))
        state.held_fds.append(fds)
        report, census = result.snapshot.report, self.census
        if report is not None and census is not None:
            self._later(lambda: census.note(slot, report))

    def _later(self, call: Callable[[], None]) -> None:
        """Run ``call``, which may warn, on the thread that drives this runner (a
        runner that receives in a thread of its own queues it until then)."""
        call()

    @abstractmethod
    def _transmit(self, slot: int, msg: Resume | Task) -> None:
        """Deliver ``msg`` to the worker of ``slot``."""

    @abstractmethod
    def next_result(self, slot: int) -> tuple[Task, Result]:
        """The answer to ``slot``'s oldest outstanding task; waits for it."""

    def ready(self, slot: int) -> bool:
        """True when :meth:`next_result` of ``slot`` returns (or raises) at once: an
        answer can be taken, or its failed batch is due."""
        state = self.slots[slot]
        return self.takes(state) or (state.failed is not None and not state.outstanding and not state.received)

    def takes(self, state: Slot) -> bool:
        """True when ``state``'s oldest answer can be taken (a pinning runner: and is pinned)."""
        return bool(state.received)

    @abstractmethod
    def wait_any(self, first: int) -> None:
        """Wait until some slot is :meth:`ready`; ``first`` is the one the fixed order
        would take (the fd budget always lets its answers in; run in the main process,
        it is the one run)."""

    def own_epoch_start(self) -> Snapshot | None:
        """Under the main-process contract, the epoch-start state of a dataset that has
        the state protocol and is iterated itself (its state then carries across
        epochs, as in torch, so a checkpoint must hold it), as taken when the epoch's
        Resume was sent; None otherwise."""
        return None

    def poll(self) -> None:
        """Take the answers that have already arrived, without waiting."""

    @abstractmethod
    def settle(self, timeout_s: float) -> None:
        """Take the answers still owed (instant "exhausted" replies at an iterable's
        end), so that persistent workers start the next epoch idle."""

    @abstractmethod
    def close(self) -> None:
        """Stop the workers. Never blocks for long; safe to call twice."""

    @property
    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The pids of the live worker processes (empty in the main process's runner)."""
