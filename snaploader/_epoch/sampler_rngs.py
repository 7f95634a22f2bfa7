"""The generator objects a loader's sampler and batch sampler hold (a length-grouped or
bucketing sampler shuffling with its own ``torch.Generator``, ``np.random.default_rng``
or ``random.Random``; torch's samplers built with a ``generator=`` that is not the
loader's): found by the same bounded walk as a dataset's (``_rng/objects.py``), in the
main process, where the sampler runs whatever ``num_workers``.

Their states are what rebuilds an epoch's index plan, as the loader's generator's
``rng_start`` is: the iterator captures them when an epoch starts, before the sampler
draws (:func:`capture`), and again when it ends, for the next epoch. A checkpoint holds
the first mid-epoch and the second between epochs (``sampler_rngs``); ``load_state_dict``
writes them back (:func:`restore`), so the plan draws the epoch's order again and every
later epoch goes on from where the uninterrupted run's sampler stood. The loader's own
generator is left out: ``rng_start``/``rng_next`` carry it (torch's ``RandomSampler``
made by ``shuffle=True`` holds it).

Paths start at ``batch_sampler`` when the loader batches (torch's ``BatchSampler``
holds the sampler: ``batch_sampler.sampler.g``), else at ``sampler``; ``exclude_rngs``
takes them as it takes a dataset's.
"""

from __future__ import annotations

from typing import Any

import torch

from .._rng.objects import Exclude, ObjectRngs

_WHO = "the sampler"


def find(index_sampler: Any, batched: bool, generator: torch.Generator | None, exclude: Exclude) -> ObjectRngs:
    """The generators ``index_sampler`` holds, but the loader's ``generator``."""
    root = ("batch_sampler" if batched else "sampler", index_sampler)
    return ObjectRngs.find([root], None, exclude, known=() if generator is None else (generator,))


def capture(objects: ObjectRngs) -> bytes | None:
    """The encoded states of ``objects`` now (None: there are none)."""
    return objects.snapshot()[0] if objects.paths else None


def restore(index_sampler: Any, batched: bool, generator: torch.Generator | None, exclude: Exclude, blob: bytes | None) -> None:
    """Write a checkpoint's ``sampler_rngs`` into the generators the sampler holds now;
    :class:`CheckpointFormatError` naming the first path that differs. None (a file
    written before they were recorded, or a sampler that held none) leaves them as
    they are."""
    if blob is not None:
        find(index_sampler, batched, generator, exclude).restore(blob, _WHO)
