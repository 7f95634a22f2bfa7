"""The messages between the main process and a worker, and how results are pickled.

One task pipe in and one result pipe out, per worker (``_workers/pool.py`` owns the pipes):

- main -> worker: a :class:`Resume` first in every epoch (and first of all after a
  respawn; pickled to bytes, so a tensor in a dataset's state travels by value), then
  :class:`Task` messages, then ``None`` to stop. Tasks are answered in the order they
  were sent, one :class:`Result` each.
- worker -> main: a :class:`Result` carries the batch (or the user's exception, or the
  news that an iterable dataset ran dry) and the :class:`Snapshot` taken right after
  it. Small tensors travel inside the message (NOTE [ small tensors by value ]); larger
  ones through shared memory, by file descriptor, as torch sends them. The worker stays
  alive until told to stop, so the main process can always open what it was sent.

The same records serve the ``num_workers=0`` runner (``_workers/inline_runner.py``), which passes them
by reference instead of through pipes.
"""

from __future__ import annotations

import enum
import io
import pickle
import struct
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Final

import cloudpickle
import torch

from .._format.plain import tensor_bytes, tensor_from_bytes
from .._options import Options
from .._state.records import Snapshot


class Kind(enum.Enum):
    """What a :class:`Result` carries."""

    BATCH = "batch"
    ERROR = "error"  # a user exception, as a WorkerError
    EXHAUSTED = "exhausted"  # an iterable worker's iterator ran dry before this task


@dataclass(frozen=True)
class WorkerSetup:
    """Everything a worker needs besides its id; sent once per worker process."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable[[Any], Any]
    worker_init_fn: Callable[[int], None] | None
    # The logical worker count of the epoch the workers start for: what get_worker_info()
    # reports as num_workers (0: the main-process contract). A resumed checkpoint's count
    # may differ from options.logical_workers, which is for new epochs.
    logical: int
    base_seed: int
    options: Options = Options()
    world: tuple[int, int] = (1, 0)  # (world size, rank) a DataPipe is sharded by, read in the main process


@dataclass(frozen=True, slots=True)
class Task:
    """Produce one batch. ``key`` is the global batch index (map-style) or the worker's
    own batch count (iterable); ``indices`` are the sample indices (map-style only);
    ``seed``: the epoch's per-sample seed (``seed_per_sample``; ``_rng/per_sample.py``),
    None when the option is off."""

    key: int
    indices: Any
    seed: int | None = None


@dataclass(frozen=True)
class WorkerError:
    """An exception raised by user code in a worker, ready to be raised again.

    ``start_up``: raised while the worker started or was positioned (``worker_init_fn``,
    a restore from a checkpoint), not by a batch's own fetch. It is sent with the first
    task's result but belongs to no batch, so a skip never passes over it
    (``_epoch/iterator.py``)."""

    pickled: bytes | None
    type_name: str
    formatted: str
    start_up: bool = False

    @staticmethod
    def capture(exc: BaseException, origin: str = "") -> WorkerError:
        """``origin``, when given, says where ``exc`` was raised if not in the worker."""
        formatted = "".join(traceback.format_exception(exc))
        if origin:
            formatted = f"(raised {origin})\n{formatted}"
        pickled: bytes | None
        try:
            blob: bytes = cloudpickle.dumps(exc)
            pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt
            pickled = blob
        except Exception:
            pickled = None
        return WorkerError(pickled, type(exc).__qualname__, formatted)

    def rebuild(self, where: str) -> BaseException:
        """The original exception (or a RuntimeError when it cannot be rebuilt), with a
        note naming ``where`` it happened and the worker's traceback."""
        note = f"Caught {self.type_name} {where}.\nOriginal {self.formatted}"
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception:
                exc = None
        if exc is None:
            return RuntimeError(note)
        exc.add_note(note)
        return exc


@dataclass(frozen=True, slots=True)
class Result:
    key: int
    kind: Kind
    payload: Any
    snapshot: Snapshot


