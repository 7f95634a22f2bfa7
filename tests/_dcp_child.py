"""One rank of the torch.distributed.checkpoint test (run by test_dcp.py).

``python -m tests._dcp_child PHASE RANK WORLD PORT CKPT OUT``, gloo on 127.0.0.1:

- ``save``: take ``3 + 2 * RANK`` batches of epoch 0 (so the ranks stand at different
  places), ``dcp.save`` the loader through ``snaploader.dcp_state``, then record the
  rest of epoch 0 and all of epoch 1: the uninterrupted stream;
- ``load``: a new loader in this fresh process, ``dcp.load`` into it, record the rest
  of epoch 0 and epoch 1 (as a list of one such record).
- ``async_save``: as ``save``, but the checkpoint is written while training goes on
  (docs/dcp.md, "Saving while training goes on"): ``dcp.async_save`` of
  ``snaploader.dcp_state``, and ``torch.save`` of ``loader.state_dict()`` in a
  background thread to ``CKPT.thread<RANK>.pt``; both are waited for only after the
  rest of epoch 0 and all of epoch 1 were taken.
- ``async_load``: two new loaders, one from each of those, each recording the rest of
  epoch 0 and epoch 1.

Each rank reads its own DistributedSampler shard of an augmenting dataset (the
workers draw from their RNGs), so a rank resumed from another's state, or from a
fresh state, yields other batches.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data.distributed import DistributedSampler

import snaploader

from ._datasets import Augmented


def _loader(rank: int, world: int) -> snaploader.DataLoader:
    dataset = Augmented(64)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
    return snaploader.DataLoader(
        dataset, batch_size=4, sampler=sampler, num_workers=2, generator=torch.Generator().manual_seed(1)
    )


def _epochs(loader: snaploader.DataLoader, rest: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    assert isinstance(loader.sampler, DistributedSampler)
    loader.sampler.set_epoch(1)
    return [rest, list(loader)]


def main(phase: str, rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        loader = _loader(rank, world)
        thread_file = f"{ckpt}.thread{rank}.pt"
        stream: list[list[torch.Tensor]] | list[list[list[torch.Tensor]]]
        if phase in ("save", "async_save"):
            iterator = iter(loader)
            for _ in range(3 + 2 * rank):
                next(iterator)
            if phase == "save":
                dcp.save({"loader": snaploader.dcp_state(loader)}, checkpoint_id=ckpt)
                stream = _epochs(loader, list(iterator))
            else:
                future = dcp.async_save({"loader": snaploader.dcp_state(loader)}, checkpoint_id=ckpt)
                writer = threading.Thread(target=torch.save, args=(loader.state_dict(), thread_file))
                writer.start()
                stream = _epochs(loader, list(iterator))
                writer.join()
                future.result()  # type: ignore[union-attr]
        elif phase == "load":
            dcp.load({"loader": snaploader.dcp_state(loader)}, checkpoint_id=ckpt)
            stream = [_epochs(loader, list(loader))]
        else:
            dcp.load({"loader": snaploader.dcp_state(loader)}, checkpoint_id=ckpt)
            from_thread = _loader(rank, world)
            from_thread.load_state_dict(torch.load(thread_file, weights_only=True))
            stream = [_epochs(loader, list(loader)), _epochs(from_thread, list(from_thread))]
        torch.save(stream, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
