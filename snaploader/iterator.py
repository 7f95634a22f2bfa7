"""The main process's side of an epoch: dispatcher, receiver, ledger, crash recovery.

```
  IndexPlan ──indices──► dispatcher ──Task──► worker k mod W (map-style)
                                    ──Task──► every live worker (iterable)
  receiver: Pool.wait(result pipes + sentinels)
      ├─ Result ──► per-slot FIFO of received batches
      └─ death  ──► keep complete results, respawn from the last received snapshot,
                    re-send the outstanding tasks (bounded retries per batch)
  __next__: takes the next batch in the fixed order, records its snapshot in the
            ledger (EpochProgress), tops up the dispatcher, returns the batch.
```

- Order is decided by data, never timing: map-style batch k comes from worker
  k mod W; iterable batches come round-robin from the workers not yet exhausted,
  and a worker counts as exhausted only when its own "exhausted" reply, or the short
  batch its iterator ran dry in, is reached (both are data, not timing).
- ``timeout > 0`` bounds each wait for a batch, as in torch. Otherwise the receiver
  waits on pipes and sentinels together, so it wakes on either a result or a death.
- ``num_workers=0`` runs the same :class:`WorkerRuntime` in this process, as worker 0
  of a one-worker loader, with the process's RNG states swapped out around each call.
"""

from __future__ import annotations

import pickle
import contextlib
import os
import sys
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field, fields, replace
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Final

import cloudpickle
import torch
from torch.utils.data._utils import pin_memory as torch_pin_memory
from torch.utils.data._utils import worker as torch_worker

from .errors import ReplayRefusedError, WorkerCrashedError, WorkerRespawnedWarning
from .ledger import EpochProgress, WorkerLedger, replay_without_protocol, resume_from
from .plan import IndexPlan, RngSource, epoch_aware_part
from .pool import Pool, WorkerProcess, describe_exit
from .snapshot import Snapshot, capture_rng, restore_rng
from .worker import (
    BATCH,
    ERROR,
    EXHAUSTED,
    Result,
    Resume,
    Task,
    WorkerError,
    WorkerRuntime,
    WorkerSetup,
    replay_message,
    set_worker_info,
    worker_main,
)

if TYPE_CHECKING:
    from .loader import DataLoader

_LIKELY_CAUSE: Final = {
    "SIGKILL": "often the out-of-memory killer",
    "SIGSEGV": "a native crash, often in a decoder or C extension",
    "SIGBUS": "a native crash, often a truncated memory-mapped file or full /dev/shm",
    "SIGABRT": "a native abort, often a failed assertion in a C extension",
}

_COLLECT_TIMEOUT_S: Final = 5.0

_CALLED_EXIT: Final = (
    "the worker process called exit(): sys.exit() or os._exit() in dataset code, or "
    "a library that gave up"
)

