"""What an iterator knows of its loader: torch's arguments as the loader resolved them
and snaploader's own options (one :class:`~snaploader._options.Options` record),
built by the loader at each ``iter()``. A copy, not the loader (see
``_epoch/iterator.py``'s docstring for why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._rng.objects import RngCensus
from .._rng.per_sample import epoch_seed
from .._options import Options


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
    options: Options  # snaploader's own options, as the loader checked them
    rng_census: RngCensus | None = None
    lossy_protocol: str | None = None  # why state_protocol was turned off for this dataset
    in_order: bool = True  # False: yield each worker's batches as they come (_epoch/dispatch.py)
    sample_seed: int | None = None  # the per-sample seed to use instead of the epoch's own

    def sample_seed_for(self, root: int, epoch: int) -> int | None:
        """seed_per_sample: the epoch's sample seed (NOTE [ per-sample root ] in
        _rng/per_sample.py); None when the option is off."""
        if not self.options.seed_per_sample:
            return None
        return epoch_seed(root, epoch) if self.sample_seed is None else self.sample_seed

    @property
    def prefetch(self) -> int:
        """Tasks kept outstanding per slot."""
        return (self.prefetch_factor or 1) if self.num_workers > 0 else 1
