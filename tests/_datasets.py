"""Datasets, samplers and callables shared by the tests.

They live in an importable module (``tests._datasets``) because spawn and forkserver
workers, and the fresh processes of ``_resume_child``, re-import them by module path.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

import snaploader


class Range(Dataset[int]):
    """Item i is i; costs nothing, whatever its length (10**7 items included)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


class DrawingRange(Range):
    """Item i is i, after a draw from each of the three global RNGs: cheap whatever
    its length, yet every worker's RNG states move away from their seeds."""

    def __getitem__(self, i: int) -> int:
        random.random()
        np.random.random_sample()
        torch.rand(())
        return super().__getitem__(i)


class Augmented(Dataset[torch.Tensor]):
    """Item i is i followed by random "augmentations" drawn from all three global RNGs,
    gaussians included (so the cached second gaussian of ``random`` and NumPy matters)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.offset = 0.0  # set by worker_init_fn draws_in_init

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        values = [
            float(i),
            random.random(),
            random.gauss(0.0, 1.0),
            float(np.random.random_sample()),
            float(np.random.standard_normal()),
            float(torch.rand(()).item()),
            float(torch.randn(()).item()),
            self.offset,
        ]
        return torch.tensor(values, dtype=torch.float64)


class WorkerInfoProbe(Dataset[torch.Tensor]):
    """Item i reports what torch's and snaploader's get_worker_info() say where it
    is loaded: [i, torch id, snaploader id, num_workers, seed mod 2**31, same dataset]
    (-1 for each when called outside a worker)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        theirs = torch.utils.data.get_worker_info()
        ours = snaploader.get_worker_info()
        if theirs is None or ours is None:
            return torch.tensor([i, -1 if theirs is None else -2, -1 if ours is None else -2, -1, -1, -1])
        return torch.tensor(
            [i, theirs.id, ours.id, theirs.num_workers, theirs.seed % 2**31, int(ours.dataset is self)]
        )


class Sleepy(Dataset[int]):
    """Item i is i; items at or after ``sleep_from`` take ``sleep_s`` seconds."""

    def __init__(self, n: int, sleep_from: int, sleep_s: float) -> None:
        self.n = n
        self.sleep_from = sleep_from
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i >= self.sleep_from:
            time.sleep(self.sleep_s)
        return i


class PoisonError(ValueError):
    """Raised by :class:`Poisoned` for its bad items."""


class Poisoned(Dataset[int]):
    """Item i is i, except that the items in ``bad`` raise :class:`PoisonError`."""

    def __init__(self, n: int, bad: tuple[int, ...]) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise PoisonError(f"bad sample {i}")
        return i


class StatefulSampler(Sampler[int]):
    """A shuffling sampler with its own state (epoch and position), saved through
    ``state_dict()``/``load_state_dict()``; after a load it continues from there.
    ``started`` counts the items its iterators produced (to see what restore reads)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self.restored = False
        self.produced = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        if not self.restored:
            self.position = 0
        self.restored = False
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        while self.position < self.n:
            index = order[self.position]
            self.position += 1
            self.produced += 1
            yield index
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.position = state["position"]
        self.restored = True


class PlainBatchSampler:
    """A custom batch sampler with no state protocol: fixed uneven batches."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __iter__(self) -> Iterator[list[int]]:
        i, size = 0, 1
        while i < self.n:
            yield list(range(i, min(self.n, i + size)))
            i += size
            size = size % 4 + 1


def draws_in_init(worker_id: int) -> None:
    """A worker_init_fn that draws from all three RNGs and leaves a trace in the data."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    random.random()
    np.random.standard_normal()
    torch.rand(3)
    if isinstance(info.dataset, Augmented):
        info.dataset.offset = 1000.0 * (worker_id + 1) + random.random()


def sum_collate(batch: list[torch.Tensor]) -> dict[str, Any]:
    """A custom collate_fn returning a dict of a tensor, a list and an int."""
    stacked = torch.stack(batch)
    return {"sum": stacked.sum(0), "first": [float(t[0]) for t in batch], "size": len(batch)}
