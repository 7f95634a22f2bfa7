"""Tar shards in the webdataset layout written for the tests, the loaders over them, and
the fresh-process resume that test_shards.py runs.

``python -m tests._shard_streams JOBS OUT`` loads JOBS (``torch.load(weights_only=True)``):
a list of {"urls", "num_workers", "state", "seed"}. Each job builds a new loader (its
generator seeded with ``seed``, unlike the original's), loads the checkpoint and
iterates the rest of its epoch and the next epoch; OUT gets [rest, next] per job.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import snaploader
from snaploader.shards import ShardStream, decode

SHARDS, PER_SHARD, BUFFER, BATCH = 6, 20, 8, 4


def member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, shards: int = SHARDS, per_shard: int = PER_SHARD) -> list[str]:
    """``shards`` tar files of ``per_shard`` samples each: sample i of shard s has key
    ``s/{s*per_shard+i:06d}``, a ``.cls`` (its global index), a ``.npy`` and a ``.json``."""
    urls = []
    for s in range(shards):
        path = folder / f"shard-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                index = s * per_shard + i
                key = f"s{s}/{index:06d}"
                array = io.BytesIO()
                np.save(array, np.arange(3, dtype=np.int64) + index)
                member(tar, f"{key}.cls", str(index).encode())
                member(tar, f"{key}.npy", array.getvalue())
                member(tar, f"{key}.json", json.dumps({"i": index}).encode())
        urls.append(str(path))
    return urls


def augment(sample: dict[str, Any]) -> torch.Tensor:
    """Decode, check the members agree, and add a random augmentation (torch's global RNG)."""
    decoded = decode(sample)
    index = decoded["cls"]
    assert decoded["json"]["i"] == index and int(decoded["npy"][0]) == index
    return torch.tensor([float(index), torch.rand(()).item()], dtype=torch.float64)


def make_loader(
    urls: list[str], num_workers: int, seed: int = 0, open: Callable[[str], Any] | None = None, **kwargs: Any
) -> snaploader.DataLoader:
    stream_args = {k: kwargs.pop(k) for k in ("rank", "world_size", "shuffle_buffer") if k in kwargs}
    stream_args.setdefault("shuffle_buffer", BUFFER)
    stream = ShardStream(urls, map=augment, open=open, **stream_args)
    return snaploader.DataLoader(stream, batch_size=BATCH, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(seed), **kwargs)


def ids(batches: list[torch.Tensor]) -> list[int]:
    return [int(x) for batch in batches for x in batch[:, 0]]


def main(jobs_path: str, out_path: str) -> None:
    results = []
    for job in torch.load(jobs_path, weights_only=True):
        loader = make_loader(job["urls"], job["num_workers"], seed=job["seed"])
        loader.load_state_dict(job["state"])
        rest = [] if job["state"]["ended"] else list(loader)
        results.append([rest, list(loader)])
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
