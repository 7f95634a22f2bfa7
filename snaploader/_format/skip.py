"""Skipping batches on resume: ``load_state_dict(state, skip=N)`` or ``skip_to=k``.

A large training that diverges rolls back to a checkpoint and skips the batches that
preceded the spike. The checkpoint is integrity-checked, so the skip is an argument of
the restore, not an edit of the file; the loader's next checkpoint records it.

- The skip applies to the epoch the next ``iter()`` yields: the checkpoint's, or for a
  checkpoint taken after an epoch ended, the next one, from its batch 0.
- Map-style: the index plan skips the batches' indices and every worker keeps its
  snapshot (``_state/ledger.py``'s ``skip_map_batches``): no skipped sample is read, and none of the
  skipped batches' RNG draws is made. Iterable: each worker's iterator reads its own
  skipped batches and the loader discards them (``SnapIterator._skip_batches``), so
  the rest of the stream is the uninterrupted run's.
- Past the epoch's end: a ``ValueError`` here when the epoch's length is known (a
  map-style dataset with a sized sampler); otherwise the epoch ends where the data
  does, with a warning, and the skip does not carry over into the next epoch.

docs/api.md ("Skipping batches") is the user's account of this.
"""

from __future__ import annotations

from typing import Any

from .._state.ledger import EpochStart


def skip_count(start: EpochStart, skip: Any, skip_to: Any, batches_per_epoch: int | None) -> int:
    """How many batches to skip from ``start`` (which may hold a skip already, from a
    checkpoint taken after an earlier skip and before its ``iter()``), given the
    arguments of ``load_state_dict``; ``ValueError`` saying what to pass instead."""
    if type(skip) is not int or skip < 0:
        raise ValueError(f"skip should be an int >= 0 (a number of batches), got {skip!r}")
    if skip_to is not None and (type(skip_to) is not int or skip_to < 0):
        raise ValueError(f"skip_to should be None or an int >= 0 (a batch index of the epoch), got {skip_to!r}")
    if skip and skip_to is not None:
        raise ValueError(
            f"pass skip (batches after the checkpoint's position) or skip_to (a batch "
            f"index of the epoch), not both; got skip={skip} and skip_to={skip_to}"
        )
    at = start.yielded + start.skip
    where = f"batch {at} of epoch {start.epoch}"
    if skip_to is not None:
        if skip_to < at:
            raise ValueError(
                f"skip_to={skip_to} is before the checkpoint's position ({where}); a skip "
                f"only moves forward: pass skip_to >= {at}, or load an earlier checkpoint"
            )
        skip = skip_to - at
    if batches_per_epoch is not None and at + skip > batches_per_epoch:
        raise ValueError(
            f"skipping {skip} batch(es) from {where} goes past the epoch's end: it has "
            f"{batches_per_epoch} batches, {batches_per_epoch - at} left. Skip at most "
            f"{batches_per_epoch - at} (which ends the epoch); a skip does not carry over "
            "into the next epoch"
        )
    return int(skip)

