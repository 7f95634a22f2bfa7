"""One rank of the world-size tests (run by test_world_size.py).

``python -m tests._world_child PHASE RANK SIZE OLD_SIZE PORT OUT``, gloo on 127.0.0.1:

- ``save`` (SIZE == OLD_SIZE ranks): a loader over this rank's DistributedSampler
  shard; take ``_CUT`` batches of the epoch, save ``state_dict()`` to
  ``OUT/state<RANK>.pt``, then record the rest of the epoch and the next one (the
  uninterrupted stream);
- ``load`` (SIZE new ranks): read all OLD_SIZE ranks' files, ``snaploader.distributed.
  reshard`` onto this rank of SIZE, record the rest of the epoch and the next one.
  From a 2-rank run the states are read from a DCP checkpoint the ranks also saved
  (``snaploader.dcp_state``, then ``snaploader.distributed.dcp_states`` on the new ranks).

With ``SNAPLOADER_TEST_PER_SAMPLE=1`` in the environment the loaders are built with
``seed_per_sample=True``; with ``SNAPLOADER_TEST_NEW_BATCH=B`` the new ranks' loaders
have a per-rank batch of B (``reshard(..., allow_mismatch=("batch_size",))``) and a
generator seed of their own (2; the old ones': batch 3, seed 1). The dataset draws
"augmentations" from the workers' RNGs (num_workers=2), and 62 samples on 4 ranks make
DistributedSampler pad 2 repeats. Each rank writes
``OUT/<PHASE><SIZE>_<RANK>.pt`` (``..._b<B>_<RANK>.pt`` with a new batch): {consumed,
rest, following}, lists of batches.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data.distributed import DistributedSampler

import snaploader

from ._datasets import Augmented

_N = 62
_EPOCH = 1
_CUT = 2


_NEW_BATCH = int(os.environ.get("SNAPLOADER_TEST_NEW_BATCH", "0"))


def make_loader(sampler: Any, batch_size: int = 3, seed: int = 1) -> snaploader.DataLoader[Any]:
    return snaploader.DataLoader(
        Augmented(_N), batch_size=batch_size, sampler=sampler, num_workers=2, generator=torch.Generator().manual_seed(seed),
        seed_per_sample=os.environ.get("SNAPLOADER_TEST_PER_SAMPLE") == "1",
    )


def make_new_loader(sampler: Any) -> snaploader.DataLoader[Any]:
    return make_loader(sampler, _NEW_BATCH, seed=2)


def main(phase: str, rank: int, size: int, old_size: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        consumed: list[Any] = []
        if phase == "save":
            sampler = DistributedSampler(Augmented(_N), num_replicas=size, rank=rank, shuffle=True, seed=7)
            loader: Any = make_loader(sampler)
            loader.sampler.set_epoch(_EPOCH)
            iterator = iter(loader)
            consumed = [next(iterator) for _ in range(_CUT)]
            torch.save(loader.state_dict(), out / f"state{rank}.pt")
            dcp.save({"loader": snaploader.dcp_state(loader)}, checkpoint_id=str(out / "dcp"))
            dist.barrier()  # every rank has saved: the "interruption"
            rest = list(iterator)
        else:
            if old_size == 2:
                states = snaploader.distributed.dcp_states(str(out / "dcp"))
            else:
                states = [torch.load(out / f"state{r}.pt", weights_only=True) for r in range(old_size)]
            new_batch = {"allow_mismatch": ("batch_size",)} if _NEW_BATCH else {}
            loader = snaploader.distributed.reshard(
                states, make_new_loader if _NEW_BATCH else make_loader, rank=dist.get_rank(),
                world_size=dist.get_world_size(), **new_batch,
            )
            assert loader.epoch == _EPOCH, loader.epoch
            loader.set_epoch(_EPOCH)
            rest = list(loader)
        (loader if phase == "load" else loader.sampler).set_epoch(_EPOCH + 1)
        following = list(loader)
        dist.barrier()
        name = f"{phase}{size}{f'_b{_NEW_BATCH}' if _NEW_BATCH else ''}_{rank}.pt"
        torch.save({"consumed": consumed, "rest": rest, "following": following}, out / name)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
