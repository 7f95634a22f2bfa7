"""Start, watch and stop worker processes. Knows nothing of datasets.

```
 main process                               worker process i
  WorkerProcess.task   ── task pipe ──────►  worker_main(...)
  WorkerProcess.result ◄── result pipe ────
  WorkerProcess.process.sentinel  (readable once the process has exited)
```

- One task pipe and one result pipe per worker, never a queue shared by workers: a
  worker killed while writing corrupts only its own result pipe, which is thrown away
  with it (torch's shared result queue is why torch cannot recover from a dead worker).
- :meth:`Pool.wait` waits on every result pipe and every process sentinel at once
  (``multiprocessing.connection.wait``), so a death is seen as soon as it happens, not
  at the next poll.
- Stopping never blocks forever: ``None`` is sent, the process is joined for
  ``_JOIN_TIMEOUT_S``, then terminated, then killed.
- NOTE [ inherited fds ]: a forked worker inherits every fd of the main process. It
  releases, first thing, the ones it does not own (:func:`release_inherited`): the main
  process's ends of every snaploader pipe (of every live pool: a worker holding another
  worker's result pipe would keep it open after its owner is gone, and a blocked sender
  would never see a broken pipe), and the shared memory of batches the main process
  received from snaploader workers (fds and mappings, which would otherwise pin that
  memory for the worker's lifetime). Everything else, the dataset's own files
  included, is left alone.
- :class:`FetchMarks`: one int per process in shared memory that the worker sets to the
  key of the task it is fetching and clears after, so that the main process knows,
  when a worker has died, whether it died fetching a batch (which then counts against
  that batch) or in another phase (idle, starting up, restoring: which never does), or
  before it could start at all (it never reached the worker's entry point).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import multiprocessing
import multiprocessing.util
import os
import re
import resource
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from typing import Any, Final


_JOIN_TIMEOUT_S: Final = 5.0
_KILL_TIMEOUT_S: Final = 2.0
# A worker drains its task pipe before each (possibly blocking) send of a result; a
# roomy task pipe means the main process never waits on a busy worker to send a task.
_TASK_PIPE_BYTES: Final = 1 << 20
_F_SETPIPE_SZ: Final = 1031
_SHM_DIR: Final = "/dev/shm"
# torch names the shared memory a process creates "/dev/shm/torch_<pid>_...".
_TORCH_SHM: Final = re.compile(r"torch_(\d+)_")

# Every live pool of this process, and the pid of every worker any pool of it started:
# what a forked worker must let go of (NOTE [ inherited fds ]).
_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()
_WORKER_PIDS: set[int] = set()


def _widen_pipe(conn: Connection) -> None:
    try:
        fcntl.fcntl(conn.fileno(), _F_SETPIPE_SZ, _TASK_PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size: keep the default
        pass


def remove_shm_left_by(pid: int) -> None:
    """Remove the /dev/shm entries a dead process left behind. torch names the shared
    memory a process creates ``torch_<pid>_...`` and unlinks the name right after
    creating it; a worker killed in between leaves the entry for good (kill workers
    often enough and it happens). Only a dead process's own names are touched."""
    prefix = f"torch_{pid}_"
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:
                pass


# One line per worker, so that W workers' reasons and the main process's error fit a screen.
NO_MAIN_GUARD: Final = (
    'snaploader: the script has no if __name__ == "__main__": guard; under spawn or '
    "forkserver each worker imports it again and reached code that starts DataLoader "
    "workers: put the code that builds and iterates the loader under the guard"
)


class FetchMarks:
    """One int64 per worker process (by its index in the pool), shared with the workers:
    the key of the task that process is fetching (>= 0), or the phase it is in:
    :attr:`UNSTARTED` (set by :meth:`Pool.start`; the worker has not reached its entry
    point), :attr:`STARTING` (its set-up and ``worker_init_fn``), :attr:`RESTORING`,
    :attr:`IDLE`.

    A worker writes it right before and right after each fetch (two stores into shared
    memory, well under a microsecond a batch); the main process reads it only after the
    worker has died. Under fork the memory is an anonymous shared mapping the workers
    inherit (no file descriptor at all); under spawn and forkserver it is a memfd,
    passed to each worker as multiprocessing passes a pipe, and mapped there.
    """

    IDLE: Final = -1
    STARTING: Final = -2
    UNSTARTED: Final = -3
    RESTORING: Final = -4

    def __init__(self, count: int, shareable: bool, fd: int | None = None) -> None:
        self.count = count
        size = 8 * count
        self.fd: int | None = None
        if fd is not None:  # a worker attaching to the main process's memfd
            self._map = mmap.mmap(fd, size)
            os.close(fd)
        elif shareable:
            self.fd = os.memfd_create("snaploader-fetch-marks", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, size)
            self._map = mmap.mmap(self.fd, size)
        else:
            self._map = mmap.mmap(-1, size)
        self._view: memoryview | None = memoryview(self._map).cast("q")
        if fd is None:
            # Only the main process's own copy starts all idle. A worker attaching must
            # not: its siblings may be fetching, and their marks say what a death is
            # blamed on. Pool.start() marks a process idle before starting it.
            for index in range(count):
                self._view[index] = self.IDLE

    def __reduce__(self) -> tuple[Any, ...]:
        # Only while a spawn or forkserver worker is being started: DupFd then hands
        # the fd to the new process as multiprocessing does a pipe's.
        if self.fd is None:
            raise TypeError("fork-only FetchMarks cannot be sent to another process")
        return _attach_marks, (reduction.DupFd(self.fd), self.count)

    def set(self, index: int, key: int) -> None:
        if self._view is not None:
            self._view[index] = key

    def get(self, index: int) -> int:
        return self.IDLE if self._view is None else int(self._view[index])

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
            self._map.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _attach_marks(dup: Any, count: int) -> FetchMarks:
    return FetchMarks(count, shareable=False, fd=dup.detach())


