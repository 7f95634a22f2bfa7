"""Pipelines for ``test_verify.py``: factories that ``snaploader verify`` imports in its
child processes as ``tests._verify_pipelines:NAME``.

The good ones resume exactly; each broken one holds something snaploader cannot see:
a generator in another module, data that changes between runs, the clock.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import snaploader
from snaploader import demo

from . import _verify_augment

DATA_FILE_ENV = "SNAPLOADER_TEST_DATA_FILE"


def demo_loader() -> snaploader.DataLoader:
    """The demo's pipeline: shuffled, 2 workers, augmentations from all three RNGs."""
    return demo.make_loader("snaploader")  # type: ignore[no-any-return]


def demo_torch_loader() -> torch.utils.data.DataLoader[torch.Tensor]:
    """The same pipeline built as a torch DataLoader; verify rebuilds it as snaploader's."""
    return demo.make_loader("torch")  # type: ignore[no-any-return]


class Jittered(Dataset[torch.Tensor]):
    """Item i: [i, a torch.rand draw] (the worker's global torch RNG: captured)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(()))])


class Shards(IterableDataset[torch.Tensor]):
    """Worker w yields items w, w+W, ... each with a draw from Python's global random."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor([float(i), random.random()])


def iterable() -> snaploader.DataLoader:
    return snaploader.DataLoader(Shards(20), batch_size=3, num_workers=2, replay="allow",
                                 generator=torch.Generator().manual_seed(4), multiprocessing_context="fork")


class OtherModuleRng(Jittered):
    """Draws from a ``random.Random`` held by another module: not captured."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), _verify_augment.JITTER.random()])


def uncaptured() -> snaploader.DataLoader:
    return snaploader.DataLoader(OtherModuleRng(16), batch_size=4, shuffle=True,
                                 generator=torch.Generator().manual_seed(5))


class FileValues(Dataset[torch.Tensor]):
    """Item i: the i-th number of a text file, read at each access."""

    def __init__(self, path: Path, n: int) -> None:
        self.path = path
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        values = self.path.read_text().split()
        return torch.tensor([float(i), float(values[i])])


def changing_data() -> snaploader.DataLoader:
    """Reads the file named by $SNAPLOADER_TEST_DATA_FILE. Runs after the reference run
    (SNAPLOADER_VERIFY_PHASE is not "reference") first rewrite it, as if new data had
    landed on disk in between."""
    path = Path(os.environ[DATA_FILE_ENV])
    n = 16
    if os.environ.get("SNAPLOADER_VERIFY_PHASE") != "reference":
        fresh = path.with_name(f"{path.name}.{os.getpid()}")
        fresh.write_text(" ".join(str(10 * v) for v in range(n)))
        os.replace(fresh, path)
    return snaploader.DataLoader(FileValues(path, n), batch_size=4, shuffle=True,
                                 generator=torch.Generator().manual_seed(7))


class ClockNoise(Jittered):
    """An augmentation seeded from the clock: differs on every run, resumed or not."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), random.Random(time.time_ns()).random()])


def time_seeded() -> snaploader.DataLoader:
    return snaploader.DataLoader(ClockNoise(16), batch_size=4, shuffle=True,
                                 generator=torch.Generator().manual_seed(9))


def not_a_loader() -> list[int]:
    return [1, 2, 3]


def augmented_map_torch() -> torch.utils.data.DataLoader[torch.Tensor]:
    """Map-style, shuffled, torch.rand drawn in 2 workers; built as torch's DataLoader."""
    return torch.utils.data.DataLoader(Jittered(48), batch_size=4, shuffle=True, num_workers=2,
                                       generator=torch.Generator().manual_seed(3),
                                       multiprocessing_context="fork")


class Stuck(Jittered):
    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(600)
        return super().__getitem__(i)


def hangs() -> snaploader.DataLoader:
    """Every item takes ten minutes: verify's --timeout-s must end the run."""
    return snaploader.DataLoader(Stuck(8), batch_size=4)


# -- resumed into another batch size and worker count (--resume-batch-size/--resume-workers)


def per_sample_seeds() -> snaploader.DataLoader:
    """torch.rand drawn in 2 workers, each sample seeded from its index: any topology."""
    return snaploader.DataLoader(Jittered(40), batch_size=4, shuffle=True, num_workers=2, seed_per_sample=True,
                                 generator=torch.Generator().manual_seed(6), multiprocessing_context="fork")


def worker_draws() -> snaploader.DataLoader:
    """The same draws without per-sample seeds: they follow the worker and batch."""
    return snaploader.DataLoader(Jittered(40), batch_size=4, shuffle=True, num_workers=2,
                                 generator=torch.Generator().manual_seed(6), multiprocessing_context="fork")


class CountingSampler(torch.utils.data.Sampler[int]):
    """Each epoch's order is drawn from the number of epochs this object has started: a
    fresh process starts over at 0, and snaploader cannot capture that count."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.started = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        order = list(range(self.n))
        random.Random(self.started).shuffle(order)
        self.started += 1
        return iter(order)


def uncaptured_sampler() -> snaploader.DataLoader:
    return snaploader.DataLoader(Jittered(16), batch_size=4, sampler=CountingSampler(16), seed_per_sample=True,
                                 generator=torch.Generator().manual_seed(8))


def custom_batches() -> snaploader.DataLoader:
    """Batches from a batch_sampler: not cut by a batch size, so not re-cut by another."""
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(16)), 4, False)
    return snaploader.DataLoader(Jittered(16), batch_sampler=sampler)


def unbatched() -> snaploader.DataLoader:
    return snaploader.DataLoader(Jittered(16), batch_size=None)


def unordered() -> snaploader.DataLoader:
    return snaploader.DataLoader(Jittered(16), batch_size=4, num_workers=2, in_order=False,
                                 multiprocessing_context="fork")
