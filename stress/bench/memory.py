"""The memory and fd sampler run beside each throughput trial: peak RSS of the main
process plus its workers, and the main process's peak open file descriptors."""

from __future__ import annotations

import os
import threading
import time
from typing import Final

import psutil

from stress._probes import child_pids, open_fds

_SAMPLE_INTERVAL_S: Final = 0.02


class MemorySampler(threading.Thread):
    """Samples the summed RSS of this process and its children, and this process's
    open file descriptors, every ``interval_s``.

    Its own CPU time is readable from the main thread (``cpu_s()``), so the main
    process's CPU time per batch can exclude it."""

    def __init__(self, interval_s: float = _SAMPLE_INTERVAL_S) -> None:
        super().__init__(daemon=True, name="bench-memory-sampler")
        self.interval_s = interval_s
        self.pid = os.getpid()
        self.peak_bytes = 0
        self.peak_fds: int | None = None
        self.samples = 0
        self._stop_event = threading.Event()
        self._procs: dict[int, psutil.Process] = {}
        self._clock: int | None = None
        self._own_cpu_s = 0.0

    def sample(self) -> None:
        total = 0
        for pid in [self.pid, *child_pids(self.pid)]:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                self._procs.pop(pid, None)
        self.peak_bytes = max(self.peak_bytes, total)
        fds = open_fds()
        if fds is not None:
            self.peak_fds = max(self.peak_fds or 0, fds)
        self.samples += 1

    def run(self) -> None:
        if hasattr(time, "pthread_getcpuclockid") and self.ident is not None:
            self._clock = time.pthread_getcpuclockid(self.ident)
        while not self._stop_event.is_set():
            self.sample()
            self._own_cpu_s = time.thread_time()
            self._stop_event.wait(self.interval_s)

    def cpu_s(self) -> float:
        if self._clock is not None:
            try:
                return time.clock_gettime(self._clock)
            except OSError:  # the thread has ended
                pass
        return self._own_cpu_s

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return self.peak_bytes
