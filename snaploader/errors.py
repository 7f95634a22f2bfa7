"""Public exceptions. Each class has one meaning, written in its docstring."""

from __future__ import annotations


class CheckpointFormatError(ValueError):
    """A loader checkpoint is malformed: a key is missing, has the wrong type, or the
    format version is unknown. The message names the key and what was expected."""


class CheckpointMismatchError(ValueError):
    """A well-formed checkpoint was taken from a loader built differently (another
    dataset length, batch size, worker count, ...). The message shows both sides and
    the ``allow_mismatch`` name that accepts the difference knowingly."""


class WorkerCrashedError(RuntimeError):
    """A worker process died again and again on the same batch (a poison sample) and
    the retry budget ran out. The message names the worker, the signal or exit code,
    the batch, its sample indices and the likely cause."""


class ReplayRefusedError(RuntimeError):
    """Exact resume of an iterable dataset without ``state_dict()``/``load_state_dict()``
    needs a replay from the epoch start, and the loader was built with
    ``replay="refuse"``."""


class StateNotPlainDataError(TypeError):
    """A dataset's or iterator's ``state_dict()`` returned something that cannot be
    saved as plain checkpoint data (``torch.load(weights_only=True)`` would refuse it).
    The message names the key path and the offending type."""


class WorkerRespawnedWarning(RuntimeWarning):
    """A worker process died and was respawned from its snapshot; the stream goes on
    unchanged. The message names the worker, its pid, the signal, and the batch."""
