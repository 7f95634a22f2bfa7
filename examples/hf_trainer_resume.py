"""A Hugging Face ``Trainer`` whose ``get_train_dataloader`` returns a snaploader loader
resumes the batch stream exactly with ``train(resume_from_checkpoint=True)``
(docs/accelerate.md, "Hugging Face Trainer").

Not in CI: ``transformers`` is heavy for it. Run it where transformers is installed::

    python examples/hf_trainer_resume.py

It trains a tiny model for two epochs on a dataset that augments in its workers
(``torch.rand`` in ``__getitem__``, ``num_workers=2``) three ways, each in a fresh
process: uninterrupted; saving a checkpoint every 4 steps and SIGKILLed right after
the checkpoint of step 4 (mid epoch 0), or of step 16 (mid epoch 1); resumed from that
checkpoint. It checks with ``torch.equal`` that the batches the training step received
across the killed run (up to its checkpoint) and the resumed run are those of the
uninterrupted run, prints one line per case and exits with status 1 on a difference.

The recipe, as below: the loader goes through ``snaploader.integrations.accelerate
.prepare(trainer.accelerator, loader)``; a callback writes its state into each
checkpoint folder (``on_save``) and reads it back when training resumes
(``on_train_begin``); and ``TrainingArguments(ignore_data_skip=True)``, since the
loader resumes itself (without it, the Trainer would skip the first batches again by
rebuilding the loader as torch's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

import snaploader
from snaploader.integrations.accelerate import PreparedLoader, prepare

STEPS_PER_EPOCH = 12  # 48 samples in batches of 4
SAVE_EVERY = 4


class Augmented(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.cat([torch.tensor([float(i)]), torch.rand(3)])}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.linear(x).pow(2).mean()}


class SnaploaderCheckpoints(TrainerCallback):
    """Each process writes its loader's state into every checkpoint folder the Trainer
    makes, and reads it back when a run resumes from one."""

    def __init__(self, trainer: SnapTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.train_loader().save_to(Path(args.output_dir) / f"checkpoint-{state.global_step}")

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer has loaded trainer_state.json of the checkpoint it resumes from.
        if state.global_step > 0:
            self.trainer.train_loader().load_from(Path(args.output_dir) / f"checkpoint-{state.global_step}")


class SnapTrainer(Trainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loader: PreparedLoader | None = None
        self.consumed: list[torch.Tensor] = []
        self.add_callback(SnaploaderCheckpoints(self))

    def train_loader(self) -> PreparedLoader:
        if self._loader is None:
            loader: snaploader.DataLoader[dict[str, torch.Tensor]] = snaploader.DataLoader(
                Augmented(), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0)
            )
            self._loader = prepare(self.accelerator, loader)
        return self._loader

    def get_train_dataloader(self) -> Any:
        return self.train_loader()

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.consumed.append(inputs["x"].detach().clone())
        return super().training_step(model, inputs, num_items_in_batch)


class KillAfterCheckpoint(TrainerCallback):
    """The crash: once the checkpoint of step ``step`` is on disk, record what was
    consumed and SIGKILL this process."""

    def __init__(self, trainer: SnapTrainer, step: int, out: Path) -> None:
        self.trainer, self.step, self.out = trainer, step, out

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            torch.save(self.trainer.consumed, self.out)
            os.kill(os.getpid(), signal.SIGKILL)


def _run(phase: str, folder: Path, kill_at: int) -> None:
    args = TrainingArguments(
        output_dir=str(folder / "run"),
        num_train_epochs=2,
        save_strategy="no" if phase == "reference" else "steps",
        save_steps=SAVE_EVERY,
        ignore_data_skip=True,  # the loader resumes itself
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    trainer = SnapTrainer(model=Tiny(), args=args)
    out = folder / f"{phase}.pt"
    if phase == "killed":
        # after the SnaploaderCheckpoints callback added in __init__, so the loader's state is saved first
        trainer.add_callback(KillAfterCheckpoint(trainer, kill_at, out))
    trainer.train(resume_from_checkpoint=True if phase == "resumed" else None)
    torch.save(trainer.consumed, out)


def _phase(phase: str, folder: Path, kill_at: int) -> int:
    child = subprocess.run([sys.executable, __file__, phase, str(folder), str(kill_at)], capture_output=True, text=True)
    if child.returncode not in (0, -signal.SIGKILL):
        sys.stderr.write(child.stdout[-3000:] + child.stderr[-3000:])
        raise SystemExit(f"the {phase} run failed with status {child.returncode}")
    return child.returncode


def main() -> int:
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _phase("reference", root, 0)
        reference = torch.load(root / "reference.pt", weights_only=True)
        for kill_at in (SAVE_EVERY, STEPS_PER_EPOCH + SAVE_EVERY):
            folder = root / f"kill{kill_at}"
            folder.mkdir()
            assert _phase("killed", folder, kill_at) == -signal.SIGKILL, "the killed run should die by SIGKILL"
            _phase("resumed", folder, kill_at)
            stitched = torch.load(folder / "killed.pt", weights_only=True) + torch.load(folder / "resumed.pt", weights_only=True)
            same = len(stitched) == len(reference) and all(torch.equal(a, b) for a, b in zip(stitched, reference))
            epoch, step = divmod(kill_at, STEPS_PER_EPOCH)
            print(
                f"killed after the checkpoint of step {kill_at} (epoch {epoch}, step {step}), resumed: "
                f"{len(stitched)} batches, the uninterrupted run's {len(reference)}: "
                + ("identical" if same else "DIFFERENT")
            )
            failures += not same
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) == 4:
        _run(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(main())