@dataclass(frozen=True)
class Inherited:
    """What a forked worker inherited and must release: the main process's pipe ends
    (``fds``), and the shared memory of tensors created by the workers ``shm_pids``."""

    fds: tuple[int, ...] = ()
    shm_pids: frozenset[int] = frozenset()


_PROT_NONE: Final = 0
_MAP_PRIVATE: Final = 0x02
_MAP_FIXED: Final = 0x10
_MAP_ANONYMOUS: Final = 0x20
_MAP_NORESERVE: Final = 0x4000


def release_inherited(inherited: Inherited) -> None:
    """Let go of what this (forked) process inherited and does not own.

    Each fd is pointed at /dev/null rather than closed, and each mapping is replaced by
    an inaccessible anonymous one rather than unmapped: this process's copy of the
    main process's objects still owns those numbers and addresses, and may close or
    unmap them later (a cyclic gc); they must not be in use by something else then.
    """
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mine = _shm_fds(inherited.shm_pids) if inherited.shm_pids else []
        for fd in (*inherited.fds, *mine):
            try:
                os.dup2(devnull, fd)
            except OSError:
                pass
    finally:
        os.close(devnull)
    if inherited.shm_pids:
        _replace_shm_mappings(inherited.shm_pids)


def shm_creator(name: str) -> int | None:
    """The pid of the process that created the /dev/shm entry ``name`` (a file name),
    when torch named it; None for any other name."""
    match = _TORCH_SHM.match(name)
    return None if match is None else int(match.group(1))


def _from_workers(path: str, pids: frozenset[int]) -> bool:
    head = _SHM_DIR + "/"
    return path.startswith(head) and shm_creator(path[len(head):]) in pids


def _shm_fds(pids: frozenset[int]) -> list[int]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if _from_workers(os.readlink(f"/proc/self/fd/{name}"), pids):
                found.append(int(name))
        except OSError:
            pass  # the directory listing's own fd, gone already
    return found


def _replace_shm_mappings(pids: frozenset[int]) -> None:
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    flags = _MAP_PRIVATE | _MAP_FIXED | _MAP_ANONYMOUS | _MAP_NORESERVE
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not _from_workers(fields[5], pids):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        libc.mmap(start, end - start, _PROT_NONE, flags, -1, 0)  # on failure: keep it


@dataclass
class WorkerProcess:
    index: int  # its place in the pool (a respawn takes the place of the dead one)
    process: multiprocessing.process.BaseProcess
    task: Connection  # main's sending end
    result: Connection  # main's receiving end

    @property
    def pid(self) -> int:
        pid = self.process.pid
        if pid is None:
            raise RuntimeError(f"worker process {self.index} was never started")
        return pid

    def send(self, msg: Any) -> None:
        self.task.send(msg)

    def close_pipes(self) -> None:
        self.task.close()
        self.result.close()


