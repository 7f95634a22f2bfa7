"""Datasets that crash on purpose, for ``test_faults.py``.

They live in an importable module so that workers started by ``spawn`` and
``forkserver`` can unpickle them by reference.

A fault is described by :class:`Fault`: what happens (``kind``), at which sample
(``item``), and whether it happens every time the sample is loaded (``marker`` is None:
a poison sample) or only the first time (``marker`` is a file path: the first loader of
the sample creates it and then faults; a respawned worker finds it and carries on).
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

SEGV = "segv"
EXIT = "exit"
KILL = "kill"
RAISE = "raise"
LAMBDA = "lambda"  # the batch holds a lambda: it cannot be pickled
GENERATOR = "generator"  # the batch holds a generator object: it cannot be pickled
UNLOADABLE = "unloadable"  # the batch pickles in the worker but fails to unpickle in main
# Return the sample, then SIGKILL ourselves from a background thread shortly after:
# the batch (with a tensor in shared memory) may reach the main process just before or
# while the worker dies.
KILL_AFTER = "kill_after"
DEATH_KINDS = (SEGV, EXIT, KILL)
EXIT_CODE = 3


class PoisonError(ValueError):
    """Raised by a dataset for a sample it cannot load."""


class RebuildError(LookupError):
    """Raised when an :class:`Unloadable` is unpickled outside a worker."""


def _rebuild_unloadable(item: int) -> Unloadable:
    if get_worker_info() is None:  # the main process: the reconstructor fails there
        raise RebuildError(f"cannot rebuild sample {item} here")
    return Unloadable(item)


class Unloadable:
    """Pickles fine; unpickling it in the main process raises :class:`RebuildError`."""

    def __init__(self, item: int) -> None:
        self.item = item

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_unloadable, (self.item,)


@dataclass(frozen=True)
class Fault:
    kind: str
    item: int
    marker: str | None = None  # None: every time (permanent)

    def fires(self) -> bool:
        if self.marker is None:
            return True
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        info = get_worker_info()
        # The test reads back which process and worker slot faulted.
        os.write(fd, f"{os.getpid()} {-1 if info is None else info.id}".encode())
        os.close(fd)
        return True

    def apply(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Called with ``sample`` for item ``self.item``; returns what to yield."""
        if self.kind not in (LAMBDA, GENERATOR, UNLOADABLE) and not self.fires():
            return sample
        if self.kind == SEGV:
            ctypes.string_at(0)
        elif self.kind == EXIT:
            os._exit(EXIT_CODE)
        elif self.kind == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        elif self.kind == RAISE:
            raise PoisonError(f"cannot load sample {self.item}")
        elif self.kind == LAMBDA:
            return {**sample, "bad": lambda: None}
        elif self.kind == GENERATOR:
            return {**sample, "bad": (x for x in range(3))}
        elif self.kind == UNLOADABLE:
            return {**sample, "bad": Unloadable(self.item)}
        elif self.kind == KILL_AFTER:
            def kill_soon() -> None:
                time.sleep(0.002)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Thread(target=kill_soon, daemon=True).start()
        return sample


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's default_collate, except that an unpicklable "bad" entry is passed
    through as a list (so that it reaches the pickler rather than failing collation)."""
    out = default_collate([{k: v for k, v in s.items() if k != "bad"} for s in samples])
    bad = [s["bad"] for s in samples if "bad" in s]
    if bad:
        out["bad"] = bad
    return out


# A batch of 3 "big" entries (288 KB) is over snaploader's by-value limit (256 KB), so
# it travels through shared memory by file descriptor, the path where a result can be
# lost with its sender (see NOTE [ small tensors by value ] in snaploader/worker.py).
_BIG_ITEMS = 24_000  # float32


def _sample(i: int) -> dict[str, Any]:
    # Augmentations from all three global RNGs, so a respawned worker that did not
    # restore its RNG state would change the stream.
    return {
        "index": torch.tensor(i),
        "big": torch.full((_BIG_ITEMS,), float(i)),
        "noise": torch.rand(3),
        "np": torch.from_numpy(np.random.rand(2)),
        "py": torch.tensor(random.random(), dtype=torch.float64),
    }


class MapFaults(Dataset[dict[str, Any]]):
    """``n`` samples; sample ``fault.item`` faults (when a fault is given)."""

    def __init__(self, n: int, fault: Fault | None = None) -> None:
        self.n = n
        self.fault = fault

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = _sample(i)
        if self.fault is not None and i == self.fault.item:
            sample = self.fault.apply(sample)
        return sample


class IterFaults(IterableDataset[dict[str, Any]]):
    """Samples ``0..n-1`` split round-robin over the workers; sample ``fault.item``
    faults (when a fault is given). No state protocol: a respawn replays."""

    def __init__(self, n: int, fault: Fault | None = None) -> None:
        self.n = n
        self.fault = fault

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            sample = _sample(i)
            if self.fault is not None and i == self.fault.item:
                sample = self.fault.apply(sample)
            yield sample


class _StatefulIterator:
    def __init__(self, ds: IterFaultsStateful) -> None:
        self.ds = ds
        info = get_worker_info()
        self.start, self.step = (0, 1) if info is None else (info.id, info.num_workers)
        self.pos = self.start

    def __iter__(self) -> _StatefulIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        i = self.pos
        if i >= self.ds.n:
            raise StopIteration
        self.pos += self.step
        sample = _sample(i)
        fault = self.ds.fault
        if fault is not None and i == fault.item:
            sample = fault.apply(sample)
        return sample

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])


class IterFaultsStateful(IterableDataset[dict[str, Any]]):
    """Like :class:`IterFaults`, but its iterator implements the state protocol, so a
    respawned worker resumes from its snapshot without replaying."""

    def __init__(self, n: int, fault: Fault | None = None) -> None:
        self.n = n
        self.fault = fault

    def __iter__(self) -> _StatefulIterator:
        return _StatefulIterator(self)


def slow_start(directory: str, sleep_s: float, worker_id: int) -> None:
    """A ``worker_init_fn`` (with the first two arguments bound): announces this process
    as a file ``<pid>-<worker_id>`` in ``directory``, then takes ``sleep_s`` to start."""
    with open(os.path.join(directory, f"{os.getpid()}-{worker_id}"), "w"):
        pass
    time.sleep(sleep_s)


def wait_for(path: str | None, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while path is not None and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)


class GatedMap(Dataset[dict[str, Any]]):
    """Map-style samples; loading sample ``gate_item`` blocks until the file ``gate``
    exists, so a test knows the main process is waiting for that sample's batch."""

    def __init__(self, n: int, gate_item: int = -1, gate: str | None = None) -> None:
        self.n = n
        self.gate_item = gate_item
        self.gate = gate

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.gate_item:
            wait_for(self.gate)
        return _sample(i)


