"""Shared fixtures. Every test fails if it leaves a child process, a file descriptor,
a /dev/shm entry or a pin memory thread behind (see ``no_leaks``)."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Iterator

import numpy as np
import psutil
import pytest
import torch

from snaploader._workers.pinning import THREAD_NAME as PIN_THREAD
from snaploader._workers.pool import shm_creator

_SETTLE_S = 10.0


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


def _fds() -> set[int]:
    return set(int(fd) for fd in os.listdir("/proc/self/fd"))


# Under pytest-xdist another test runs beside this one, in a sibling process whose workers
# create /dev/shm entries of their own: /dev/shm is shared by the machine, not the process.
_XDIST = "PYTEST_XDIST_WORKER" in os.environ


def _someone_elses(name: str) -> bool:
    """An entry a live process outside this test process's tree created (a concurrent
    xdist worker's): not this test's to answer for. An entry whose creator is gone may be
    anyone's; it is checked, and a transient one is gone by the settle deadline."""
    pid = shm_creator(name)
    if pid is None:
        return False
    try:
        process = psutil.Process(pid)
        return pid != os.getpid() and os.getpid() not in {p.pid for p in process.parents()}
    except psutil.Error:
        return False


def _pin_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == PIN_THREAD}


def _shm() -> set[str]:
    try:
        names = set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()
    return {name for name in names if not _someone_elses(name)} if _XDIST else names


def pytest_collection_finish(session: pytest.Session) -> None:
    # Everything imported so far (torch, numpy, the tests) lives to the end of the run:
    # moved out of the collector's reach, it is never traversed again, by the automatic
    # collections or by no_leaks' (a full collection costs 0.2 s with torch loaded, a
    # collection after the freeze only what the test itself made).
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test if it leaves worker processes, fds, /dev/shm entries or pin memory
    threads behind."""
    children, fds, shm, threads = _children(), _fds(), _shm(), _pin_threads()
    yield
    deadline = time.monotonic() + _SETTLE_S
    first = True
    while True:
        extra_children = _children() - children
        extra_fds = _fds() - fds
        extra_shm = _shm() - shm
        extra_threads = _pin_threads() - threads
        if not (extra_children or extra_fds or extra_shm or extra_threads) or time.monotonic() > deadline:
            break
        # Something is left: it may be garbage in a reference cycle (a loader and its
        # persistent iterator), which only a collection frees, or a worker still exiting.
        # Collect only then: a collection cannot add a process, an fd or an entry, so a
        # test that left nothing needs none.
        if not first:
            time.sleep(0.05)
        first = False
        gc.collect()
    problems = []
    if extra_children:
        problems.append(f"child processes left running: {sorted(extra_children)}")
    if extra_fds:
        targets = []
        for fd in sorted(extra_fds):
            try:
                targets.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
            except OSError:
                targets.append(str(fd))
        problems.append(f"file descriptors left open: {targets}")
    if extra_shm:
        problems.append(f"/dev/shm entries left: {sorted(extra_shm)}")
    if extra_threads:
        problems.append(f"pin memory threads left running: {len(extra_threads)}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def keep_global_rngs() -> Iterator[None]:
    """For tests that scramble the global RNGs: put them back for later tests."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])
