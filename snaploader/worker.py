"""What runs in a worker: seeding, fetching, the snapshot after every batch.

Protocol (one task pipe in, one result pipe out, per worker; see ``pool.py``):

- main -> worker: a :class:`Resume` first in every epoch (and first of all after a
  respawn; pickled to bytes, so a tensor in it travels by value), then :class:`Task`
  messages, then ``None`` to stop. Tasks are answered in the order they were sent, one
  :class:`Result` each.
- worker -> main: a :class:`Result` carries the batch (or the worker's exception, or the
  news that an iterable dataset ran dry) and the :class:`~snaploader.snapshot.Snapshot`
  taken right after it. Tensors go through shared memory (torch's reductions on
  ``multiprocessing``'s pickler); the worker stays alive until told to stop, so the
  main process can always open what it was sent.
- A worker exits on ``None``, on end-of-file of its task pipe, or when its parent is
  gone (checked whenever it has waited ``_WATCHDOG_INTERVAL_S`` without a task). It
  never blocks forever: sends block only while the main process is alive to read.

The same :class:`WorkerRuntime` also runs in the main process for ``num_workers=0``,
with the main process's RNG states swapped out around each call (``iterator.py``).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Final

import cloudpickle
import numpy as np
import psutil
import torch
from torch.utils.data._utils import worker as torch_worker

from .snapshot import Snapshot, capture_rng, check_plain, restore_rng

_WATCHDOG_INTERVAL_S: Final = 1.0

BATCH: Final = "batch"
ERROR: Final = "error"
EXHAUSTED: Final = "exhausted"


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker needs besides its id; sent once per worker process."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable[[Any], Any]
    worker_init_fn: Callable[[int], None] | None
    num_workers: int
    base_seed: int
    state_every: int


@dataclass(frozen=True, slots=True)
class Resume:
    """Position the worker for an epoch: restore ``base`` (None: keep the current state,
    i.e. the fresh seed state or, for persistent workers, where the last epoch left it),
    set the epoch position to ``base_produced``, replay ``replay`` batches, and finally
    set the RNGs to ``final_rng`` when given. ``new_epoch`` says that ``base`` is the
    state at an epoch start, so an iterator-level state in it belongs to the last epoch.
    ``exhausted``: the worker has produced its last batch of the epoch (nothing is
    replayed then; it answers every task with "exhausted")."""

    base: Snapshot | None
    base_produced: int
    replay: int
    final_rng: bytes | None
    new_epoch: bool
    exhausted: bool = False


@dataclass(frozen=True, slots=True)
class Task:
    """Produce one batch. ``key`` is the global batch index (map-style) or the worker's
    own batch count (iterable); ``indices`` are the sample indices (map-style only)."""

    key: int
    indices: Any


@dataclass(frozen=True)
class WorkerError:
    """An exception raised by user code in a worker, ready to be raised again."""

    pickled: bytes | None
    type_name: str
    formatted: str

    @staticmethod
    def capture(exc: BaseException) -> WorkerError:
        formatted = "".join(traceback.format_exception(exc))
        pickled: bytes | None
        try:
            blob: bytes = cloudpickle.dumps(exc)
            pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
            pickled = blob
        except Exception:
            pickled = None
        return WorkerError(pickled, type(exc).__qualname__, formatted)

    def rebuild(self, where: str) -> BaseException:
        """The original exception (or a RuntimeError when it cannot be rebuilt), with a
        note naming ``where`` it happened and the worker's traceback."""
        note = f"Caught {self.type_name} {where}.\nOriginal {self.formatted}"
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception:
                exc = None
        if exc is None:
            return RuntimeError(note)
        exc.add_note(note)
        return exc


@dataclass(frozen=True, slots=True)
class Result:
    key: int
    kind: str  # BATCH | ERROR | EXHAUSTED
    payload: Any
    snapshot: Snapshot


