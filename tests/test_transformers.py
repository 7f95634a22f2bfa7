"""The Hugging Face Trainer through ``snaploader.integrations.transformers.SnapTrainer``
(the plain Trainer script with two lines changed): a job killed with SIGKILL after its
checkpoints and resumed in fresh processes, with ``resume_from_checkpoint=True`` and
with a path, gives each process's training step the batches of the uninterrupted job
and ends with its weights, bit for bit; one process with gradient accumulation, and two
gloo processes as torchrun starts them (docs/transformers.md). Real ``transformers``;
the jobs are ``tests/_hf_child.py``."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from ._support import assert_same_stream, run_ranks

pytest.importorskip("transformers", reason="the Trainer tests need transformers (pip install -e '.[integrations]')")

pytestmark = pytest.mark.integration

_JOB_TIMEOUT_S = 300
_KILLED_AT = 9  # after the checkpoints of steps 2, 4, 6 and 8 (6 steps an epoch)
# phase -> the checkpoint it resumes from: the last one (True, so first, before a
# resumed job writes newer ones), mid epoch 0, the end of epoch 0.
_RESUMES = {"resumed-last": 8, "resumed4": 4, "resumed6": 6}


def _job(phase: str, folder: Path, world: int, expect: int = 0) -> list[dict[str, Any]]:
    results = run_ranks(["tests._hf_child", phase, str(folder)], world, _JOB_TIMEOUT_S)
    for rank, (code, log) in enumerate(results):
        assert code == expect, f"process {rank} of the {phase} job exited with {code}:\n{log[-4000:]}"
    return [torch.load(folder / f"{phase}{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2], ids=["one-process-accumulating", "two-gloo-processes"])
def test_snap_trainer_resumes_every_process_exactly(tmp_path: Path, world: int) -> None:
    accumulation = 2 if world == 1 else 1  # as in tests/_hf_child.py
    reference = _job("reference", tmp_path, world)
    killed = _job(f"killed{_KILLED_AT}", tmp_path, world, expect=-signal.SIGKILL)
    assert len(reference[0]["seen"]) == 24 // world
    for phase, step in _RESUMES.items():
        resumed = _job(phase, tmp_path, world)
        for rank in range(world):
            got = killed[rank]["seen"][: step * accumulation] + resumed[rank]["seen"]
            assert_same_stream(got, reference[rank]["seen"], f"process {rank}, {phase}")
            for name, weight in reference[rank]["weights"].items():
                assert torch.equal(resumed[rank]["weights"][name], weight), f"process {rank}, {phase}: {name} differs"
    if world == 2:
        assert not torch.equal(reference[0]["seen"][0], reference[1]["seen"][0]), "the processes should read different batches"
