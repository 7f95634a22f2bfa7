"""Preemption: the loop of README.md and docs/fault-tolerance.md with a SIGTERM handler,
signalled at any instant (inside a training step, inside ``next()``, between epochs, at
random moments from outside), saves, exits, and resumes in a fresh process exactly: the
batches consumed before and after equal the uninterrupted run's, and so does the model.
Before ``loader.epoch`` the loop started from an epoch number saved beside the state,
which a state taken between epochs (it describes the next epoch) made one too low: an
extra epoch was trained."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ._support import assert_same_stream

_ROOT = Path(__file__).resolve().parents[1]
_TIMEOUT_S = 120


def _start(folder: Path, workers: int, phase: str, moment: str | None = None) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "tests._preempt_child", str(folder), str(workers), phase]
    return subprocess.Popen(
        args + ([moment] if moment else []), cwd=_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(child: subprocess.Popen[str], folder: Path, phase: str) -> dict[str, Any]:
    out, _ = child.communicate(timeout=_TIMEOUT_S)
    assert child.returncode == 0, out[-4000:]
    return torch.load(folder / f"{phase}.pt", weights_only=True)  # type: ignore[no-any-return]


def _check_resumes(folder: Path, workers: int, reference: dict[str, Any], run: dict[str, Any], what: str) -> None:
    assert run["preempted"], what
    resumed = _finish(_start(folder, workers, "resume"), folder, "resume")
    assert not resumed["preempted"]
    assert_same_stream(run["consumed"] + resumed["consumed"], reference["consumed"], what)
    assert torch.equal(resumed["model"], reference["model"]), what


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    out = {}
    for workers in (0, 2):
        folder = tmp_path_factory.mktemp(f"reference{workers}")
        out[workers] = _finish(_start(folder, workers, "run"), folder, "run")
        assert len(out[workers]["consumed"]) == 18  # 3 epochs of 6 batches
    return out


@pytest.mark.parametrize(
    "workers,moment",
    # inside a step mid-epoch, between epochs 0 and 1 and 1 and 2 (the state then
    # describes the next epoch), inside next() while an item is read (in the main
    # process: num_workers=0)
    [(0, "step:3"), (2, "step:3"), (0, "between:0"), (2, "between:0"), (2, "between:1"), (0, "next:7")],
)
def test_a_sigterm_at_a_given_instant_resumes_exactly(
    tmp_path: Path, references: dict[int, dict[str, Any]], workers: int, moment: str
) -> None:
    run = _finish(_start(tmp_path, workers, "run", moment), tmp_path, "run")
    _check_resumes(tmp_path, workers, references[workers], run, f"SIGTERM at {moment}, {workers} workers")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sigterm_at_random_moments_resumes_exactly(tmp_path: Path, references: dict[int, dict[str, Any]], workers: int) -> None:
    rng = random.Random(workers)
    tried = 0
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        folder.mkdir()
        child = _start(folder, workers, "run")
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.15))  # the run takes about 0.1-0.3 s of steps
        if child.poll() is None:
            child.send_signal(15)
        run = _finish(child, folder, "run")
        if not run["preempted"]:
            continue  # the run ended before the signal: nothing to resume
        tried += 1
        _check_resumes(folder, workers, references[workers], run, f"SIGTERM at random moment {attempt}, {workers} workers")
    assert tried, "every run ended before its signal"