def has_state_protocol(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def seed_like_torch(base_seed: int, worker_id: int) -> int:
    """Seed the three global RNGs exactly as torch seeds worker ``worker_id``."""
    seed = base_seed + worker_id
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


def set_worker_info(info: torch_worker.WorkerInfo | None) -> None:
    # torch.utils.data.get_worker_info() and snaploader.get_worker_info() read this.
    torch_worker._worker_info = info


class WorkerRuntime:
    """Produces the batches of one worker slot and the snapshot after each."""

    def __init__(self, setup: WorkerSetup, worker_id: int, *, copy_state: bool) -> None:
        self.setup = setup
        self.worker_id = worker_id
        self.dataset = setup.dataset
        # In the main process a state_dict() may alias live objects; copy it there.
        self.copy_state = copy_state
        if copy_state and setup.iterable:
            # A worker process iterates its own copy of the dataset, fresh each epoch;
            # so does num_workers=0, or an iterable that changes its own attributes
            # would carry them into the next epoch, which no checkpoint records.
            try:
                self.dataset = copy.deepcopy(setup.dataset)
            except Exception:
                pass  # uncopyable (a lock, a socket): iterate it in place, as torch does
        self.info: torch_worker.WorkerInfo | None = None
        self.pending_error: WorkerError | None = None
        self.iterator: Iterator[Any] | None = None
        self.ended = False
        self.exhausted = False
        self.produced = 0
        self.checked_plain = False
        self.seed_rng: bytes | None = None  # RNG states right after seeding

    # -- start-up and positioning -------------------------------------------------

    def initialize(self) -> None:
        """Seed as torch does, publish the worker info, run ``worker_init_fn``."""
        seed = seed_like_torch(self.setup.base_seed, self.worker_id)
        self.seed_rng = capture_rng()
        self.info = torch_worker.WorkerInfo(
            id=self.worker_id,
            num_workers=self.setup.num_workers,
            seed=seed,
            dataset=self.dataset,
        )
        set_worker_info(self.info)
        if self.setup.worker_init_fn is not None:
            try:
                self.setup.worker_init_fn(self.worker_id)
            except Exception as exc:
                self.pending_error = WorkerError.capture(exc)

    def resume(self, msg: Resume) -> None:
        base = msg.base
        self.ended = self.exhausted = False
        self.checked_plain = False
        # iter(dataset) may draw from the global RNGs (a shuffle seed, say). Mid-epoch,
        # that draw happened before ``base`` was taken, so the RNGs are restored after
        # the iterator is made; at an epoch start it comes after ``base``, so before.
        mid_epoch = None if msg.new_epoch else base
        if base is not None:
            if mid_epoch is None:
                restore_rng(base.rng, self.seed_rng)
            if base.data_owner == "dataset" and base.complete:
                self.dataset.load_state_dict(self._copied(base.data))
        self.produced = msg.base_produced
        if self.setup.iterable:
            try:
                self.iterator = iter(self.dataset)
                if mid_epoch is not None and mid_epoch.data_owner == "iterator" and mid_epoch.complete:
                    self.iterator.load_state_dict(self._copied(mid_epoch.data))  # type: ignore[union-attr]
            except Exception as exc:
                self.pending_error = WorkerError.capture(exc)
                self.iterator = iter(())
        if mid_epoch is not None:
            restore_rng(mid_epoch.rng, self.seed_rng)
        if self.setup.iterable:
            for _ in range(msg.replay):
                self._replay_one()
        if msg.final_rng is not None:
            restore_rng(msg.final_rng, self.seed_rng)
        if msg.exhausted:
            self.exhausted = True

    def _replay_one(self) -> None:
        try:
            self._fetch_iterable()
        except StopIteration:
            self.exhausted = True
        except Exception:  # the original run raised here too and went on
            pass
        self.produced += 1

    # -- producing ----------------------------------------------------------------

    def run(self, task: Task) -> Result:
        if self.exhausted:
            return Result(task.key, EXHAUSTED, None, self.snapshot())
        kind = BATCH
        payload: Any
        if self.pending_error is not None:
            kind, payload, self.pending_error = ERROR, self.pending_error, None
        else:
            try:
                if self.setup.iterable:
                    payload = self._fetch_iterable()
                else:
                    payload = self._fetch_map(task.indices)
            except StopIteration as exc:
                if self.setup.iterable:
                    self.exhausted = True
                    return Result(task.key, EXHAUSTED, None, self.snapshot())
                kind, payload = ERROR, WorkerError.capture(exc)
            except Exception as exc:
                kind, payload = ERROR, WorkerError.capture(exc)
        self.produced += 1
        try:
            snapshot = self.snapshot()
        except Exception as exc:
            # A state_dict() that raises or returns non-plain data is the user's error:
            # report it like one raised in __getitem__, not as a worker crash.
            bare = Snapshot(capture_rng(self.seed_rng), self.produced, complete=not self.setup.iterable)
            return Result(task.key, ERROR, WorkerError.capture(exc), bare)
        return Result(task.key, kind, payload, snapshot)

    def _fetch_map(self, indices: Any) -> Any:
        setup = self.setup
        if not setup.auto_collation:
            return setup.collate_fn(self.dataset[indices])
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            data = getitems(indices)
        else:
            data = [self.dataset[i] for i in indices]
        return setup.collate_fn(data)

    def _fetch_iterable(self) -> Any:
        # Mirrors torch's _IterableDatasetFetcher exactly, drop_last included.
        if self.ended:
            raise StopIteration
        assert self.iterator is not None
        setup = self.setup
        if not setup.auto_collation:
            return setup.collate_fn(next(self.iterator))
        assert setup.batch_size is not None
        data = []
        for _ in range(setup.batch_size):
            try:
                data.append(next(self.iterator))
            except StopIteration:
                self.ended = True
                break
        if not data or (setup.drop_last and len(data) < setup.batch_size):
            raise StopIteration
        return setup.collate_fn(data)

    # -- snapshots ----------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        setup = self.setup
        rng = capture_rng(self.seed_rng)
        owner: str | None = None
        if setup.iterable and has_state_protocol(self.iterator):
            owner = "iterator"
        elif has_state_protocol(self.dataset):
            owner = "dataset"
        # A batch cut short by the end of the iterator is the worker's last: torch's
        # fetcher never calls next() again after that, so neither may a restored worker.
        exhausted = self.exhausted or self.ended
        if setup.iterable:
            due = exhausted or self.produced % setup.state_every == 0
            if owner is None or not due:
                # data_owner without data: a replay from an earlier snapshot of a
                # stateful dataset (snapshot_every > 1), not one for want of the protocol
                return Snapshot(rng, self.produced, None, owner, complete=False, exhausted=exhausted)
        if owner is None:
            return Snapshot(rng, self.produced)
        source = self.iterator if owner == "iterator" else self.dataset
        data = source.state_dict()  # type: ignore[union-attr]
        if not self.checked_plain:
            check_plain(data, f"{type(source).__qualname__}.state_dict()")
            self.checked_plain = True
        return Snapshot(rng, self.produced, self._copied(data), owner, True, exhausted)

    def _copied(self, data: Any) -> Any:
        if not self.copy_state or data is None:
            return data
        # Plain data: a pickle round trip copies it several times faster than
        # deepcopy (1 ms against 6.6 ms for a 10,000-int shuffle buffer).
        return pickle.loads(pickle.dumps(data, pickle.HIGHEST_PROTOCOL))


def replay_message(dataset: Any, replays: list[int], *, refused: bool) -> str:
    """Why a resume of ``dataset`` replays ``replays[w]`` batches in worker ``w``, and
    how to avoid it; for the warning (``refused=False``) or ReplayRefusedError."""
    name = type(dataset).__qualname__
    per_worker = ", ".join(f"worker {w}: {n}" for w, n in enumerate(replays))
    what = (
        f"an exact resume of {name} replays {sum(replays)} batch(es) from the epoch "
        f"start, reading and discarding them ({per_worker}), because neither {name} nor "
        "the iterator iter(dataset) returns has state_dict()/load_state_dict()"
    )
    fix = (
        "implement state_dict()/load_state_dict() returning plain data on the iterator "
        "or the dataset to resume without reading skipped data (docs/iterable.md)"
    )
    if refused:
        return (
            f"{what}, and the loader was built with replay='refuse'. To resume, {fix}, "
            "or build the loader with replay='warn' or replay='allow'"
        )
    return (
        f"{what}. To avoid it, {fix}; replay='allow' silences this warning, "
        "replay='refuse' raises ReplayRefusedError instead"
    )


# -- the worker process ---------------------------------------------------------------

# NOTE [ small tensors by value ]
# torch shares a CPU tensor between processes by passing a file descriptor: the main
# process connects to a listener in the worker and authenticates, per tensor. That
# costs far more than copying a small tensor, so tensors up to this size travel inside
# the message. A result sent that way is also complete by itself: it stays readable
# even if its worker dies right after sending it.
_BY_VALUE_MAX_BYTES: Final = 256 * 1024


def _tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


class _ResultPickler(ForkingPickler):
    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.requires_grad
            and obj.nbytes <= _BY_VALUE_MAX_BYTES
        ):
            flat = obj.detach().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            return _tensor_from_bytes, (raw, obj.dtype, tuple(obj.shape))
        return NotImplemented


