"""Mixtures for test_mixture.py, and their resume in a fresh process.

``python -m tests._mixture_child JOB OUT``: JOB (``torch.load(weights_only=True)``) is
{"spec", "state", "allow", "batches", "epochs"}; the child builds the loader that
``spec`` describes, loads ``state`` (with ``allow_mismatch=allow``), takes ``batches``
batches (None: the rest of the epoch, then ``epochs`` more), and saves to OUT
{"batches", "state", "consumed"}.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils.data import Dataset

from snaploader import DataLoader, Mixture


class Ids(Dataset[int]):
    """Source ``k``'s item ``j`` is ``k * 10**6 + j``."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n = k, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> int:
        if not 0 <= j < self.n:
            raise IndexError(j)
        return self.k * 10**6 + j


def linear(drawn: int) -> dict[str, float]:
    """A schedule: weights linear in the number of samples drawn so far."""
    return {"a": 1.0 + drawn / 100, "b": 1.0, "c": max(0.0, 4.0 - drawn / 100)}


def build(spec: dict[str, Any]) -> DataLoader:
    """The loader ``spec`` describes: sources {name: [k, n]}, weights (a dict, or
    "linear"), samples_per_epoch, seed, num_workers, batch_size, rank/world_size."""
    sources = {name: Ids(k, n) for name, (k, n) in spec["sources"].items()}
    weights = linear if spec["weights"] == "linear" else spec["weights"]
    mixture = Mixture(sources, weights, samples_per_epoch=spec["samples_per_epoch"], seed=spec.get("seed"))
    sampler = None
    if "world_size" in spec:
        sampler = mixture.sampler(rank=spec["rank"], world_size=spec["world_size"])
    return DataLoader(
        mixture, batch_size=spec["batch_size"], sampler=sampler, num_workers=spec["num_workers"],
        generator=torch.Generator().manual_seed(spec.get("generator_seed", 0)),
    )


def take(loader: DataLoader, batches: int | None, epochs: int = 0) -> list[list[int]]:
    """``batches`` batches of the loader's epoch (None: the rest of it, then ``epochs`` more)."""
    out: list[list[int]] = []
    it = iter(loader)
    if batches is not None:
        for _ in range(batches):
            out.append(next(it).tolist())
        return out
    out += [b.tolist() for b in it]
    for _ in range(epochs):
        out += [b.tolist() for b in loader]
    return out


def main(job_path: str, out_path: str) -> None:
    job = torch.load(job_path, weights_only=True)
    loader = build(job["spec"])
    if job["state"] is not None:
        loader.load_state_dict(job["state"], allow_mismatch=tuple(job["allow"]))
    batches = take(loader, job["batches"], job["epochs"])
    torch.save({"batches": batches, "state": loader.state_dict(), "consumed": loader.consumed()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
