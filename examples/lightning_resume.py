"""A Lightning ``Trainer`` whose batch stream resumes exactly after a kill: add
``ExactResume()`` to the callbacks (docs/lightning.md). ``fit(ckpt_path="last")`` then
goes on with the batch after the checkpoint's, with the augmentations the uninterrupted
run drew.

Run it where lightning is installed (``pip install -e '.[integrations]'`` from the
repository root)::

    python examples/lightning_resume.py

It trains a tiny model for two epochs on a dataset that augments in its workers
(``torch.rand`` in ``__getitem__``, ``num_workers=2``) three ways, each in a fresh
process: uninterrupted; with a checkpoint every 3 steps (``ModelCheckpoint``, with
``save_last=True``, which ``ckpt_path="last"`` needs) and SIGKILLed right after the
checkpoint of step 3 (mid epoch 0), or of step 12 (mid epoch 1); resumed from the last
checkpoint. It checks with ``torch.equal`` that the batches the training step received
across the killed run (up to its checkpoint) and the resumed run are those of the
uninterrupted run, and that the final weights are equal; it prints one line per case
and exits with status 1 on a difference. ``tests/test_examples.py`` runs it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset

import snaploader
from snaploader.integrations.lightning import ExactResume

EPOCHS = 2
EVERY = 3  # steps between checkpoints; an epoch is 10 steps (40 samples, batch 4)


class Augmented(Dataset[torch.Tensor]):
    """A sample's index and a random augmentation drawn in the worker."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.cat([torch.tensor([float(i)]), torch.rand(3)])


class Tiny(pl.LightningModule):
    def __init__(self, kill_at: int | None, record: Path) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.kill_at, self.record = kill_at, record
        self.seen: dict[int, torch.Tensor] = {}  # the example's own: what each step received

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[self.global_step] = batch.clone()
        return self.layer(batch).pow(2).mean()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.kill_at:  # the checkpoint of this step is on disk
            torch.save({"seen": self.seen}, self.record)
            os.kill(os.getpid(), signal.SIGKILL)  # as a preempted node would

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def train(folder: Path, phase: str, kill_at: int | None) -> None:
    loader: snaploader.DataLoader[torch.Tensor] = snaploader.DataLoader(
        Augmented(), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5))
    trainer = pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ExactResume(), ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=EVERY,
                                                  save_top_k=-1, save_last=True)],
    )
    model = Tiny(kill_at, folder / f"{phase}.pt")
    trainer.fit(model, train_dataloaders=loader, ckpt_path="last" if phase == "resumed" else None)
    torch.save({"seen": model.seen, "weights": model.layer.state_dict()}, folder / f"{phase}.pt")


def _run(folder: Path, phase: str, kill_at: int | None = None) -> None:
    """One run in a fresh process; the killed one must die by its SIGKILL."""
    done = subprocess.run([sys.executable, __file__, str(folder), phase, str(kill_at)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != (-signal.SIGKILL if phase == "killed" else 0):
        raise SystemExit(f"the {phase} run ended with status {done.returncode}")


def main() -> int:
    failed = False
    with tempfile.TemporaryDirectory() as root:
        reference = Path(root, "reference")
        _run(reference, "reference")
        want = torch.load(reference / "reference.pt", weights_only=True)
        for kill_at in (3, 12):  # mid epoch 0, mid epoch 1
            folder = Path(root, f"killed_{kill_at}")
            _run(folder, "killed", kill_at)
            _run(folder, "resumed")
            killed = torch.load(folder / "killed.pt", weights_only=True)["seen"]
            resumed = torch.load(folder / "resumed.pt", weights_only=True)
            got = {**killed, **resumed["seen"]}
            same_batches = sorted(got) == sorted(want["seen"]) and all(
                torch.equal(got[step], want["seen"][step]) for step in want["seen"])
            same_weights = all(torch.equal(resumed["weights"][k], want["weights"][k]) for k in want["weights"])
            failed |= not (same_batches and same_weights)
            print(f"killed after the checkpoint of step {kill_at}, resumed with ckpt_path='last': "
                  f"{len(got)} batches {'identical' if same_batches else 'DIFFER'}, "
                  f"final weights {'identical' if same_weights else 'DIFFER'}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4:  # one run, in a process of its own
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        train(Path(sys.argv[1]), sys.argv[2], None if sys.argv[3] == "None" else int(sys.argv[3]))
    else:
        sys.exit(main())
