"""What an iterator knows of its loader: the settings, built by the loader at each
``iter()``. A copy, not the loader (see ``_epoch/iterator.py``'s docstring for why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._rng.objects import RngCensus


@dataclass(frozen=True)
class LoaderSettings:
    """What an iterator needs to know of its loader, built by the loader at ``iter()``."""

    dataset: Any
    index_sampler: Any
    iterable: bool
    auto_collation: bool
    context: Any  # a multiprocessing context
    pin_memory: bool  # pin, and an accelerator is there to pin for
    pin_device: str | None
    reported_length: int | None  # len(loader) as reported for an iterable dataset
    num_workers: int
    prefetch_factor: int | None
    timeout_s: float
    persistent_workers: bool
    generator: torch.Generator | None
    batch_size: int | None
    drop_last: bool
    collate_fn: Any
    worker_init_fn: Any
    snapshot_every: int
    replay: str
    max_worker_retries: int
    check_resume: bool = True
    rng_objects: Any = None
    exclude_rngs: Any = None
    rng_census: RngCensus | None = None
    state_protocol: bool = True
    logical_workers: int = 0  # the stream's worker count for a new epoch (_workers/process_main.py)
    in_order: bool = True  # False: yield each worker's batches as they come (_epoch/dispatch.py)
    seed_per_sample: bool = False  # each sample's draws from its own states (_rng/per_sample.py)
    sample_seed: int | None = None  # the per-sample seed to use instead of the epoch's own

    @property
    def prefetch(self) -> int:
        """Tasks kept outstanding per slot."""
        return (self.prefetch_factor or 1) if self.num_workers > 0 else 1