_NEVER_STARTED: Final = (
    "it died before sending anything, which usually means it failed to start: its "
    "stderr above says why; under spawn or forkserver the main module must be "
    "importable and guard its code with if __name__ == '__main__'"
)

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first caller outside
    snaploader (the user's ``iter()`` or ``next()``), however deep we are."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _PACKAGE_DIR:
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


@dataclass(frozen=True)
class EpochStart:
    """How the next epoch begins: fresh, or restored from a checkpoint."""

    epoch: int
    restore_rng: bytes | None = None  # the epoch-start RNG state to replay (a restore)
    base_seed: int | None = None  # a restore's, or persistent workers' earlier seed
    draw_base_seed: bool = True
    yielded: int = 0
    turn: int = 0
    workers: list[WorkerLedger] | None = None
    sampler_state: Any = None
    sampler_epoch: int | None = None


@dataclass(frozen=True)
class LoaderView:
    """The loader settings an iterator reads. A copy, not the loader: a loader with
    persistent workers holds its iterator, and an iterator holding the loader back
    would make a cycle that only the cyclic gc frees, leaving workers running after
    ``del loader``; and ``for b in DataLoader(...)`` must work with no loader left."""

    dataset: Any
    _index_sampler: Any
    _iterable: bool
    _auto_collation: bool
    _context: Any
    _pin_memory_active: bool
    _pin_device: str | None
    _IterableDataset_len_called: int | None
    num_workers: int
    prefetch_factor: int | None
    timeout: float
    persistent_workers: bool
    generator: torch.Generator | None
    batch_size: int | None
    drop_last: bool
    collate_fn: Any
    worker_init_fn: Any
    snapshot_every: int
    replay: str
    max_worker_retries: int

    @staticmethod
    def of(loader: DataLoader) -> LoaderView:
        return LoaderView(**{f.name: getattr(loader, f.name) for f in fields(LoaderView)})


@dataclass
class _Slot:
    """Per worker, this epoch: tasks sent and not answered, answers not yet yielded."""

    outstanding: deque[Task] = field(default_factory=deque)
    received: deque[tuple[Task, Result]] = field(default_factory=deque)
    sent: int = 0  # iterable: tasks sent this epoch (the worker-local batch key)
    done: bool = False  # iterable: its "exhausted" reply arrived; send nothing more
    failed: WorkerCrashedError | None = None  # raised when its next batch is due


class SnapIterator:
    """Iterator over one loader's batches; persistent workers reuse it across epochs."""

    def __init__(self, loader: DataLoader, start: EpochStart) -> None:
        self.loader = LoaderView.of(loader)
        self.iterable = loader._iterable
        self.num_workers = loader.num_workers
        self.slots_count = max(1, loader.num_workers)
        self.prefetch: int = loader.prefetch_factor or 1 if loader.num_workers > 0 else 1
        self.timeout_s = float(loader.timeout)
        self.persistent = loader.persistent_workers
        self.rng_source = RngSource(loader.generator)
        self.pin = loader._pin_memory_active
        self.pool: Pool | None = None
        self._pool_finalizer: weakref.finalize | None = None
        self.inline: WorkerRuntime | None = None
        self.inline_rng = b""
        self.base_seed: int | None = None
        self.closed = False
        self.crashes: dict[tuple[int, int, int | None], int] = {}  # (epoch, slot, batch)
        self.progress: EpochProgress
        self.plan: IndexPlan | None = None
        self.start_epoch(start)

    # -- epoch start ----------------------------------------------------------------

    def start_epoch(self, start: EpochStart, owner: DataLoader | None = None) -> None:
        if owner is not None:  # a persistent iterator's next epoch: settings may have changed
            self.loader = LoaderView.of(owner)
        loader = self.loader
        sampler_with_epoch = None if self.iterable else epoch_aware_part(loader._index_sampler)
        if start.sampler_epoch is not None and sampler_with_epoch is not None:
            sampler_with_epoch.set_epoch(start.sampler_epoch)
        source = self.rng_source
        restoring = start.restore_rng is not None
        rng_start = start.restore_rng if start.restore_rng is not None else source.get_state()
        replaying = source.replaying(rng_start) if restoring else contextlib.nullcontext()
        with replaying:
            base_seed = start.base_seed
            if start.draw_base_seed or base_seed is None:
                base_seed = source.draw_base_seed()
                if restoring and start.base_seed is not None and base_seed != start.base_seed:
                    raise RuntimeError(
                        f"restoring epoch {start.epoch}: the generator state in the "
                        f"checkpoint gives base seed {base_seed}, the checkpoint says "
                        f"{start.base_seed}; the checkpoint was edited or is corrupt"
                    )
            ledgers = start.workers or [WorkerLedger() for _ in range(self.slots_count)]
            self.progress = EpochProgress(
                epoch=start.epoch,
                rng_kind=source.kind,
                rng_start=rng_start,
                base_seed=base_seed,
                drew_base_seed=start.draw_base_seed,
                workers=ledgers,
                yielded=start.yielded,
                turn=start.turn,
                sampler_epoch=None if sampler_with_epoch is None else int(sampler_with_epoch.epoch),
                plan_skip=start.yielded,
            )
            self._ready_workers(base_seed)
            # The sampler draws after the workers exist, as in torch: forked workers then
            # do not each inherit a copy of the epoch's index list.
            if not self.iterable:
                self.plan = IndexPlan(loader._index_sampler, start.yielded, start.sampler_state)
            else:
                self.plan = None
        self.progress.plan = self.plan
        self.plan_done = self.plan is None
        self.dispatched = start.yielded
        self._dispatch()

    def _ready_workers(self, base_seed: int) -> None:
        """Start the workers (or reuse persistent ones) and position each for the epoch."""
        # Persistent workers still busy with an abandoned epoch would answer old tasks
        # first; start them afresh from the ledger instead.
        busy = any(slot.outstanding or slot.failed for slot in getattr(self, "slots", ()))
        self.slots = [_Slot() for _ in range(self.slots_count)]
        self._warn_or_refuse_replay()
        no_workers = self.pool is None and self.inline is None
        if busy or no_workers or self.base_seed != base_seed:
            self._stop_workers()
            self.base_seed = base_seed
            self._start_workers()
        else:
            # Persistent workers: put each at its epoch-start state explicitly, so a
            # worker respawned last epoch cannot drift from the ledger.
            for slot in range(self.slots_count):
                self._send(slot, self._resume_message(slot))

    def _warn_or_refuse_replay(self) -> None:
        # Once per restore: only a restored epoch start has workers mid-epoch. A refusal
        # normally comes earlier, from load_state_dict.
        replays = [replay_without_protocol(ledger) for ledger in self.progress.workers]
        if not any(replays):
            return
        refused = self.loader.replay == "refuse"
        message = replay_message(self.loader.dataset, replays, refused=refused)
        if refused:
            raise ReplayRefusedError(message)
        if self.loader.replay == "warn":
            warnings.warn(message, UserWarning, stacklevel=_user_stacklevel())

    def _setup(self) -> WorkerSetup:
        loader = self.loader
        return WorkerSetup(
            dataset=loader.dataset,
            iterable=self.iterable,
            auto_collation=loader._auto_collation,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            collate_fn=loader.collate_fn,
            worker_init_fn=loader.worker_init_fn,
            num_workers=self.slots_count,
            base_seed=self.base_seed or 0,
            state_every=loader.snapshot_every,
        )

    def _start_workers(self) -> None:
        setup = self._setup()
        if self.num_workers == 0:
            # NOTE [ collate in the main process ]: torch's default_collate allocates its
            # output in shared memory whenever get_worker_info() answers; here that would
            # hold an fd and /dev/shm space per live batch, so collate runs without it.
            setup = replace(setup, collate_fn=_collate_outside_worker(setup.collate_fn))
            self.inline = WorkerRuntime(setup, 0, copy_state=True)
            self._inline_call(self.inline.initialize)
        else:
            context = self.loader._context
            payload: WorkerSetup | bytes = setup
            if context.get_start_method() != "fork":
                payload = cloudpickle.dumps(setup)
            self.pool = Pool(context, self.num_workers, worker_main, lambda slot: (payload, slot))
            # NOTE [ shutdown under gc ]: a persistent iterator and its loader form a
            # cycle. The cyclic gc may run the pipes' own __del__ (which closes their fds
            # but keeps the numbers) before ours, and our close() would then close fd
            # numbers that may be reused already. Weakref callbacks run before any
            # __del__, so the pool is shut down from one.
            self._pool_finalizer = weakref.finalize(self, self.pool.shutdown)
            for slot in range(self.num_workers):
                self.pool.start(slot)
        for slot in range(self.slots_count):
            self._send(slot, self._resume_message(slot))

    def _resume_message(self, slot: int, *, received: bool = False) -> Resume:
        """Where worker ``slot`` must stand: after its last yielded batch, or with
        ``received``, after its last received one (for a respawn)."""
        ledger = self.progress.workers[slot]
        at, at_complete = ledger.yielded, ledger.yielded_complete
        if received:
            for _, result in self.slots[slot].received:
                at = result.snapshot
                if at.complete:
                    at_complete = at
        return resume_from(ledger.epoch_start, at, at_complete)

    # -- dispatch ------------------------------------------------------------------

    def _send(self, slot: int, msg: Resume | Task) -> None:
        if isinstance(msg, Task):
            if self.slots[slot].failed is not None:
                return  # after a poison batch: the iterator raises before this is due
            self.slots[slot].outstanding.append(msg)
        self._transmit(slot, msg)

    def _transmit(self, slot: int, msg: Resume | Task) -> None:
        if self.inline is not None:
            if isinstance(msg, Resume):
                self._inline_call(lambda: self.inline.resume(msg))  # type: ignore[union-attr]
            return
        assert self.pool is not None
        worker = self.pool.workers[slot]
        assert worker is not None
        try:
            # A tensor in a dataset's state would travel through shared memory, and
            # sending one starts multiprocessing's resource sharer (a listener thread
            # and socket) in this process for good. A Resume is rare: send it by value.
            worker.send(pickle.dumps(msg) if isinstance(msg, Resume) else msg)
        except OSError:
            pass  # it died; the receiver sees its sentinel and re-sends what is outstanding

    def _dispatch(self) -> None:
        if self.iterable:
            for slot, state in enumerate(self.slots):
                if self.progress.workers[slot].exhausted or state.failed is not None:
                    continue
                while not state.done and len(state.outstanding) < self.prefetch:
                    self._send(slot, Task(state.sent, None))
                    state.sent += 1
            return
        assert self.plan is not None
        limit = self.progress.yielded + self.prefetch * self.slots_count
        while not self.plan_done and self.dispatched < limit:
            indices = self.plan.take()
            if indices is None:
                self.plan_done = True
                break
            self._send(self.dispatched % self.slots_count, Task(self.dispatched, indices))
            self.dispatched += 1

    # -- receiving -----------------------------------------------------------------

    def _inline_call(self, fn: Any) -> Any:
        """Run ``fn`` as worker 0: its RNG states and worker info swapped in."""
        assert self.inline is not None
        main_rng = capture_rng()
        main_info = torch_worker._worker_info
        if self.inline_rng:
            restore_rng(self.inline_rng)
        set_worker_info(self.inline.info)
        try:
            return fn()
        finally:
            self.inline_rng = capture_rng()
            restore_rng(main_rng)
            set_worker_info(main_info)

    def _await(self, slot: int) -> tuple[Task, Result]:
        state = self.slots[slot]
        if self.inline is not None:
            if not state.received:
                task = state.outstanding[0]
                result = self._inline_call(lambda: self.inline.run(task))  # type: ignore[union-attr]
                self._accept(slot, result)
            return state.received.popleft()
        assert self.pool is not None
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else None
        while not state.received:
            if state.failed is not None and not state.outstanding:
                self.close()
                raise state.failed
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._pump(wait_s)
            if not state.received and deadline is not None and time.monotonic() >= deadline:
                waited = self.pool.workers[slot]
                pid = waited.pid if waited is not None else "?"
                raise RuntimeError(
                    f"DataLoader timed out after {self.loader.timeout} seconds waiting for "
                    f"worker {slot} (pid {pid}) to produce batch "
                    f"{state.outstanding[0].key if state.outstanding else '?'} of epoch "
                    f"{self.progress.epoch}; raise timeout= or make the dataset faster"
                )
        return state.received.popleft()

    def _pump(self, wait_s: float | None) -> None:
        """Wait up to ``wait_s`` for results or deaths, and handle what came."""
        assert self.pool is not None
        readable, exited = self.pool.wait(wait_s)
        for worker in readable:
            self._receive(worker)
        for worker in exited:
            self._on_death(worker)

    def _accept(self, slot: int, result: Result) -> None:
        state = self.slots[slot]
        task = state.outstanding.popleft()
        assert task.key == result.key, (task.key, result.key)
        if result.kind == EXHAUSTED:
            if state.done:
                return  # replies to tasks sent before the first "exhausted" arrived
            state.done = True
        elif state.done:
            return
        state.received.append((task, result))

    def _receive(self, worker: WorkerProcess) -> None:
        assert self.pool is not None
        if not self.pool.holds(worker):
            return
        lost = self._drain(worker, 0)
        if lost:
            self._on_death(worker, lost)

    def _drain(self, worker: WorkerProcess, lost: int) -> int:
        """Accept, in order, every complete result waiting in ``worker``'s pipe; return
        how many could not be read (``lost`` of them before this call). A result whose
        shared memory can no longer be opened because its sender died counts as never
        received, and so does every result after it: results are accepted in the order
        they were sent or not at all."""
        try:
            while worker.result.poll():
                blob = worker.result.recv_bytes()
                worker.messages += 1
                if lost:
                    lost += 1
                    continue
                try:
                    result = ForkingPickler.loads(blob)
                except Exception:
                    lost += 1
                    continue
                self._accept(worker.slot, result)
        except (EOFError, OSError):
            pass  # a torn last message: it died while sending; its sentinel tells
        return lost

    def _on_death(self, worker: WorkerProcess, lost: int = 0) -> None:
        assert self.pool is not None
        if not self.pool.holds(worker):
            return  # already handled (seen both as a broken pipe and as a sentinel)
        slot = worker.slot
        lost = self._drain(worker, lost)  # keep every complete result it sent
        if worker.process.is_alive():
            worker.process.kill()
        self.pool.discard(slot)
        how = describe_exit(worker.process.exitcode)
        state = self.slots[slot]
        # It answers in order: it answered the first ``lost`` outstanding tasks (the
        # answers were lost) and died on the next one, or idle.
        task = state.outstanding[lost] if len(state.outstanding) > lost else None
        batch = None if task is None else task.key
        key = (self.progress.epoch, slot, batch)
        self.crashes[key] = self.crashes.get(key, 0) + 1
        retries = self.loader.max_worker_retries
        what = self._describe_batch(task)
        signal_name = how.rsplit(" ", 1)[-1]
        cause = _LIKELY_CAUSE.get(signal_name, "")
        exitcode = worker.process.exitcode or 0
        if not cause and exitcode >= 0:
            cause = _CALLED_EXIT
            if worker.messages == 0 and exitcode > 0:
                cause = f"{cause}; or {_NEVER_STARTED}"
        cause_text = f" ({cause})" if cause else ""
        if self.crashes[key] > retries:
            error = WorkerCrashedError(
                f"worker {slot} (pid {worker.pid}) {how} while loading {what}"
                f"{cause_text}, {self.crashes[key]} times in a row; gave up after "
                f"{retries} respawn(s) (max_worker_retries={retries}). The batch likely "
                "holds a sample that crashes the dataset code; state_dict() still "
                "resumes at this batch"
            )
            if task is None:
                self.close()
                raise error
            # NOTE [ poison batch ]: raise when the failed batch is due (_await), not
            # now, so that every batch before it is still yielded and state_dict() then
            # points at it. Only the tasks before it are produced again, by a new
            # process, because their results may have been lost with this one.
            state.failed = error
            while len(state.outstanding) > lost:
                state.outstanding.pop()
            if not state.outstanding:
                return
        self.pool.start(slot)
        self._transmit(slot, self._resume_message(slot, received=True))
        for pending in state.outstanding:
            self._transmit(slot, pending)
        new = self.pool.workers[slot]
        assert new is not None
        if state.failed is not None:
            return
        warnings.warn(
            f"worker {slot} (pid {worker.pid}) {how} while loading {what}{cause_text}; "
            f"respawned as pid {new.pid} from its snapshot, retry {self.crashes[key]} of "
            f"{retries}",
            WorkerRespawnedWarning,
            stacklevel=_user_stacklevel(),
        )

    def _describe_batch(self, task: Task | None) -> str:
        epoch = self.progress.epoch
        if task is None:
            return f"nothing (idle) in epoch {epoch}"
        if self.iterable:
            return f"its batch {task.key} of epoch {epoch}"
        return f"batch {task.key} of epoch {epoch} (sample indices {_short(task.indices)})"

    # -- yielding ------------------------------------------------------------------

    def __iter__(self) -> SnapIterator:
        return self

    def __next__(self) -> Any:
        if self.closed or self.progress.ended:
            raise StopIteration
        found = self._next_result()
        if found is None:
            self._end_epoch()
            raise StopIteration
        task, result = found
        progress = self.progress
        progress.workers[self._last_slot].record(result.snapshot)
        progress.yielded += 1
        self._dispatch()
        if result.kind == ERROR:
            assert isinstance(result.payload, WorkerError)
            where = self._where(self._last_slot, task)
            raise result.payload.rebuild(where)
        if self.iterable:
            self._check_reported_length()
        data = result.payload
        if self.pin:
            data = torch_pin_memory.pin_memory(data, self.loader._pin_device)
        return data

    def _check_reported_length(self) -> None:
        # torch's warning, in torch's words: len(loader) was asked of an iterable
        # dataset, and more batches than that came.
        reported = self.loader._IterableDataset_len_called
        yielded = self.progress.yielded
        if reported is None or yielded <= reported:
            return
        message = (
            f"Length of IterableDataset {self.loader.dataset} was reported to be {reported}"
            f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
        )
        if self.num_workers > 0:
            message += (
                "For multiprocessing data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker. Please see "
                "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
            )
        warnings.warn(message, stacklevel=_user_stacklevel())

    def _next_result(self) -> tuple[Task, Result] | None:
        progress = self.progress
        if not self.iterable:
            if self.plan_done and progress.yielded >= self.dispatched:
                return None
            self._last_slot = progress.yielded % self.slots_count
            return self._await(self._last_slot)
        while not all(ledger.exhausted for ledger in progress.workers):
            slot = progress.turn
            if progress.workers[slot].exhausted:
                progress.turn = (slot + 1) % self.slots_count
                continue
            task, result = self._await(slot)
            # Only now: when _await raises (a poison batch, a timeout), state_dict()
            # must still resume at this worker's turn.
            progress.turn = (slot + 1) % self.slots_count
            if result.kind == EXHAUSTED:
                progress.workers[slot].record(result.snapshot)
                continue
            self._last_slot = slot
            return task, result
        return None

    def _where(self, slot: int, task: Task) -> str:
        if self.num_workers == 0:
            place = "in the main process (num_workers=0)"
        else:
            place = f"in DataLoader worker process {slot}"
        epoch = self.progress.epoch
        where = f"{place} while loading batch {self.progress.yielded - 1} of epoch {epoch}"
        if not self.iterable:
            where += f" (sample indices {_short(task.indices)})"
        return where

    def _end_epoch(self) -> None:
        self.progress.ended = True
        if not self.persistent:
            self.close()
        else:
            self._collect_replies()

    def _collect_replies(self) -> None:
        """Take the replies to tasks an iterable's workers were sent ahead of their end
        (each is an instant "exhausted"), so that persistent workers begin the next
        epoch idle instead of being restarted as busy (see start_epoch)."""
        if self.pool is None:
            return
        deadline = time.monotonic() + _COLLECT_TIMEOUT_S
        while any(state.outstanding for state in self.slots):
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                return  # start_epoch restarts them from the ledger: slower, still exact
            self._pump(left_s)

    # -- state and shutdown --------------------------------------------------------

    def _stop_workers(self) -> None:
        if self.pool is not None:
            if self._pool_finalizer is not None:
                self._pool_finalizer.detach()
            self.pool.shutdown()
            self.pool = None
        self.inline = None
        self.inline_rng = b""

    def close(self) -> None:
        """Stop the workers; the iterator yields nothing more."""
        self.closed = True
        self._stop_workers()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _collate_outside_worker(collate_fn: Any) -> Any:
    def collate(batch: Any) -> Any:
        info = torch_worker._worker_info
        set_worker_info(None)
        try:
            return collate_fn(batch)
        finally:
            set_worker_info(info)

    return collate


def _short(indices: Any, limit: int = 16) -> str:
    if isinstance(indices, (list, tuple)) and len(indices) > limit:
        return f"{list(indices[:limit])}... ({len(indices)} in all)"
    return repr(indices)
