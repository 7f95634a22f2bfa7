"""One gloo rank of test_datapipe.py's distributed test.

``python -m tests._datapipe_child RANK PORT OUT``: two ranks on 127.0.0.1, each with a
generator seeded differently (only torch's broadcast of rank 0's shared seed makes their
shuffles agree). For num_workers 0 and 2 it records torch's stream for two epochs and
the generator's state after them, snaploader's the same way, and snaploader's stream
resumed from a ``state_dict()`` after one batch into a loader seeded differently again;
writes ``OUT/rank<RANK>.pt``: {workers: {"torch", "snaploader", "resumed"}}.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data.datapipes.iter import IterableWrapper

import snaploader

from ._streams import through_bytes


def _make(cls: Any, seed: int, workers: int) -> Any:
    generator = torch.Generator()
    generator.manual_seed(seed)
    pipe = IterableWrapper(range(24)).shuffle().sharding_filter()
    return cls(pipe, batch_size=2, num_workers=workers, generator=generator)


def _epochs(loader: Any) -> list[Any]:
    return [b for _ in range(2) for b in loader] + [loader.generator.get_state()]


def main(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warnings.simplefilter("ignore")  # the replay after the restore is announced
    result: dict[int, dict[str, list[Any]]] = {}
    for workers in (0, 2):
        seed = 10 + rank
        cut = _make(snaploader.DataLoader, seed, workers)
        it = iter(cut)
        first = [next(it)]
        state = through_bytes(cut.state_dict())
        del it
        resumed = _make(snaploader.DataLoader, 99, workers)
        resumed.load_state_dict(state)
        result[workers] = {
            "torch": _epochs(_make(torch.utils.data.DataLoader, seed, workers)),
            "snaploader": _epochs(_make(snaploader.DataLoader, seed, workers)),
            "resumed": first + [b for _ in range(2) for b in resumed] + [resumed.generator.get_state()],
        }
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
