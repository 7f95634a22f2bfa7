"""One run of a Lightning job under SLURM's auto-requeue, for test_lightning_preemption.py.

``python -m tests._lightning_slurm_child KIND PHASE DIR MOMENT SEED``, with the SLURM
variables set by the caller (Lightning then selects ``SLURMEnvironment`` and, with
``auto_requeue=True``, installs its SIGUSR1 handler, which writes
``DIR/root/hpc_ckpt_1.ckpt`` and calls ``scontrol requeue``, a stub on ``PATH``). KIND is
``map`` (a shuffled map-style dataset) or ``iterable`` (an IterableDataset without
``__len__``, which Lightning reads one batch ahead); two workers, ``ExactResume``. PHASE:

- ``reference``: two epochs, uninterrupted;
- ``signalled``: SIGUSR1 during step ``SIGNAL_STEP``, at MOMENT: ``training_step``,
  ``on_train_batch_start`` or ``on_train_batch_end`` (sent from that hook), or ``timer``
  (from a thread, at a moment drawn from SEED within the step or the next fetch); once
  the handler has written its checkpoint the process kills itself with SIGKILL, as
  SLURM ends a requeued job;
- ``relaunched``: the job started again (``ckpt_path=None``: Lightning finds the hpc
  checkpoint itself), to the end.

It writes ``DIR/<phase>.pt``: the batch of every global step and (when it finishes)
the final weights.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import snaploader

from ._datasets import Augmented
from ._iterable_datasets import IteratorStateStream

SIGNAL_STEP = 13  # epoch 1, step 3 of 10
_STEP_S = 0.03  # each training step takes this long, so that a timer lands inside one


def make_loader(kind: str) -> snaploader.DataLoader:
    dataset = Augmented(40) if kind == "map" else IteratorStateStream(n=40)
    return snaploader.DataLoader(dataset, batch_size=4, shuffle=kind == "map" or None, num_workers=2,
                                 generator=torch.Generator().manual_seed(5))


def main(kind: str, phase: str, folder: Path, moment: str, seed: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from snaploader.integrations.lightning import ExactResume

    out = folder / f"{phase}.pt"
    root = folder / "root"
    hpc = root / "hpc_ckpt_1.ckpt"
    signalled = phase == "signalled"

    def send() -> None:
        os.kill(os.getpid(), signal.SIGUSR1)

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(1, 1)
            self.seen: dict[int, torch.Tensor] = {}

        def _at(self, hook: str) -> None:
            if not signalled:
                return
            if hpc.exists():
                torch.save({"seen": self.seen, "weights": None}, out)
                os.kill(os.getpid(), signal.SIGKILL)
            if self.global_step == SIGNAL_STEP and hook == moment:
                send()
            if self.global_step == SIGNAL_STEP and hook == "on_train_batch_start" and moment == "timer":
                threading.Timer(random.Random(seed).uniform(0, 1.5 * _STEP_S), send).start()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._at("on_train_batch_start")

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen[self.global_step] = batch.clone()
            self._at("training_step")
            for _ in range(6):
                time.sleep(_STEP_S / 6)  # the handler runs between these
            return self.layer(batch[:, :1].float()).pow(2).mean()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._at("on_train_batch_end")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
        enable_model_summary=False, num_sanity_val_steps=0, enable_checkpointing=False,
        default_root_dir=root, callbacks=[ExactResume()], plugins=[SLURMEnvironment(auto_requeue=True)],
    )
    module = Recorder()
    trainer.fit(module, train_dataloaders=make_loader(kind))
    torch.save({"seen": module.seen, "weights": module.layer.weight.detach().clone()}, out)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
