"""A worker process: the loop that takes messages, and the logical workers it hosts.

NOTE [ logical workers ]
The stream is defined by *logical* workers, not processes: batch k of a map-style epoch
belongs to logical worker k mod W, with that worker's RNG states, iterator and dataset
state, and an iterable's round-robin runs over the W logical workers. W is the
``num_workers`` the epoch started with (or ``DataLoader(logical_workers=...)``). How many
processes host them is free: a checkpoint taken with W logical workers resumes in a
loader built with any ``num_workers``, each process hosting the logical workers
``w`` with ``w % processes`` equal to its index (``_workers/process_runner.py``), and the main process
hosting them all at ``num_workers=0`` (``_workers/inline_runner.py``).

A process hosting several logical workers keeps, for each, what a worker process of its
own would have: a copy of the setup (dataset, ``collate_fn``, ``worker_init_fn``: copied
as torch's worker processes copy them), the worker info ``get_worker_info()`` reports
(its logical id and W), and its three global RNG states, which :class:`Host` swaps in
before the logical worker's message and out when another one's comes (with the states
of the generator objects its code holds). A process hosting one logical worker never
swaps anything: that is the ordinary case, at no cost.

The messages (``_workers/messages.py``) come as ``(logical worker, message)`` pairs. A worker
process exits on ``None``, on end-of-file of its task pipe, or when its parent is gone
(a watchdog thread checks every ``_WATCHDOG_INTERVAL_S``, whatever the loop is doing).
It never blocks forever: sends block only while the main process is alive to read.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Final

import cloudpickle
import psutil
import torch

from .pool import FetchMarks, Inherited, release_inherited
from .messages import Kind, Result, WorkerError, WorkerSetup, dumps_result
from .._state.records import Resume
from .._rng.capture import NativeRng
from .logical_worker import WorkerRuntime, set_worker_info

_WATCHDOG_INTERVAL_S: Final = 1.0


def copy_setup(setup: WorkerSetup | bytes, fresh: bool) -> WorkerSetup:
    """A logical worker's own setup: ``setup`` itself when ``fresh`` is False (the
    first logical worker of a process), else a copy made as a worker process's is
    (unpickled again, or a pickle round trip of an inherited one)."""
    if isinstance(setup, bytes):
        loaded = pickle.loads(setup)
    elif not fresh:
        loaded = setup
    else:
        try:
            loaded = pickle.loads(cloudpickle.dumps(setup))
        except Exception as pickling:
            try:
                loaded = copy.deepcopy(setup)
            except Exception as copying:
                raise TypeError(
                    "this process hosts several logical workers, and each needs its own "
                    "copy of the dataset, collate_fn and worker_init_fn (as each of "
                    "torch's worker processes has), but they can be neither pickled "
                    f"({type(pickling).__name__}: {pickling}) nor deep-copied "
                    f"({type(copying).__name__}: {copying}). Resume with as many "
                    "processes as logical workers (num_workers equal to the "
                    "checkpoint's), or make the dataset picklable"
                ) from copying
    if not isinstance(loaded, WorkerSetup):
        raise TypeError(f"a worker was sent a {type(loaded).__name__}, not a WorkerSetup")
    return loaded


class Host:
    """The logical workers one process hosts, and whose global RNG states are live."""

    def __init__(self, setup: WorkerSetup | bytes, hosted: tuple[int, ...]) -> None:
        self.setup = setup
        self.runtimes: dict[int, WorkerRuntime] = {}
        self.saved: dict[int, tuple[NativeRng, list[bytes]]] = {}
        self.active: int | None = None
        for worker in hosted:
            self.enter(worker)

    def enter(self, worker: int) -> WorkerRuntime:
        """Make ``worker``'s states the live ones (starting it on first use)."""
        runtime = self.runtimes.get(worker)
        if self.active == worker and runtime is not None:
            return runtime
        if self.active is not None:
            out = self.runtimes[self.active]
            self.saved[self.active] = (NativeRng.take(out.seed_rng), out.objects.read_all())
        self.active = worker
        if runtime is None:
            runtime = WorkerRuntime(copy_setup(self.setup, bool(self.runtimes)), worker, in_main_process=False)
            self.runtimes[worker] = runtime
            runtime.initialize()
            return runtime
        rng, objects = self.saved.pop(worker)
        rng.put()
        runtime.objects.write_all(objects)
        set_worker_info(runtime.info)
        return runtime


def worker_main(
    setup: WorkerSetup | bytes,
    process: int,
    hosted: tuple[int, ...],
    logical: int,
    task_conn: Connection,
    result_conn: Connection,
    parent_pid: int,
    inherited: Inherited,
    marks: FetchMarks,
) -> None:
    """Entry point of worker process ``process`` (its index in the pool), hosting the
    logical workers ``hosted`` of ``logical`` (see the module docstring for the protocol)."""
    # From here on a death is not a failure to start (_workers/process_runner.py).
    marks.set(process, FetchMarks.STARTING)
    # Ctrl-C reaches the whole process group; the main process handles it and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Under fork: the main process's pipe ends and received batches (NOTE [ inherited fds ]).
    release_inherited(inherited)
    torch.utils.data._utils.signal_handling._set_worker_signal_handlers()
    torch.set_num_threads(1)
    host = Host(setup, hosted)
    marks.set(process, FetchMarks.IDLE)
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
        entry = pending.popleft()
        if entry is None:
            return
        worker, msg = entry
        runtime = host.enter(worker)
        if isinstance(msg, bytes):
            msg = pickle.loads(msg)  # a Resume, sent by value (_workers/process_runner.py)
        if isinstance(msg, Resume):
            marks.set(process, FetchMarks.RESTORING)
            runtime.resume(msg)
            marks.set(process, FetchMarks.IDLE)
            continue
        # Only a death between these two marks counts against this batch (_workers/process_runner.py).
        marks.set(process, fetch_mark(msg.key, worker, logical))
        result = runtime.run(msg)
        marks.set(process, FetchMarks.IDLE)
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
            result_conn.send_bytes(dumps_result(Result(result.key, Kind.ERROR, error, result.snapshot)))
        del result, msg, entry


def fetch_mark(key: int, worker: int, logical: int) -> int:
    """The fetch mark of logical worker ``worker``'s task ``key``, of ``logical`` logical
    workers (iterable keys repeat across logical workers; marks must not)."""
    return key * logical + worker
