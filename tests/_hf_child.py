"""One process of a Hugging Face Trainer job of the transformers tests (run by
test_transformers.py through ``_support.run_ranks``; with 2 processes, as torchrun
starts them, on gloo).

``python -m tests._hf_child PHASE DIR``, PHASE one of:

- ``reference``: two epochs, uninterrupted;
- ``killed<K>``: checkpoints every 2 steps, killed with SIGKILL (every process) at
  step K;
- ``resumed<K>``: a fresh job, ``train(resume_from_checkpoint=DIR/run/checkpoint-<K>)``;
  ``resumed-last``: ``train(resume_from_checkpoint=True)`` (the last checkpoint).

The script is the plain Trainer's with two lines changed (the import and the class).
Each process writes ``DIR/<phase><rank>.pt``: the batches its training step got, in
order, and (when it finishes) the final weights. 48 samples in batches of 4: 12
batches an epoch with one process, with gradient accumulation over 2 (6 steps); 6 a
process with two, without accumulation (6 steps).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from snaploader.integrations.transformers import SnapTrainer

from ._datasets import Augmented


class Items(Augmented):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"x": super().__getitem__(i).float()}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.linear(x).pow(2).mean()}


class Recording(SnapTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed: list[torch.Tensor] = []

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.consumed.append(inputs["x"].detach().clone())
        return super().training_step(model, inputs, num_items_in_batch)


class KillAt(TrainerCallback):
    def __init__(self, trainer: Recording, step: int, out: Path) -> None:
        self.trainer, self.step, self.out = trainer, step, out

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            torch.save({"seen": self.trainer.consumed, "weights": None}, self.out)
            os.kill(os.getpid(), signal.SIGKILL)


def main(phase: str, folder: Path) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    args = TrainingArguments(
        output_dir=str(folder / "run"),
        num_train_epochs=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2 if world == 1 else 1,
        learning_rate=0.1,
        save_strategy="no" if phase == "reference" else "steps",
        save_steps=2,
        dataloader_num_workers=2,
        use_cpu=True,
        ddp_backend="gloo" if world > 1 else None,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        seed=3,
    )
    torch.manual_seed(0)
    trainer = Recording(model=Tiny(), args=args, train_dataset=Items(48))
    out = folder / f"{phase}{args.process_index}.pt"
    if phase.startswith("killed"):
        trainer.add_callback(KillAt(trainer, int(phase[len("killed"):]), out))
    resume: str | bool | None = None
    if phase == "resumed-last":
        resume = True
    elif phase.startswith("resumed"):
        resume = str(folder / "run" / f"checkpoint-{phase[len('resumed'):]}")
    trainer.train(resume_from_checkpoint=resume)
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.save({"seen": trainer.consumed, "weights": weights}, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
