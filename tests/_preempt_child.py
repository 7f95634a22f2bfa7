"""One training process of the preemption test (run by test_preemption.py).

``python -m tests._preempt_child DIR WORKERS PHASE [MOMENT]``: the loop of README.md and
docs/fault-tolerance.md ("Preemption"): a SIGTERM handler sets a flag, the loop saves the
model and the loader after the step (or after the epoch's loop) and exits; a resumed
run loads them and starts from ``loader.epoch``.

- ``PHASE`` ``run``: from scratch; ``resume``: from ``DIR/ckpt.pt``.
- ``MOMENT``, where the process sends itself SIGTERM: ``step:K`` inside the K-th
  training step (counted over the run), ``next:I`` inside ``next()`` while item I is
  read (num_workers=0, where items are read in the main process), ``between:E`` after
  epoch E's loop ended and before the next ``iter()``; absent: only a SIGTERM from the
  parent (it prints ``ready`` once the handler is installed) or none.

It writes ``DIR/<PHASE>.pt``: the batches its steps consumed, the model, and whether it
was preempted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

import snaploader

EPOCHS = 3


class Noisy(Dataset[torch.Tensor]):
    """Items draw from torch's RNG where they are read; ``signal_at`` sends SIGTERM while
    that item is read in the main process."""

    def __init__(self, signal_at: int | None) -> None:
        self.signal_at = signal_at

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.signal_at and torch.utils.data.get_worker_info() is None:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.002)
        return i + torch.rand(())


preempted = False


def on_sigterm(signum: int, frame: object) -> None:
    global preempted
    preempted = True  # acted on after the step


def main() -> None:
    folder, workers, phase = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    where, _, at = (sys.argv[4] if len(sys.argv) > 4 else "none:0").partition(":")
    moment = (where, int(at))
    signal.signal(signal.SIGTERM, on_sigterm)
    loader = snaploader.DataLoader(
        Noisy(moment[1] if where == "next" else None), batch_size=2, shuffle=True, num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    model = torch.zeros((), dtype=torch.float64)
    consumed: list[torch.Tensor] = []

    def save_and_exit() -> None:
        torch.save({"model": model, "loader": loader.state_dict()}, folder / "ckpt.pt")
        torch.save({"consumed": consumed, "model": model, "preempted": True}, folder / f"{phase}.pt")
        sys.exit(0)

    if phase == "resume":
        ckpt = torch.load(folder / "ckpt.pt", weights_only=True)
        model = ckpt["model"]
        loader.load_state_dict(ckpt["loader"])
    print("ready", flush=True)
    steps = 0
    for epoch in range(loader.epoch, EPOCHS):  # not an epoch number saved beside the state
        for batch in loader:
            if moment == ("step", steps):
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.003)
            model = model * 0.9 + batch.double().sum()  # the step: order matters
            consumed.append(batch)
            steps += 1
            if preempted:
                save_and_exit()
        if moment == ("between", epoch):
            os.kill(os.getpid(), signal.SIGTERM)
        if preempted:  # between epochs: the state describes the next epoch
            save_and_exit()
    torch.save({"consumed": consumed, "model": model, "preempted": False}, folder / f"{phase}.pt")


if __name__ == "__main__":
    main()
