"""A Hugging Face ``Trainer`` script made to resume its batch stream exactly, by changing
two lines: the import of ``SnapTrainer`` and ``Trainer(`` -> ``SnapTrainer(``
(docs/transformers.md). ``train(resume_from_checkpoint=True)`` then goes on with the
batch after the checkpoint's, with the augmentations the uninterrupted run drew.

Run it where transformers is installed (``pip install -e '.[integrations]'`` from the repository root)::

    python examples/hf_trainer_resume.py

It trains a tiny model for two epochs on a dataset that augments in its workers
(``torch.rand`` in ``__getitem__``, ``dataloader_num_workers=2``) three ways, each in a
fresh process: uninterrupted; saving a checkpoint every 4 steps and SIGKILLed right
after the checkpoint of step 4 (mid epoch 0), or of step 16 (mid epoch 1); resumed
from that checkpoint. It checks with ``torch.equal`` that the batches the training step
received across the killed run (up to its checkpoint) and the resumed run are those of
the uninterrupted run, prints one line per case and exits with status 1 on a
difference. ``tests/test_transformers.py`` runs the same recipe on one process and on
two (torchrun-style, gloo), final weights included.
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
from transformers import TrainerCallback, TrainingArguments

from snaploader.integrations.transformers import SnapTrainer  # changed line 1 of 2

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


class Recording(SnapTrainer):
    """The example's own: keeps what the training step received, to compare runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed: list[torch.Tensor] = []

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.consumed.append(inputs["x"].detach().clone())
        return super().training_step(model, inputs, num_items_in_batch)


class KillAfterCheckpoint(TrainerCallback):
    """The crash: once the checkpoint of step ``step`` is on disk, record what was
    consumed and SIGKILL this process."""

    def __init__(self, trainer: Recording, step: int, out: Path) -> None:
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
        per_device_train_batch_size=4,
        dataloader_num_workers=2,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    # changed line 2 of 2: SnapTrainer( in place of Trainer( (Recording adds the record)
    trainer = Recording(model=Tiny(), args=args, train_dataset=Augmented())
    out = folder / f"{phase}.pt"
    if phase == "killed":
        # after SnapTrainer's own callback (added in __init__), so the loader's state is saved first
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
