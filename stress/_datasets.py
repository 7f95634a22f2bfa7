"""Datasets and helpers shared by the stress scripts (see README.md here).

Imported as ``stress._datasets`` with the repository root on ``sys.path``, so that
workers started by ``spawn`` unpickle the datasets by reference.

Every sample draws from Python's ``random``, NumPy's and torch's global RNGs, so a
worker respawned without its exact RNG state would change the stream.
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

KINDS = ("map", "iter", "iter_stateful")


def sample(i: int) -> dict[str, torch.Tensor]:
    return {
        "index": torch.tensor(i),
        "noise": torch.rand(4),
        "np": torch.from_numpy(np.random.rand(2)),
        "py": torch.tensor(random.random(), dtype=torch.float64),
    }


class StressMap(Dataset[dict[str, torch.Tensor]]):
    """``n`` samples, each taking ``delay_s`` (a sleep, so that a loaded machine still
    lets kills land in the middle of batches)."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return sample(i)


class StressIter(IterableDataset[dict[str, torch.Tensor]]):
    """Samples ``0..n-1`` split round-robin over the workers; no state protocol (a
    respawned worker replays from its epoch start)."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            if self.delay_s:
                time.sleep(self.delay_s)
            yield sample(i)


class _StatefulIterator:
    def __init__(self, ds: StressIterStateful) -> None:
        self.ds = ds
        info = get_worker_info()
        self.step = 1 if info is None else info.num_workers
        self.pos = 0 if info is None else info.id

    def __iter__(self) -> _StatefulIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.pos >= self.ds.n:
            raise StopIteration
        i, self.pos = self.pos, self.pos + self.step
        if self.ds.delay_s:
            time.sleep(self.ds.delay_s)
        return sample(i)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = int(state["pos"])


class StressIterStateful(IterableDataset[dict[str, torch.Tensor]]):
    """Like :class:`StressIter`, with the state protocol on its iterator."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __iter__(self) -> _StatefulIterator:
        return _StatefulIterator(self)


def make_dataset(kind: str, n: int, delay_s: float) -> Dataset[Any]:
    return {"map": StressMap, "iter": StressIter, "iter_stateful": StressIterStateful}[kind](n, delay_s)


class OomOnce:
    """Map-style samples; loading ``item`` allocates memory until the process is
    killed, the first time only (``marker`` records that it happened) or every time
    (``marker`` None: a poison sample). With an address-space limit (RLIMIT_AS) the
    allocation raises MemoryError instead of the kernel killing the process; that is
    converted into the death the out-of-memory killer would cause (SIGKILL), and
    counted in ``converted_dir`` so the script can say which mechanism acted."""

    def __init__(self, n: int, item: int, marker: str | None, converted_dir: str) -> None:
        self.n = n
        self.item = item
        self.marker = marker
        self.converted_dir = converted_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out = sample(i)
        if i == self.item and self._fires():
            hog = []
            try:
                while True:
                    hog.append(np.ones(16 << 20, dtype=np.uint8))  # touched pages
            except MemoryError:
                hog.clear()
                open(os.path.join(self.converted_dir, f"{os.getpid()}"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        return out

    def _fires(self) -> bool:
        if self.marker is None:
            return True
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def fingerprint(batch: dict[str, torch.Tensor]) -> str:
    """The batch's sample ids and a digest of every tensor's bytes."""
    digest = hashlib.sha1()
    for key in sorted(batch):
        digest.update(key.encode())
        digest.update(batch[key].contiguous().numpy().tobytes())
    ids = ",".join(str(i) for i in batch["index"].tolist())
    return f"{ids}:{digest.hexdigest()[:16]}"


# -- leaks ------------------------------------------------------------------------------


def _children() -> set[int]:
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@dataclass
class LeakCheck:
    """Child processes, fds and /dev/shm entries now, to compare with later. Start
    multiprocessing's long-lived helpers (resource tracker) before taking it."""

    children: set[int] = field(default_factory=_children)
    fds: set[int] = field(default_factory=_fds)
    shm: set[str] = field(default_factory=_shm)

    def leaks(self, settle_s: float = 10.0) -> list[str]:
        """What is there now and was not before (after up to ``settle_s`` for
        processes that are exiting)."""
        deadline = time.monotonic() + settle_s
        while True:
            gc.collect()
            children = _children() - self.children
            fds = _fds() - self.fds
            shm = _shm() - self.shm
            if not (children or fds or shm) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        out = [f"child process {pid}" for pid in sorted(children)]
        for fd in sorted(fds):
            try:
                out.append(f"fd {fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                pass  # closed meanwhile (it was the listdir's own fd)
        out += [f"/dev/shm/{name}" for name in sorted(shm)]
        return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def quiet_worker(log_path: str, worker_id: int) -> None:
    """worker_init_fn: send the worker's stderr (torch's "Unexpected segmentation
    fault" lines, one per kill) to ``log_path`` instead of the terminal."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
