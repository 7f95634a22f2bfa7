"""The loader's state as of a batch count a little behind its own: for consumers that
read ahead of the step that uses the batches.

A training framework that fetches batch k+1 before step k runs (Lightning's fetcher
does when the loader has no length, to know which batch is the last) has made the
loader yield one batch more than the training step consumed; a checkpoint of the
loader's current state would skip that batch on resume. The ledger keeps the position
before the last yielded batch (``EpochProgress.previous``), so the state of "one batch
back" is as cheap and as exact as the current one.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ._format.codec import build_state
from ._rng.capture import RngSource
from ._state.published import Seen

if TYPE_CHECKING:
    from ._loader import DataLoader


def yielded_in_epoch(loader: DataLoader) -> int:
    """Batches ``loader`` has yielded in its current (or last) epoch."""
    progress = loader._published.progress
    if progress is None:
        pending = loader._published.loaded
        return 0 if pending is None or pending.get("ended") else int(pending.get("yielded", 0))
    return progress.position.yielded


def state_dict_as_of(loader: DataLoader, yielded: int) -> dict[str, Any]:
    """``loader.state_dict()`` as it was when ``yielded`` batches of the current epoch had
    been yielded: the current state, or the one before the last yielded batch."""
    progress = loader._published.progress
    current = yielded_in_epoch(loader)
    if yielded == current:
        return loader.state_dict()
    previous = None if progress is None else progress.previous
    if progress is None or yielded != current - 1 or previous is None or previous.yielded != yielded:
        raise RuntimeError(
            f"the loader's state is asked for as of {yielded} batches into its epoch, but it has "
            f"yielded {current} batches and keeps the state of only the last one and the one "
            "before; the consumer reads further ahead than one batch, which snaploader cannot "
            "resume exactly (see docs/lightning.md)"
        )
    behind = copy.copy(progress)
    behind.position = previous
    seen = Seen(None, behind, previous, None)
    return build_state(loader._fingerprint(), seen, RngSource(loader.generator), loader.logical_workers)


def state_dict_ending_epoch(loader: DataLoader) -> dict[str, Any]:
    """``loader.state_dict()`` as if its current epoch had ended where it stands: a
    consumer that stops an epoch after a number of batches (Lightning, which ends an
    epoch after ``num_training_batches`` without asking the loader for one more) resumes
    with the next epoch, as its uninterrupted run does, not with the rest of this one."""
    progress = loader._published.progress
    if progress is None or progress.ended:
        return loader.state_dict()
    ending = copy.copy(progress)
    ending.end()
    source = RngSource(loader.generator)
    seen = Seen(None, ending, ending.position, source.next_epoch_state())
    return build_state(loader._fingerprint(), seen, source, loader.logical_workers)

