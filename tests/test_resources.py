"""What the main process and the workers hold: file descriptors and shared memory.

What a user relies on:

- the main process holds a bounded number of fds however far the workers run ahead,
  so a loader that torch runs under a common ``ulimit -n`` runs too
  (NOTE [ fd budget ] in ``_receiver.py``);
- a forked worker holds nothing of the main process's that it does not own: no pipe of
  another worker or another loader (so deleting a loader stops its workers at once), no
  fd of a batch the main process holds (so dropped batches free their shared memory);
  but it keeps the dataset's own open files.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
from types import ModuleType

import pytest

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