# NOTE [ small tensors by value ]
# torch shares a CPU tensor between processes by passing a file descriptor: the main
# process connects to a listener in the worker and authenticates, per tensor. That
# costs far more than copying a small tensor, so tensors up to this size travel inside
# the message. A result sent that way is also complete by itself: it stays readable
# even if its worker dies right after sending it.
_BY_VALUE_MAX_BYTES: Final = 256 * 1024
_FDS: Final = struct.Struct("<I")


class _ResultPickler(ForkingPickler):
    shared = 0  # tensors sent through shared memory: each is an fd in the receiver

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            return NotImplemented
        # Only plain dense tensors: a nested tensor also reports the strided layout,
        # and quantized, conjugate or negative-bit views are not their raw bytes; all of
        # them (and subclasses) go through torch's own reductions, as in torch.
        if (
            type(obj) is torch.Tensor
            and obj.layout == torch.strided
            and not obj.is_nested
            and not obj.is_quantized
            and not obj.is_conj()
            and not obj.is_neg()
            and not obj.requires_grad
            and obj.nbytes <= _BY_VALUE_MAX_BYTES
        ):
            return tensor_from_bytes, (tensor_bytes(obj), obj.dtype, tuple(obj.shape))
        self.shared += 1
        return NotImplemented


# A result travels as two pickles back to back in one message: the header (key, kind,
# snapshot: plain data) and then the payload, followed by the count of its tensors in
# shared memory (``fds_of``: the receiver bounds the fds it holds, _workers/process_runner.py). The main process unpickles the payload
# only after the header, so a payload that fails to unpickle there (a class whose
# reconstructor raises, shared memory whose sender died) still names its batch and
# brings its snapshot: see ``UnreadablePayload``.


def dumps_result(result: Result) -> bytes:
    """Pickle a result for the result pipe (see NOTE [ small tensors by value ])."""
    buffer = io.BytesIO()
    header = (result.key, result.kind, result.snapshot)
    _ResultPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(header)
    pickler = _ResultPickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dump(result.payload)
    buffer.write(_FDS.pack(min(pickler.shared, 0xFFFFFFFF)))
    return buffer.getvalue()


def fds_of(blob: bytes) -> int:
    """How many file descriptors the result in ``blob`` holds in the main process once
    unpickled (its tensors in shared memory; views of one storage count each)."""
    return int(_FDS.unpack_from(blob, len(blob) - _FDS.size)[0])


class UnreadablePayload(Exception):
    """The payload of the result for task ``key`` could not be unpickled in the main
    process; ``error`` is why. Whether that is the user's error or a lost result
    depends on whether its sender is still alive, which only the receiver can tell."""

    def __init__(self, key: int, kind: Kind, snapshot: Snapshot, error: Exception) -> None:
        super().__init__(f"the result for task {key} could not be unpickled: {error!r}")
        self.key = key
        self.kind = kind
        self.snapshot = snapshot
        self.error = error

    def as_error(self, slot: int) -> Result:
        """The result to raise when this batch is due, once its sender is known alive:
        the payload itself cannot be rebuilt here (a reconstructor that raises), which
        is the user's error, like one raised in __getitem__; the snapshot after the
        batch came intact with it."""
        error = WorkerError.capture(self.error, origin=f"in the main process, unpickling the batch worker {slot} sent")
        return Result(self.key, Kind.ERROR, error, self.snapshot)


def loads_result(blob: bytes) -> Result:
    """Unpickle what :func:`dumps_result` made, opening shared memory as torch does.
    Raises :class:`UnreadablePayload` when only the payload fails."""
    stream = io.BytesIO(blob)
    header = pickle.load(stream)
    if not (isinstance(header, tuple) and len(header) == 3 and isinstance(header[2], Snapshot)):
        raise TypeError(f"a worker sent a {type(header).__name__} where a result header was due")
    key, kind, snapshot = header
    try:
        payload = pickle.load(stream)  # ForkingPickler's reductions are registered globally
    except Exception as exc:
        raise UnreadablePayload(key, kind, snapshot, exc) from exc
    return Result(key, kind, payload, snapshot)