class GatedPoison(GatedMap):
    """Like :class:`GatedMap`, but sample ``gate_item`` is a poison sample: it creates
    the file ``<gate>.fetching``, waits for the gate, then crashes its worker with
    SIGSEGV, every time it is loaded."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.gate_item:
            with open(f"{self.gate}.fetching", "w"):
                pass
            wait_for(self.gate)
            ctypes.string_at(0)
        return _sample(i)


class GatedIter(IterableDataset[dict[str, Any]]):
    """Like :class:`IterFaults` without faults, with the gate of :class:`GatedMap`."""

    def __init__(self, n: int, gate_item: int = -1, gate: str | None = None) -> None:
        self.n = n
        self.gate_item = gate_item
        self.gate = gate

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            if i == self.gate_item:
                wait_for(self.gate)
            yield _sample(i)


def run_loader_child(conn: Any) -> None:
    """Target of a (forked) child process that owns a loader with forked workers and
    has forked one more process (think: a logger) that inherited the main process's
    ends of the workers' pipes. Sends ([worker pids], helper pid) through ``conn``, then
    waits to be killed. When this process dies the workers see no end-of-file on their
    task pipes (the helper holds them open): only their watchdog can end them."""
    import multiprocessing

    from snaploader import DataLoader

    loader = DataLoader(GatedMap(64), batch_size=2, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    next(it)
    helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
    helper.start()
    conn.send((it.worker_pids, helper.pid))
    time.sleep(600)
