"""Public exceptions and warnings (each class has one meaning, written in its
docstring), and the helpers that make their messages name the user's place."""

from __future__ import annotations

import os
import sys
from typing import Any, Final


class CheckpointFormatError(ValueError):
    """A loader checkpoint is malformed: a key is missing, has the wrong type, or the
    format version is unknown. The message names the key and what was expected."""


class CheckpointMismatchError(ValueError):
    """A well-formed checkpoint was taken from a loader built differently (another
    dataset length, batch size, worker count, ...). The message shows both sides and
    the ``allow_mismatch`` name that accepts the difference knowingly."""


class WorkerCrashedError(RuntimeError):
    """A worker process died again and again on the same batch (a poison sample), or
    again and again without producing a batch, and the retry budget ran out; or it
    could not start at all. The message names the worker, the signal or exit code,
    the batch or the phase, and the likely cause."""


class ReplayRefusedError(RuntimeError):
    """Exact resume of an iterable dataset without ``state_dict()``/``load_state_dict()``
    needs a replay from the epoch start, and the loader was built with
    ``replay="refuse"``."""


class StateNotPlainDataError(TypeError):
    """A dataset's or iterator's ``state_dict()`` returned something that cannot be
    saved as plain checkpoint data (``torch.load(weights_only=True)`` would refuse it).
    The message names the key path and the offending type."""


class ResumeMismatchWarning(UserWarning):
    """After a restore, a batch whose digest a checkpoint of an older release kept (it
    was prefetched when the checkpoint was taken) came out different (the resume
    self-check): something the checkpoint does not capture changed the stream. The
    message names the batch, the worker and the usual causes."""


class WorkerRespawnedWarning(RuntimeWarning):
    """A worker process died and was respawned from its snapshot; the stream goes on
    unchanged. The message names the worker, its pid, the signal, and the batch."""


# Shown and pickled under the public name (``snaploader.WorkerCrashedError`` in a
# traceback, not ``snaploader._errors.WorkerCrashedError``): snaploader's __init__
# re-exports every one, so an exception pickled in one process unpickles in another.
for _public in (
    CheckpointFormatError, CheckpointMismatchError, WorkerCrashedError, ReplayRefusedError,
    StateNotPlainDataError, ResumeMismatchWarning, WorkerRespawnedWarning,
):
    _public.__module__ = "snaploader"
del _public


# -- helpers for messages --------------------------------------------------------------

# Every module of the package, its subpackages included, lies under this prefix.
_PACKAGE_PREFIX: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first caller outside
    snaploader (the user's ``iter()`` or ``next()``), however deep we are."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_PREFIX):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def short_indices(indices: Any, limit: int = 16) -> str:
    """Sample indices for a message: the first ``limit`` of a long list, and the count."""
    if isinstance(indices, (list, tuple)) and len(indices) > limit:
        return f"{list(indices[:limit])}... ({len(indices)} in all)"
    return repr(indices)


def length_message(dataset: object, reported: int, yielded: int, num_workers: int) -> str:
    """torch's warning, in torch's words, when an iterable dataset yields more batches
    than the ``len(loader)`` that was asked of it."""
    message = (
        f"Length of IterableDataset {dataset} was reported to be {reported}"
        f"(when accessing len(dataloader)), but {yielded} samples have been fetched. "
    )
    if num_workers > 0:
        message += (
            "For multiprocessing data-loading, this could be caused by not properly configuring the "
            "IterableDataset replica at each worker. Please see "
            "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples."
        )
    return message
