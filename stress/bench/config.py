"""What one benchmark run measures and how long: ``Config``, with the ``full()`` and
``quick()`` presets (tests build tiny ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .workloads import WORKLOADS

TABLE_WORKERS: Final = 2  # the num_workers the summary table and targets use


@dataclass
class Config:
    """Sizes of one run. ``full()`` and ``quick()`` are the two presets; tests build
    tiny ones."""

    mode: str
    workers: tuple[int, ...]  # the num_workers sweep
    repeats: int
    trial_s: float  # a trial stops after this long (or at the end of its epoch)
    workloads: dict[str, int]  # workload -> epoch length in batches
    snapshot_calls: int
    # (num_workers, dataset length, pipeline): "plain" items draw nothing; "rng" items
    # draw from the three global RNGs, with persistent workers, read in epoch 2
    state_dict_cases: tuple[tuple[int, int, str], ...]
    state_dict_calls: int
    restore_items: int
    restore_batch_size: int
    restore_late_fraction: float
    restore_repeats: int
    # restores also timed at these fractions of the epoch, between early and late
    restore_fractions: tuple[float, ...] = (0.1, 0.5)
    # state_dict() calls are made in this many rounds spread over this many seconds
    state_dict_rounds: int = 20
    state_dict_span_s: float = 2.0
    table_workers: int = TABLE_WORKERS
    contenders: tuple[str, ...] = ("torch", "snaploader", "torchdata")
    seed: int = 0

    @staticmethod
    def full() -> Config:
        return Config(
            mode="full",
            workers=(0, 1, 2, 4),
            repeats=5,
            trial_s=2.0,
            workloads={w.name: w.batches for w in WORKLOADS},
            snapshot_calls=5000,
            state_dict_cases=(
                (2, 10_000, "plain"), (8, 10_000, "plain"), (2, 10**7, "plain"), (8, 10**7, "plain"),
                (8, 10_000, "rng"),
            ),
            state_dict_calls=2000,
            restore_items=10**6,
            restore_batch_size=64,
            restore_late_fraction=0.9,
            restore_repeats=5,
        )

    @staticmethod
    def quick() -> Config:
        return Config(
            mode="quick",
            workers=(0, 2),
            repeats=3,
            trial_s=0.5,
            workloads={w.name: w.batches for w in WORKLOADS},
            snapshot_calls=1000,
            state_dict_cases=((2, 10_000, "plain"), (8, 10_000, "plain"), (8, 10**6, "plain"), (8, 4_000, "rng")),
            state_dict_calls=300,
            restore_items=2 * 10**5,
            restore_batch_size=256,
            restore_late_fraction=0.9,
            restore_repeats=2,
        )

