"""What the main process and the workers hold: file descriptors and shared memory.

What a user relies on:

- the main process holds a bounded number of fds however far the workers run ahead,
  so a loader that torch runs under a common ``ulimit -n`` runs too
  (NOTE [ fd budget ] in ``_workers/process_runner.py``);
- a forked worker holds nothing of the main process's that it does not own: no pipe of
  another worker or another loader (so deleting a loader stops its workers at once), no
  fd of a batch the main process holds (so dropped batches free their shared memory);
  but it keeps the dataset's own open files.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import psutil
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from snaploader import DataLoader, WorkerRespawnedWarning
from snaploader._workers.pool import _JOIN_TIMEOUT_S

from ._datasets import Sleepy
from ._support import load_stress_script

@pytest.fixture(scope="module")
def fd_peak() -> ModuleType:
    return load_stress_script("fd_peak")


def _exit_with(fd_peak: ModuleType, args: argparse.Namespace) -> None:
    sys.exit(fd_peak.child(args))


def test_workers_far_ahead_stay_within_a_low_fd_limit(fd_peak: ModuleType) -> None:
    """2 workers x prefetch 8 x 32 tensors in shared memory would be 512 fds if the main
    process read every finished batch at once; under a limit of 400 (the workers need
    about 300 each, for what they have sent) every batch still comes, in order."""
    args = argparse.Namespace(
        loader="snaploader", limit=400, workers=2, prefetch=8, tensors=32, tensor_kb=300,
        batches=24, pause_s=1.0,
    )
    # Forked: the child needs no second import of torch, and the limit is its own.
    process = multiprocessing.get_context("fork").Process(target=_exit_with, args=(fd_peak, args))
    process.start()
    process.join(300)
    assert process.exitcode == 0, "the loader failed under RLIMIT_NOFILE=400 (its line above says why)"


# -- what forked workers inherit ----------------------------------------------------------


class Blocks(Dataset[torch.Tensor]):
    """Sample i: ``kb`` KB of float32 filled with i; a row of a table the dataset put in
    shared memory itself; and bytes read from a file it opened itself, before any fork."""

    def __init__(self, n: int, kb: int, path: Path) -> None:
        self.n = n
        self.items = kb * 1024 // 4
        self.table = torch.arange(n, dtype=torch.float64).share_memory_()
        path.write_bytes(bytes(range(n)))
        self.file = open(path, "rb")  # noqa: SIM115  (the dataset's own, for its lifetime)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        own = os.pread(self.file.fileno(), 1, i)[0]
        return torch.full((self.items,), float(i + self.table[i].item() + own))

    def close(self) -> None:
        self.file.close()


def _worker_holds(pid: int, what: str) -> list[str]:
    """The fd targets and mapped files of process ``pid`` that contain ``what``."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if what in target:
            found.append(f"fd {fd} -> {target}")
    with open(f"/proc/{pid}/maps") as maps:
        found += [f"mapped {line.split()[-2]}" for line in maps if what in line]
    return found


def test_respawned_worker_holds_no_batch_of_the_main_process(tmp_path: Path) -> None:
    ds = Blocks(20, 300, tmp_path / "own")
    loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="fork",
                        collate_fn=list, prefetch_factor=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            it = iter(loader)
            held = [next(it) for _ in range(4)]  # from both workers, in shared memory
            old = it.worker_pids
            os.kill(old[0], signal.SIGKILL)
            held += [next(it) for _ in range(4)]  # worker 0's new process made two of these
            new = it.worker_pids[0]
            assert new != old[0] and any(issubclass(w.category, WorkerRespawnedWarning) for w in caught)
            leftovers = _worker_holds(new, f"/dev/shm/torch_{old[0]}_") + _worker_holds(new, f"/dev/shm/torch_{old[1]}_")
            assert leftovers == [], f"the respawned worker holds the main process's batches: {leftovers}"
            held += list(it)
        # The dataset's own shared table and its own file were left alone in every worker.
        assert [float(t[0]) for batch in held for t in batch] == [3.0 * i for i in range(20)]
        assert all(t.is_shared() for t in held[0])  # the batches did travel as shared memory
    finally:
        ds.close()


def test_deleting_a_loader_stops_its_workers_while_another_loaders_run() -> None:
    """A's workers are blocked sending results too large for their pipes; B's workers,
    forked later, must not hold A's pipe ends, or A's workers never see the pipe break
    when A goes, and each would be terminated only after the join timeout."""
    # 200 KB batches travel by value (NOTE [ small tensors by value ]), and one fills a
    # 64 KB pipe: a worker that sent one the main process does not read is blocked.
    ds = TensorDataset(torch.randn(64, 50_000))
    a = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="fork")
    b = DataLoader(ds, batch_size=1, num_workers=2, multiprocessing_context="fork")
    it_a = iter(a)
    next(it_a)
    a_pids = it_a.worker_pids
    it_b = iter(b)
    next(it_b)  # B's workers exist, forked after A's
    try:
        time.sleep(0.5)  # A's workers fill their result pipes and block
        started = time.monotonic()
        del it_a, a
        gc.collect()
        stopped_s = time.monotonic() - started
        assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in a_pids)
        assert stopped_s < _JOIN_TIMEOUT_S, (
            f"A's workers took {stopped_s:.1f} s to stop: they were terminated after the join "
            "timeout instead of seeing their result pipes break"
        )
    finally:
        it_b.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_load_from_another_thread_while_next_waits_raises_invalidated_in_the_waiting_thread(persistent: bool) -> None:
    """The waiting thread selects on the pipes that load_state_dict() closes: it must get
    the documented "invalidated" RuntimeError, as at num_workers=0, not an OSError; and
    no worker may be respawned behind the loader's back."""
    loader = DataLoader(Sleepy(16, sleep_from=2, sleep_s=1.5), batch_size=1, num_workers=2,
                        persistent_workers=persistent)
    helpers = {p.pid for p in psutil.Process().children()}  # a forkserver, say
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    next(it)
    pids = it.worker_pids
    caught: list[BaseException] = []

    def wait_for_next() -> None:
        try:
            next(it)
        except BaseException as exc:  # noqa: BLE001 (the test reports what came)
            caught.append(exc)

    waiter = threading.Thread(target=wait_for_next)
    waiter.start()
    time.sleep(0.3)  # next() now waits on the workers for item 2
    loader.load_state_dict(state)
    waiter.join(30)
    assert not waiter.is_alive()
    assert len(caught) == 1 and type(caught[0]) is RuntimeError, repr(caught)
    assert "invalidated by load_state_dict(); call iter(loader)" in str(caught[0])
    assert it.worker_pids == []
    live = [p.pid for p in psutil.Process().children()
            if p.pid not in helpers and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not live, f"workers left running (the old ones were {pids})"
    assert [int(x) for x in next(iter(loader))] == [1]
