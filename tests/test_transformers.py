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


def test_a_resume_that_gradient_accumulation_would_misalign_is_refused(tmp_path: Path) -> None:
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers import TrainingArguments

    from snaploader.integrations.transformers import SnapTrainer

    from ._hf_child import Items, Tiny

    def trainer() -> SnapTrainer:
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 use_cpu=True, report_to=[], dataloader_num_workers=0)
        return SnapTrainer(model=Tiny(), args=args, train_dataset=Items(20))  # 5 batches an epoch

    try:
        saving = trainer()
        assert saving.args.ignore_data_skip, "SnapTrainer sets ignore_data_skip: the loader resumes itself"
        loader = saving.get_train_dataloader()
        it = iter(loader)
        next(it), next(it)
        (tmp_path / "checkpoint-1").mkdir()
        loader.save_to(tmp_path / "checkpoint-1")
        resuming = trainer()
        resuming._snap_resume = str(tmp_path / "checkpoint-1")  # what train(resume_from_checkpoint=path) records
        with pytest.raises(ValueError, match=r"2 batches into an epoch of 5 batches, with gradient_accumulation_steps=2"):
            resuming.get_train_dataloader()
    finally:
        # Accelerate keeps its state in process-wide singletons: leave none to other tests.
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
