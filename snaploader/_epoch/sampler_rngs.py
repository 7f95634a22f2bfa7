"""The generator objects a loader's sampler and batch sampler hold (a length-grouped or
bucketing sampler shuffling with its own ``torch.Generator``, ``np.random.default_rng``
or ``random.Random``; torch's samplers built with a ``generator=`` that is not the
loader's): found by the same bounded walk as a dataset's (``_rng/objects.py``), in the
main process, where the sampler runs whatever ``num_workers``.

Their states are what rebuilds an epoch's index plan, as the loader's generator's
``rng_start`` is: the iterator captures them when an epoch starts, before the sampler
draws (:func:`begin`), and again when it ends, for the next epoch. A checkpoint holds
the first mid-epoch and the second between epochs (``sampler_rngs``); ``load_state_dict``
matches them to the generators :func:`find` finds (``_format/restore.py``, where a
mismatch is refused) and writes them back, so the plan draws the epoch's order again and every
later epoch goes on from where the uninterrupted run's sampler stood. The loader's own
generator is left out: ``rng_start``/``rng_next`` carry it (torch's ``RandomSampler``
made by ``shuffle=True`` holds it), and so is its dataset, a sampler's ``data_source``
(the workers capture what it holds).

Paths start at ``batch_sampler`` when the loader batches (torch's ``BatchSampler``
holds the sampler: ``batch_sampler.sampler.g``), else at ``sampler``; ``exclude_rngs``
takes them as it takes a dataset's.
"""

from __future__ import annotations

from typing import Any

import torch

from .._rng.objects import Exclude, ObjectRngs
from .._state.ledger import EpochProgress

_WHO = "the sampler"
# (the loader's dataset, its generator): what the walk leaves out, carried otherwise
Loader = tuple[Any, torch.Generator | None]


def find(index_sampler: Any, batched: bool, loader: Loader, exclude: Exclude) -> ObjectRngs:
    """The generators ``index_sampler`` holds, but the loader's generator and what its
    dataset holds (a sampler holds the dataset as its ``data_source``)."""
    root = ("batch_sampler" if batched else "sampler", index_sampler)
    return ObjectRngs.find([root], None, exclude, known=[obj for obj in loader if obj is not None])


def begin(progress: EpochProgress, index_sampler: Any, batched: bool, loader: Loader, exclude: Exclude) -> None:
    """Record on ``progress`` the generators ``index_sampler`` holds and their states
    now, at its epoch start, before the sampler draws (the states at its end are
    taken by ``EpochProgress.end``)."""
    objects = find(index_sampler, batched, loader, exclude)
    progress.sampler_objects = objects
    progress.sampler_rngs = objects.snapshot()[0] if objects.paths else None
