"""Datasets that hold their own generators (``_rng/objects.py``), shared by the tests and
``stress/rng_objects_cost.py``. Importable by module path, for spawn workers and fresh
processes."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class OwnGenerators(Dataset[torch.Tensor]):
    """Item i is i and one draw from each of its own generators: a NumPy Generator, a
    random.Random and a torch.Generator, all seeded 0 at construction."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(0)
        self.py = random.Random(0)
        self.g = torch.Generator().manual_seed(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([
            float(i), float(self.rng.random()), self.py.gauss(0.0, 1.0),
            float(torch.rand((), generator=self.g)),
        ], dtype=torch.float64)


def reseed_own(worker_id: int) -> None:
    """The usual fix: seed the dataset's generators from the worker's seed."""
    info = get_worker_info()
    assert info is not None
    dataset = info.dataset
    dataset.rng = np.random.default_rng(info.seed)
    dataset.py.seed(info.seed)
    dataset.g.manual_seed(info.seed)


def noisy(seed: int) -> Callable[[int], torch.Tensor]:
    """A transform that is a closure over its generator."""
    rng = np.random.default_rng(seed)

    def transform(i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(rng.normal())], dtype=torch.float64)

    return transform


class ClosureTransform(Dataset[torch.Tensor]):
    def __init__(self, n: int, transform: Callable[[int], torch.Tensor]) -> None:
        self.n = n
        self.transform = transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(i)


class OwnStream(IterableDataset[torch.Tensor]):
    """An iterable split between workers, drawing from a generator the dataset holds and
    from one its iterator makes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.py = random.Random(5)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        local = np.random.default_rng(start + 100)
        for i in range(start, self.n, step):
            yield torch.tensor([float(i), self.py.random(), float(local.random())], dtype=torch.float64)


class ManyGenerators(Dataset[int]):
    """Holds ``count`` generators (a mix of kinds) and ``names`` file names; item i
    draws from generator i mod count."""

    def __init__(self, n: int, count: int, names: int = 0) -> None:
        self.n = n
        makers: list[Callable[[int], Any]] = [
            random.Random, np.random.default_rng, lambda s: torch.Generator().manual_seed(s),
        ]
        self.generators = [makers[k % 3](k) for k in range(count)]
        self.files = [f"/data/images/{k:08d}.jpg" for k in range(names)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.generators:
            g = self.generators[i % len(self.generators)]
            if isinstance(g, torch.Generator):
                torch.rand((), generator=g)
            else:
                g.random()
        return i


def albumentations_dataset(n: int, seed: int | None) -> Dataset[torch.Tensor]:
    import albumentations as A

    compose = A.Compose(
        [
            A.RandomCrop(12, 12),
            A.HorizontalFlip(p=0.5),
            A.ColorJitter(p=0.8),
            A.GaussNoise(p=0.5),
        ],
        seed=seed,
    )
    return Albumented(n, compose)


class Albumented(Dataset[torch.Tensor]):
    def __init__(self, n: int, transform: Any) -> None:
        self.n = n
        self.transform = transform
        self.images = np.random.default_rng(3).integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.transform(image=self.images[i])["image"].copy())


class TorchShuffled(Sampler[int]):
    """Shuffles with a torch.Generator of its own, as bucketing samplers do."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.g = torch.Generator().manual_seed(5)

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n, generator=self.g).tolist())

    def __len__(self) -> int:
        return self.n
