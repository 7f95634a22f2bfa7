"""One process of a Lightning job of the DDP and Fabric tests (run by
test_lightning_ddp.py through ``_support.run_ranks``).

``python -m tests._lightning_child STACK PHASE DIR``; STACK is ``trainer`` (the
Lightning Trainer, ``strategy="ddp"`` on gloo when there are 2 ranks, with
``ExactResume`` and a ``ModelCheckpoint`` every 3 steps) or ``fabric`` (a Fabric loop
that calls ``fabric.save`` every 3 steps with ``fabric_state(loader)``), or
``trainer-plain`` (the Trainer without ``ExactResume``). PHASE:

- ``reference``: two epochs, uninterrupted;
- ``killed<K>``: killed with SIGKILL (every rank) once the checkpoint of step K is on disk;
- ``resumed<K>``: a fresh job resumed from the checkpoint of step K, to the end.

Each rank writes ``DIR/<phase><rank>.pt``: the batches its training step got, by
global step, and (when it finishes) the final weights. The dataset draws its
augmentation in two workers per rank (Augmented: all three global RNGs).
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import snaploader

from ._datasets import Augmented

EPOCHS = 2
EVERY = 3  # a checkpoint every 3 optimizer steps


def make_loader() -> snaploader.DataLoader:
    # 40 samples in batches of 4: 10 batches an epoch, 5 per rank with 2 ranks
    # (Lightning and Fabric put a DistributedSampler in the loader's place).
    return snaploader.DataLoader(Augmented(40), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch.float()).pow(2).mean()


def _record(out: Path, seen: dict[int, torch.Tensor], weights: dict[str, torch.Tensor] | None = None) -> None:
    torch.save({"seen": seen, "weights": weights}, out)


def _kill(out: Path, seen: dict[int, torch.Tensor]) -> None:
    _record(out, seen)
    os.kill(os.getpid(), signal.SIGKILL)


def trainer_main(phase: str, folder: Path, world: int, exact: bool) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from snaploader.integrations.lightning import ExactResume

    rank = int(os.environ.get("RANK", 0))
    out = folder / f"{phase}{rank}.pt"
    kill_at = int(phase[len("killed"):]) if phase.startswith("killed") else None

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _model()
            self.seen: dict[int, torch.Tensor] = {}

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen[self.global_step] = batch.clone()
            return _loss(self.layer, batch)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            # The checkpoint of step kill_at was written (all ranks waited for it) at
            # the end of the previous step.
            if self.global_step == kill_at:
                _kill(out, self.seen)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=EVERY, save_top_k=-1)]
    if exact:
        callbacks.append(ExactResume())
    ckpt_path = None
    if phase.startswith("resumed"):
        (ckpt_path,) = (folder / "ckpt").glob(f"*-step={phase[len('resumed'):]}.ckpt")
    trainer = pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        enable_progress_bar=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=callbacks, enable_checkpointing=True,
    )
    module = Recorder()
    trainer.fit(module, train_dataloaders=make_loader(), ckpt_path=ckpt_path)
    _record(out, module.seen, {k: v.clone() for k, v in module.layer.state_dict().items()})


def fabric_main(phase: str, folder: Path, world: int) -> None:
    from lightning.fabric import Fabric

    from snaploader.integrations.lightning import fabric_state

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    out = folder / f"{phase}{fabric.global_rank}.pt"
    kill_at = int(phase[len("killed"):]) if phase.startswith("killed") else None
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(make_loader())
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": fabric_state(loader), "epoch": 0, "step": 0}
    if phase.startswith("resumed"):
        fabric.load(folder / f"fabric-{phase[len('resumed'):]}.ckpt", state)
    seen: dict[int, torch.Tensor] = {}
    epoch, step = state["epoch"], state["step"]
    while epoch < EPOCHS:
        for batch in loader:
            seen[step] = batch.clone()
            fabric.backward(_loss(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % EVERY == 0:
                state.update(epoch=epoch, step=step)
                fabric.save(folder / f"fabric-{step}.ckpt", state)
            if step == kill_at:
                fabric.barrier()  # rank 0 has written the file
                _kill(out, seen)
        epoch += 1
    _record(out, seen, {k: v.clone() for k, v in model.state_dict().items()})


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    stack, phase, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    world = int(os.environ.get("WORLD_SIZE", 1))
    if stack == "fabric":
        fabric_main(phase, folder, world)
    else:
        trainer_main(phase, folder, world, exact=stack == "trainer")
