"""The benchmark's datasets: the four workloads of the throughput sweep (compute-bound,
tiny, large, sleeping items) and the calibration of the compute items; the pipelines
of the state_dict() and training-loop measures (plain, and issue 24's light and heavy
items drawing from the workers' three global RNGs); the restore measure's items.

Module-level classes, so they pickle for workers under any start method.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch
from torch.utils.data import Dataset

COMPUTE_ITEM_MS: Final = 0.3  # numpy work per compute-bound item
SLEEP_ITEM_S: Final = 0.001


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    batch_size: int
    batches: int  # the epoch's length; a trial ends with the epoch or at Config.trial_s


WORKLOADS: Final = (
    WorkloadSpec("compute", f"~{COMPUTE_ITEM_MS} ms of numpy per item -> 3x32x32 float32", 32, 500),
    WorkloadSpec("tiny", "a Python int per item: the loader's own per-batch cost", 64, 10_000),
    WorkloadSpec("large", "3x224x224 uint8 per item: shared-memory transfer", 16, 2_000),
    WorkloadSpec("sleep", f"time.sleep({SLEEP_ITEM_S}) per item: I/O-like", 8, 1_000),
)


class ComputeItems(Dataset[torch.Tensor]):
    """Draws an "augmentation" from NumPy's global RNG (the state a snapshot protects),
    then ``rounds`` elementwise passes: ~COMPUTE_ITEM_MS ms once calibrated."""

    def __init__(self, length: int, rounds: int) -> None:
        self.length = length
        self.rounds = rounds

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        x = np.random.random_sample((3, 32, 32)).astype(np.float32)
        for _ in range(self.rounds):
            x = np.tanh(x * np.float32(1.5) + np.float32(0.1))
        return torch.from_numpy(x)


class TinyItems(Dataset[int]):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


class AugmentedTinyItems(TinyItems):
    """A tiny item with a random "augmentation" drawn from NumPy's global RNG in the
    worker: a restore is exact only if that RNG's state is restored too."""

    def __getitem__(self, index: int) -> int:
        return index * 1000 + int(np.random.randint(1000))


class NoiseItems(Dataset[torch.Tensor]):
    """Issue 24's pipelines: each sample draws ``shape``'s worth of floats from each of
    the worker's three global RNGs (torch, NumPy, Python) and returns torch's draw, a
    noise "image". Python's draw is one ``random.getrandbits(64 * floats)``, which
    moves its Mersenne Twister exactly as far as ``floats`` calls of
    ``random.random()`` (two 32-bit words each) in half a Python loop's time: what a
    checkpoint holds depends on how far each generator moved, not on how the draws
    were spelled."""

    def __init__(self, length: int, shape: tuple[int, ...]) -> None:
        self.length = length
        self.shape = shape
        self.floats = math.prod(shape)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        np.random.random_sample(self.floats)
        random.getrandbits(64 * self.floats)
        return torch.rand(self.shape)


class LargeItems(Dataset[torch.Tensor]):
    def __init__(self, length: int) -> None:
        self.length = length
        gen = torch.Generator().manual_seed(0)
        self.image = torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=gen)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.image


class SleepItems(Dataset[int]):
    def __init__(self, length: int, sleep_s: float = SLEEP_ITEM_S) -> None:
        self.length = length
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        time.sleep(self.sleep_s)
        return index


def calibrate_compute_rounds(target_ms: float = COMPUTE_ITEM_MS) -> tuple[int, float]:
    """Rounds of ComputeItems' loop that take ``target_ms`` per item here, and the
    per-item time measured with them (best of several tries: the least disturbed)."""

    def per_item_ms(rounds: int, items: int = 100) -> float:
        ds = ComputeItems(items, rounds)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(items):
                ds[i]
            best = min(best, (time.perf_counter() - t0) / items * 1e3)
        return best

    base = per_item_ms(0)
    rounds = 40
    for _ in range(3):  # secant steps from a guess: robust to one disturbed timing
        measured = per_item_ms(rounds)
        per_round = max((measured - base) / rounds, 1e-6)
        rounds = max(1, round((target_ms - base) / per_round))
    return rounds, per_item_ms(rounds)


@dataclass(frozen=True)
class Pipeline:
    """A dataset of the state_dict() and training-loop measures, and whether its
    loader keeps its workers between epochs (the worker RNGs then move on from their
    seeds through every epoch, as in a long training run)."""

    name: str
    description: str
    sample_shape: tuple[int, ...] | None  # floats drawn per sample from each RNG; None: none
    persistent: bool

    def make(self, length: int) -> Dataset[Any]:
        if self.sample_shape is None:
            return TinyItems(length)
        return NoiseItems(length, self.sample_shape)


PIPELINES: Final = {
    p.name: p
    for p in (
        Pipeline("plain", "no RNG draws", None, False),
        Pipeline("light", "1,000 floats from each of 3 RNGs per sample, persistent", (1000,), True),
        Pipeline("heavy", "3x224x224 floats from each of 3 RNGs per sample, persistent", (3, 224, 224), True),
    )
}


def pipeline(name: str) -> Pipeline:
    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}: one of {', '.join(PIPELINES)}")
    return PIPELINES[name]


def make_dataset(name: str, length: int, compute_rounds: int) -> Dataset[Any]:
    if name == "compute":
        return ComputeItems(length, compute_rounds)
    if name == "tiny":
        return TinyItems(length)
    if name == "large":
        return LargeItems(length)
    if name == "sleep":
        return SleepItems(length)
    raise ValueError(f"unknown workload {name!r}")


def spec(name: str) -> WorkloadSpec:
    return next(w for w in WORKLOADS if w.name == name)

