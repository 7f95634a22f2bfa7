"""Lightning under DDP (2 gloo ranks on loopback) and Lightning Fabric: a job killed
with SIGKILL after its checkpoints and resumed in fresh processes gives every rank's
training step the batches of the uninterrupted job, and ends with its weights bit for
bit (``ExactResume``, ``fabric_state``; docs/lightning.md). Without the callback, a DDP
resume runs, with a warning, where torch's loader runs; another world size is refused,
naming snaploader.distributed.reshard. Real ``lightning``; the jobs are
``tests/_lightning_child.py``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from ._support import assert_same_stream, run_ranks

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[integrations]')")

pytestmark = pytest.mark.integration

_JOB_TIMEOUT_S = 300
# world -> (the step at which the killed job dies, the checkpoints it wrote before that
# each resumed in a fresh job): mid epoch 0 and mid epoch 1 (5 steps an epoch with 2
# ranks, 10 with one process; a checkpoint every 3 steps).
_CUTS = {1: (13, (3, 12)), 2: (7, (3, 6))}


def _job(stack: str, phase: str, folder: Path, world: int, expect: int = 0) -> list[dict[str, Any]]:
    """Run one job of ``world`` ranks; each rank's record (batches by step, weights)."""
    results = run_ranks(["tests._lightning_child", stack, phase, str(folder)], world, _JOB_TIMEOUT_S)
    for rank, (code, log) in enumerate(results):
        assert code == expect, f"rank {rank} of the {stack} {phase} job exited with {code}:\n{log[-4000:]}"
    return [torch.load(folder / f"{phase}{rank}.pt", weights_only=True) for rank in range(world)]


def _assert_resumes_exactly(stack: str, folder: Path, world: int) -> None:
    reference = _job(stack, "reference", folder, world)
    killed_at, resumed_from = _CUTS[world]
    killed = _job(stack, f"killed{killed_at}", folder, world, expect=-signal.SIGKILL)
    for step in resumed_from:
        resumed = _job(stack, f"resumed{step}", folder, world)
        for rank in range(world):
            seen = {s: b for s, b in killed[rank]["seen"].items() if s < step} | resumed[rank]["seen"]
            expected = reference[rank]["seen"]
            assert sorted(seen) == sorted(expected), f"rank {rank}, resumed from step {step}: steps {sorted(seen)}"
            assert_same_stream([seen[s] for s in sorted(seen)], [expected[s] for s in sorted(expected)],
                               f"{stack}, rank {rank}, resumed from step {step}")
            for name, weight in reference[rank]["weights"].items():
                assert torch.equal(resumed[rank]["weights"][name], weight), f"{stack}, rank {rank}, step {step}: {name} differs"
    if world == 2:
        firsts = [reference[rank]["seen"][0][:, 0].tolist() for rank in range(2)]
        assert firsts[0] != firsts[1], "the ranks should read different samples"


def test_trainer_ddp_with_exact_resume_resumes_every_rank_exactly(tmp_path: Path) -> None:
    _assert_resumes_exactly("trainer", tmp_path, 2)
    # Without the callback (a checkpoint Lightning loads as rank 0's state on every
    # rank) rank 1 refuses to resume inexactly, before training, and says what to add.
    plain = run_ranks(["tests._lightning_child", "trainer-plain", "resumed3", str(tmp_path)], 2, _JOB_TIMEOUT_S)
    assert plain[1][0] != 0, plain[1][1][-4000:]
    assert "CheckpointMismatchError" in plain[1][1] and "rank 1's loader, given rank 0's state" in plain[1][1], plain[1][1][-4000:]
    assert "ExactResume()" in plain[1][1]
    # Another world size: a clear error naming the way to change it.
    ((code, log),) = run_ranks(["tests._lightning_child", "trainer", "resumed6", str(tmp_path)], 1, _JOB_TIMEOUT_S)
    assert code != 0 and "CheckpointMismatchError" in log and "loader states of 2 rank(s), and this run has 1" in log, log[-4000:]
    assert "snaploader.distributed.reshard" in log


@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "two-gloo-ranks"])
def test_fabric_with_fabric_state_resumes_every_rank_exactly(tmp_path: Path, world: int) -> None:
    _assert_resumes_exactly("fabric", tmp_path, world)
