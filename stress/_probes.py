"""Probes of this process and its workers shared by the stress scripts: child processes,
open file descriptors, resident and proportional memory, the children's CPU time, a
thread's wait for a CPU, a checkpoint's ``torch.save`` bytes, and a percentile.

Imported as ``stress._probes`` with the repository root on ``sys.path`` (as
``stress._datasets`` is). Linux reads ``/proc``; elsewhere the fd and PSS probes
answer None and the child list falls back to psutil.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch


def child_pids(pid: int | None = None) -> list[int]:
    """Direct children of ``pid`` (default: this process). /proc/PID/task/*/children
    is ~100x cheaper than psutil's scan of every process, which matters to a sampler
    running beside the loop it measures; psutil where /proc does not exist."""
    pid = os.getpid() if pid is None else pid
    try:
        pids: list[int] = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        return pids
    except OSError:
        return [p.pid for p in psutil.Process(pid).children()]


def open_fds() -> int | None:
    """File descriptors open in this process (Linux: /proc/self/fd; else None)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing them
    except OSError:
        return None


def rss_bytes(pid: int | None = None) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def pss_bytes() -> int | None:
    """Summed PSS of this process and its children (Linux only; else None).

    RSS counts a page shared by n processes n times: forked workers' copy-on-write
    pages inherited from the main process show in every worker's RSS. PSS charges each
    process 1/n of such a page, so the sum is the memory really used. Reading it walks
    every mapping (~10 ms a process), so callers take it once per measured span, not
    from a sampler."""
    total = 0
    for pid in [os.getpid(), *child_pids()]:
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                for line in f:
                    if line.startswith(b"Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except FileNotFoundError:
            if pid == os.getpid():
                return None  # no smaps_rollup on this system
        except OSError:
            continue
    return total


def children_cpu_s() -> float:
    """CPU time (user + system) used so far by this process's live children."""
    total = 0.0
    for pid in child_pids():
        try:
            times = psutil.Process(pid).cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += times.user + times.system
    return total


def run_queue_wait_ns() -> int | None:
    """Nanoseconds this thread has spent so far runnable but waiting for a CPU (the
    run_delay of Linux's /proc/thread-self/schedstat); None where it cannot be read.
    The difference across a call is the part of its wall time that was the scheduler's:
    another process held the CPU."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def saved_bytes(state: Any) -> bytes:
    """``state`` as ``torch.save`` writes it: what a checkpoint file holds."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def percentile(values: Sequence[float], q: float) -> float:
    """The value below which a fraction ``q`` of ``values`` lie (nearest rank, no
    interpolation: a reported p99 is a time some call really took)."""
    if not values:
        raise ValueError("percentile of no values: measure at least one")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def median(values: Sequence[float]) -> float:
    """The median of the values that are not NaN (a probe that could not read gives
    NaN); NaN when none is left."""
    clean = [v for v in values if v == v]
    return float(statistics.median(clean)) if clean else float("nan")


def per_call_us(fn: Callable[[], object], repeat: int, chunks: int = 5) -> float:
    """µs per call of ``fn``: the fastest of ``chunks`` chunks of ``repeat`` calls (the
    least disturbed by other processes)."""
    best = float("inf")
    for _ in range(chunks):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6
