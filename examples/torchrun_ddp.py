"""Plain DDP under ``torchrun``: two ranks (gloo, CPU), a rank killed mid-epoch, the group
restarted by ``torchrun --max-restarts``, and every rank's batch stream resumed exactly
from its own state file (docs/distributed.md, "A torchrun script").

Run it::

    python examples/torchrun_ddp.py

which launches the training part three times with torchrun, each time as::

    torchrun --nproc-per-node 2 --master-port PORT --max-restarts 1 examples/torchrun_ddp.py OUT KILL_STEP

first uninterrupted, then twice with rank 1 SIGKILLed right after the checkpoint of
step KILL_STEP: once in epoch 0, once in epoch 1. torchrun sees the dead
rank, stops the other and starts both again; they load their checkpoint and go on. The
script then checks that each rank's training step received, across the killed run (up
to its checkpoint) and the restarted one, exactly the batches of the uninterrupted run,
augmentations included, and that the final weights are equal; it prints one line per
rank and case and exits with status 1 on a difference. ``tests/test_examples.py`` runs it.

What a training script needs, beside an ordinary DDP loop:

- one state file per rank: ``loader.state_dict()`` is this rank's position in its
  shard, so every rank saves its own (here with the model and the optimizer, which
  are the same on every rank);
- the step and epoch saved with it, since ``enumerate(loader)`` counts from 0 again
  after a resume;
- on torch 2.13, a fresh store prefix per restart attempt (``TORCHELASTIC_RESTART_COUNT``)
  under torchrun's default rendezvous (a fixed ``--master-port``): its store outlives
  the attempt, the restarted ranks otherwise read the dead attempt's gloo addresses
  from it and fail in ``connectFullMesh`` with "Connection refused", with or without
  snaploader. (``--standalone`` makes a fresh store for each attempt; the prefix is
  harmless there.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

import snaploader

EPOCHS = 2
SAVE_EVERY = 2  # steps; an epoch is 6 steps per rank (48 samples, 2 ranks, batch 4)


class Augmented(Dataset[torch.Tensor]):
    """A sample's index and a random augmentation drawn in the worker."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.cat([torch.tensor([float(i)]), torch.rand(3)])


def save(path: Path, state: dict[str, Any]) -> None:
    """Written whole or not at all: a rank killed while saving leaves the last checkpoint."""
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def train(out: Path, kill_step: int) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler: DistributedSampler[torch.Tensor] = DistributedSampler(Augmented(), shuffle=True, seed=7)
    loader: snaploader.DataLoader[torch.Tensor] = snaploader.DataLoader(
        Augmented(), batch_size=4, sampler=sampler, num_workers=2, generator=torch.Generator().manual_seed(1))

    checkpoint = out / f"ckpt_rank{rank}.pt"
    epoch, step = 0, 0
    received: list[torch.Tensor] = []  # the example's own record of the batches, to compare runs
    if checkpoint.exists():  # a restart: this rank's own state
        state = torch.load(checkpoint, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        epoch, step, received = state["epoch"], state["step"], state["received"]

    while epoch < EPOCHS:
        sampler.set_epoch(epoch)
        for batch in loader:  # after a restore: the batch after the checkpoint's
            received.append(batch)
            optimizer.zero_grad()
            model(batch).pow(2).mean().backward()
            optimizer.step()
            step += 1
            if step % SAVE_EVERY == 0:
                save(checkpoint, {"epoch": epoch, "step": step, "loader": loader.state_dict(),
                                  "model": model.module.state_dict(),
                                  "optimizer": optimizer.state_dict(), "received": received})
                # Every rank has saved this step before any goes on; a rank that dies
                # between two ranks' saves leaves files of two steps, which a real run
                # should tell apart (compare the ranks' "step" after loading).
                dist.barrier()
                if step == kill_step and rank == 1 and attempt == 0:
                    os.kill(os.getpid(), signal.SIGKILL)  # as a preempted node would
        epoch += 1
    save(out / f"final_rank{rank}.pt", {"model": model.module.state_dict(), "received": received})
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launch(out: Path, kill_step: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "--max-restarts", "1", __file__, str(out), str(kill_step)],
        check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        reference = Path(folder, "reference")
        reference.mkdir()
        launch(reference, kill_step=-1)
        failed = False
        for kill_step in (4, 10):  # mid epoch 0, mid epoch 1
            run = Path(folder, f"killed_{kill_step}")
            run.mkdir()
            launch(run, kill_step)
            for rank in range(2):
                want = torch.load(reference / f"final_rank{rank}.pt", weights_only=True)
                got = torch.load(run / f"final_rank{rank}.pt", weights_only=True)
                same_batches = len(got["received"]) == len(want["received"]) and all(
                    torch.equal(a, b) for a, b in zip(got["received"], want["received"]))
                same_weights = all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
                ok = same_batches and same_weights
                failed |= not ok
                print(f"rank {rank}, killed after step {kill_step} and restarted by torchrun: "
                      f"{len(got['received'])} batches {'identical' if same_batches else 'DIFFER'}, "
                      f"final weights {'identical' if same_weights else 'DIFFER'}")
    return 1 if failed else 0


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by torchrun
        train(Path(sys.argv[1]), int(sys.argv[2]))
    else:
        sys.exit(main())