class Pool:
    """A fixed number of places for worker processes (by index), each holding at most
    one live process.

    ``target(*make_args(index), task_conn, result_conn, parent_pid, inherited, marks)``
    is the worker's entry point; it calls :func:`release_inherited` with ``inherited``.
    """

    def __init__(
        self,
        context: BaseContext,
        count: int,
        target: Callable[..., None],
        make_args: Callable[[int], tuple[Any, ...]],
    ) -> None:
        self.context = context
        self.target = target
        self.make_args = make_args
        self.workers: list[WorkerProcess | None] = [None] * count
        self.owner_pid = os.getpid()
        self._fork = context.get_start_method() == "fork"
        self.marks = FetchMarks(count, shareable=not self._fork)
        _POOLS.add(self)
        if self._fork:
            # Forked workers then share the parent's temporary directory (used for the
            # sockets that pass shared-memory file descriptors) instead of each making
            # one that a SIGKILL would leave behind.
            multiprocessing.util.get_temp_dir()

    def start(self, index: int) -> WorkerProcess:
        """Start worker process ``index`` (its place must be empty)."""
        if not self._fork and getattr(multiprocessing.process.current_process(), "_inheriting", False):
            # This process is a spawn worker still importing the main module, which
            # builds and iterates a loader: multiprocessing would raise here, and every
            # worker print a 70-line traceback before the main process says why.
            # Exit with the reason alone (SystemExit prints its text, no traceback).
            raise SystemExit(NO_MAIN_GUARD)
        if self.workers[index] is not None:
            raise RuntimeError(f"worker process {index} is still there; discard it first")
        task_recv, task_send = self.context.Pipe(duplex=False)
        result_recv, result_send = self.context.Pipe(duplex=False)
        _widen_pipe(task_send)
        inherited = Inherited()
        if self._fork:
            fds = [task_send.fileno(), result_recv.fileno()]
            for pool in list(_POOLS):
                if pool.owner_pid == os.getpid():
                    fds += pool.pipe_fds()
            inherited = Inherited(tuple(fds), frozenset(_WORKER_PIDS))
        self.marks.set(index, FetchMarks.UNSTARTED)
        child = self.context.Process(  # type: ignore[attr-defined]
            target=self.target,
            args=(*self.make_args(index), task_recv, result_send, os.getpid(), inherited, self.marks),
            daemon=True,
            name=f"snaploader-worker-{index}",
        )
        try:
            child.start()
        finally:
            task_recv.close()
            result_send.close()
        worker = WorkerProcess(index, child, task_send, result_recv)
        self.workers[index] = worker
        _WORKER_PIDS.add(worker.pid)
        return worker

    def pipe_fds(self) -> list[int]:
        """This process's ends of the live workers' pipes, and the fetch marks' fd."""
        fds = [] if self.marks.fd is None else [self.marks.fd]
        for worker in self.workers:
            if worker is None:
                continue
            for conn in (worker.task, worker.result):
                if not conn.closed:
                    fds.append(conn.fileno())
        return fds

    def wait(
        self, timeout_s: float | None, skip: Collection[int] = ()
    ) -> tuple[list[WorkerProcess], list[WorkerProcess]]:
        """Block until a result pipe is readable or a process has exited, or
        ``timeout_s`` passes; the result pipes of the processes in ``skip`` are not waited
        on (their sentinels are). Returns (workers with results, workers that exited);
        a caller that replaces a worker must ignore the replaced one's later entries."""
        handles: dict[Any, tuple[WorkerProcess, bool]] = {}
        for worker in self.workers:
            if worker is not None:
                if worker.index not in skip:
                    handles[worker.result] = (worker, True)
                handles[worker.process.sentinel] = (worker, False)
        ready = wait(list(handles), timeout_s)
        readable = [handles[h][0] for h in ready if handles[h][1]]
        exited = [handles[h][0] for h in ready if not handles[h][1]]
        return readable, exited

    def holds(self, worker: WorkerProcess) -> bool:
        """True while ``worker`` is the live process at its index."""
        return self.workers[worker.index] is worker

    def discard(self, index: int) -> WorkerProcess:
        """Forget the (dead) worker process ``index`` and close its pipes."""
        worker = self.workers[index]
        if worker is None:
            raise RuntimeError(f"worker process {index} is not there to discard")
        worker.process.join(_KILL_TIMEOUT_S)
        if worker.process.exitcode not in (None, 0):
            remove_shm_left_by(worker.pid)
        worker.close_pipes()
        self.workers[index] = None
        return worker

    def shutdown(self) -> None:
        """Stop every worker; never blocks longer than the join timeouts."""
        if os.getpid() != self.owner_pid:
            return  # a forked child holding a copy of this pool owns none of its workers
        live = [w for w in self.workers if w is not None]
        for worker in live:
            try:
                worker.send(None)
            except OSError:
                pass
            # A worker blocked sending a result we will never read sees a broken pipe.
            worker.result.close()
        for worker in live:
            worker.process.join(_JOIN_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.terminate()
                worker.process.join(_KILL_TIMEOUT_S)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(_KILL_TIMEOUT_S)
            if worker.process.exitcode not in (None, 0):
                remove_shm_left_by(worker.pid)
            worker.task.close()
            worker.process.close()
        self.workers = [None] * len(self.workers)
        self.marks.close()


# At most this many fds held by received results in the main process, and a quarter of
# the soft limit (NOTE [ fd budget ] in _workers/process_runner.py).
_FD_BUDGET_MAX: Final = 64


def fd_budget() -> int:
    """How many fds the main process may hold in received but not yet yielded results."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return _FD_BUDGET_MAX
    return max(1, min(_FD_BUDGET_MAX, soft // 4))
