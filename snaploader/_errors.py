"""Public exceptions and warnings (each class has one meaning, written in its
docstring), and the helpers that make their messages name the user's place."""

from __future__ import annotations

from collections.abc import Callable
import functools
import threading
from typing import Any, TypeVar
import warnings


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

# NOTE [ warnings at the user's call ]
# A warning should point at the user's line: the call of snaploader's entry point that
# led to it (``iter(loader)``, ``next(it)``, ``load_state_dict``, the constructor),
# however deep in the package it arises. Nothing looks at the call stack to find that
# line: each entry point is wrapped in ``user_call``, which collects the warnings its
# call gives (``warn_user``, on this thread) and gives them as it returns or raises,
# with the stack level of its caller. An entry point called inside another one (a
# subclass's ``__iter__`` calling ours, a tool driving a loader) leaves them to the
# outermost. A warning given where no entry point runs on the thread (a helper called
# directly) points at the caller of the function that gave it. So a warning raised as an error (a ``"error"``
# filter) reaches the user from the entry point, after the call's own work.
_calls = threading.local()

_F = TypeVar("_F", bound=Callable[..., Any])


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the user's call of the entry point running on this thread (NOTE
    [ warnings at the user's call ])."""
    given = getattr(_calls, "given", None)
    if given is None:
        warnings.warn(message, category, stacklevel=3)
    else:
        given.append((message, category))


def user_call(method: _F) -> _F:
    """``method``, an entry point of the public API, giving the warnings its call
    collects at its caller's line (NOTE [ warnings at the user's call ])."""

    @functools.wraps(method)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if getattr(_calls, "given", None) is not None:
            return method(*args, **kwargs)  # inside another entry point: the outermost gives them
        given: list[tuple[str, type[Warning]]] = []
        _calls.given = given
        try:
            return method(*args, **kwargs)
        finally:
            _calls.given = None
            for message, category in given:
                warnings.warn(message, category, stacklevel=2)

    return entry  # type: ignore[return-value]


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
