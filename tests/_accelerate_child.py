"""One process of the Accelerate test (run by test_accelerate.py).

``python -m tests._accelerate_child PHASE DIR``; with several processes the parent sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, and
``Accelerator(cpu=True)`` joins a gloo group on loopback. Each process writes what the
training loop consumed to ``DIR/<phase><rank>.pt``, one list of batches per epoch:

- ``reference``: two epochs, uninterrupted;
- ``save``: ``accelerator.save_state(DIR/ckpt0)`` after 2 batches of epoch 0 and
  ``save_state(DIR/ckpt1)`` after 3 batches of epoch 1, recording the batches consumed
  before each save; then the process kills itself with SIGKILL;
- ``load0`` / ``load1``: a new Accelerator and loader in this fresh process,
  ``load_state(DIR/ckpt<k>)``, then the rest of the two epochs.

The dataset draws its augmentation in the workers (torch.rand, random, NumPy), and a
number of draws that depends on the sample (as a crop retried until it fits would): the
processes read different samples, so their worker RNG states part, and a process
resumed from another's state, or from a fresh state, yields other batches.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

import snaploader
from snaploader.integrations.accelerate import PreparedLoader, prepare

from ._datasets import Augmented

EPOCHS = 2
CUTS = {0: 2, 1: 3}  # epoch -> batches consumed before save_state


class RetriedAugmentation(Augmented):
    def __getitem__(self, i: int) -> torch.Tensor:
        torch.rand(i % 3)  # discarded tries
        return super().__getitem__(i)


def _prepared(accelerator: Accelerator) -> PreparedLoader:
    # 44 samples in batches of 4: 11 batches, which two processes share as 6 each
    # (Accelerate's even_batches wraps around to the first samples).
    loader: snaploader.DataLoader[torch.Tensor] = snaploader.DataLoader(
        RetriedAugmentation(44), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5)
    )
    return prepare(accelerator, loader)


def main(phase: str, folder: Path) -> None:
    accelerator = Accelerator(cpu=True)
    loader = _prepared(accelerator)
    out = folder / f"{phase}{accelerator.process_index}.pt"
    start_epoch = 0
    if phase.startswith("load"):
        start_epoch = int(phase[-1])
        accelerator.load_state(str(folder / f"ckpt{start_epoch}"))
    stream: list[list[torch.Tensor]] = [[] for _ in range(EPOCHS)]
    for epoch in range(start_epoch, EPOCHS):
        for batch in loader:
            stream[epoch].append(batch)
            if phase == "save" and len(stream[epoch]) == CUTS[epoch]:
                accelerator.save_state(str(folder / f"ckpt{epoch}"))
                if epoch == EPOCHS - 1:
                    accelerator.wait_for_everyone()
                    torch.save(stream, out)
                    os.kill(os.getpid(), signal.SIGKILL)
    torch.save(stream, out)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
