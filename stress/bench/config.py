"""What one benchmark run measures and how long: ``Config``, with the ``full()`` and
``quick()`` presets (tests build tiny ones), and the cases of the state_dict() and
training-loop measures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from .workloads import WORKLOADS

TABLE_WORKERS: Final = 2  # the num_workers the summary table and targets use
CHECKPOINT_WORKERS: Final = 8  # issue 24's state_dict() targets and training loop
STATE_DICT_BATCH: Final = 16  # batch size of the state_dict() and training-loop loaders
EPOCH_ITEMS: Final = 32 * STATE_DICT_BATCH  # light and heavy: 32 batches an epoch
# Every loader whose state_dict() is timed gets a generator seed of its own, counted
# from these (plus Config.seed), so that no measure reads states another one left
# behind. Until 2026-12-02 that mattered most: state_dict() searched twist counts and
# remembered, per process, how far it had searched each (base seed, worker) path, so a
# later loader of the same seed measured the previous one's leftovers (100 ms a call).
STATE_DICT_SEEDS_FROM: Final = 1_000
LOOP_SEEDS_FROM: Final = 2_000


@dataclass(frozen=True)
class StateDictCase:
    """A loader whose ``state_dict()`` is timed after each of ``steps`` batches (its
    epochs follow one another until then)."""

    workers: int
    dataset_len: int
    pipeline: str  # a name in workloads.PIPELINES
    steps: int


@dataclass(frozen=True)
class LoopCase:
    """A training loop of ``steps`` steps over ``pipeline``, timed with and without a
    ``state_dict()`` call after every step."""

    pipeline: str  # a name in workloads.PIPELINES
    steps: int


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
    state_dict_cases: tuple[StateDictCase, ...]
    loop_cases: tuple[LoopCase, ...]
    loop_repeats: int
    restore_items: int
    restore_batch_size: int
    restore_late_fraction: float
    restore_repeats: int
    # restores also timed at these fractions of the epoch, between early and late
    restore_fractions: tuple[float, ...] = (0.1, 0.5)
    # after each batch's first ("cold") state_dict() call, this many more ("warm")
    state_dict_warm_calls: int = 2
    table_workers: int = TABLE_WORKERS
    checkpoint_workers: int = CHECKPOINT_WORKERS
    contenders: tuple[str, ...] = ("torch", "snaploader", "torchdata")
    # seed_per_sample=True's cost (issue 26): loaders at these num_workers, interleaved
    # and repeated, over an epoch of this many batches; states alone timed in chunks of
    # this many batches' calls
    seed_workers: tuple[int, ...] = (0, 2)
    seed_repeats: int = 5
    seed_batches: int = 2_000
    seed_states_calls: int = 100
    # a tar-shard stream resumed at shards_fraction of its epoch (issue 35): shards of
    # samples, a shuffle buffer, batches, workers, a simulated read per sample in ms
    shards: tuple[int, int, int, int, int] = (8, 50, 100, 10, 2)
    shards_read_ms: float = 5.0
    shards_fraction: float = 0.9
    shards_repeats: int = 5
    # pin_memory=True beside the training step (issue 34, stress/bench/pinning.py):
    # repeats of torch's and snaploader's trial, and the steps each times
    pin_repeats: int = 5
    pin_batches: int = 200
    seed: int = 0

    @staticmethod
    def full() -> Config:
        at = CHECKPOINT_WORKERS
        return Config(
            mode="full",
            workers=(0, 1, 2, 4),
            repeats=5,
            trial_s=2.0,
            workloads={w.name: w.batches for w in WORKLOADS},
            snapshot_calls=5000,
            state_dict_cases=(
                StateDictCase(2, 10_000, "plain", 200),
                StateDictCase(at, 10_000, "plain", 200),
                StateDictCase(2, 10**7, "plain", 200),
                StateDictCase(at, 10**7, "plain", 200),
                StateDictCase(at, EPOCH_ITEMS, "light", 320),
                StateDictCase(at, EPOCH_ITEMS, "heavy", 160),
            ),
            loop_cases=(LoopCase("light", 300), LoopCase("heavy", 60)),
            loop_repeats=3,
            restore_items=10**6,
            restore_batch_size=64,
            restore_late_fraction=0.9,
            restore_repeats=5,
        )

    @staticmethod
    def quick() -> Config:
        at = CHECKPOINT_WORKERS
        return Config(
            mode="quick",
            workers=(0, 2),
            repeats=3,
            trial_s=0.5,
            workloads={w.name: w.batches for w in WORKLOADS},
            snapshot_calls=1000,
            state_dict_cases=(
                StateDictCase(2, 10_000, "plain", 32),
                StateDictCase(at, 10_000, "plain", 32),
                StateDictCase(at, 10**6, "plain", 32),
                StateDictCase(at, EPOCH_ITEMS, "light", 64),
                StateDictCase(at, EPOCH_ITEMS, "heavy", 32),
            ),
            state_dict_warm_calls=1,
            loop_cases=(LoopCase("light", 200),),
            loop_repeats=1,
            restore_items=2 * 10**5,
            restore_batch_size=256,
            restore_late_fraction=0.9,
            restore_repeats=2,
            seed_repeats=3,
            seed_batches=1_000,
            seed_states_calls=50,
            shards_repeats=3,
            pin_repeats=3,
            pin_batches=60,
        )