def dumps_result(result: Result) -> bytes:
    """Pickle a result for the result pipe (see NOTE [ small tensors by value ])."""
    buffer = io.BytesIO()
    _ResultPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(result)
    return buffer.getvalue()



def worker_main(
    setup: WorkerSetup | bytes,
    worker_id: int,
    task_conn: Connection,
    result_conn: Connection,
    parent_pid: int,
    inherited_fds: list[int],
) -> None:
    """Entry point of a worker process (see the module docstring for the protocol)."""
    # Ctrl-C reaches the whole process group; the main process handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Under fork we inherited the main process's ends of every other worker's pipes.
    # Holding them would keep those pipes open after their owners are gone.
    for fd in inherited_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    torch.utils.data._utils.signal_handling._set_worker_signal_handlers()
    torch.set_num_threads(1)
    if isinstance(setup, bytes):
        setup = pickle.loads(setup)
    assert isinstance(setup, WorkerSetup)
    runtime = WorkerRuntime(setup, worker_id, copy_state=False)
    runtime.initialize()
    # Under forkserver our parent process is the fork server, not the main process
    # (parent_pid): the watchdog checks that neither has gone.
    spawner_pid = os.getppid()
    parent = psutil.Process(parent_pid)
    pending: deque[Any] = deque()

    def orphaned() -> bool:
        return os.getppid() != spawner_pid or not parent.is_running()

    def watchdog() -> None:
        # The loop below checks too, but only while idle: a send can block for good on
        # a full result pipe whose read end outlives the main process (held by another
        # process it forked), and dataset code can block too. This thread cannot.
        while True:
            time.sleep(_WATCHDOG_INTERVAL_S)
            if orphaned():
                os._exit(0)

    threading.Thread(target=watchdog, name="snaploader-watchdog", daemon=True).start()

    def drain() -> bool:
        """Move every waiting message into ``pending``; False on end-of-file."""
        try:
            while task_conn.poll():
                pending.append(task_conn.recv())
        except (EOFError, OSError):
            return False
        return True

    while True:
        if not pending:
            try:
                ready = task_conn.poll(_WATCHDOG_INTERVAL_S)
            except (EOFError, OSError):
                return
            if not ready:
                if orphaned():
                    return
                continue
        if not drain() and not pending:
            return
        msg = pending.popleft()
        if msg is None:
            return
        if isinstance(msg, bytes):
            msg = pickle.loads(msg)  # a Resume, sent by value (iterator.py _transmit)
        if isinstance(msg, Resume):
            runtime.resume(msg)
            continue
        result = runtime.run(msg)
        drain()  # so the main process never blocks sending us a task while we send
        try:
            result_conn.send_bytes(dumps_result(result))
        except (BrokenPipeError, ConnectionResetError):
            return
        except Exception as exc:  # the batch could not be pickled
            error = WorkerError.capture(
                TypeError(f"the batch produced for batch {result.key} could not be "
                          f"sent to the main process: {type(exc).__name__}: {exc}")
            )
            result_conn.send(Result(result.key, ERROR, error, result.snapshot))
        del result, msg
