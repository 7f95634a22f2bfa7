"""What a worker's position is made of: the snapshot taken after each batch, and the
instruction that positions a worker for an epoch. Plain records, passed by reference at
``num_workers=0`` and pickled between processes otherwise (``_workers/messages.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._rng.capture import NativeRng
    from .._rng.objects import RngReport


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a worker needs to produce its next batch, taken right after a batch.

    ``rng`` holds the three global RNG states (``_rng/capture.py``'s ``capture_rng`` bytes, or for
    ``num_workers=0`` a :class:`~snaploader._rng.capture.NativeRng` that is encoded only when
    a checkpoint is taken). ``produced`` counts the batches this worker produced in the
    current epoch. ``data`` is the dataset's or iterator's ``state_dict()``
    (``data_owner`` says which), or None. ``complete`` is True when the snapshot alone
    positions the worker; False when an iterable dataset must be replayed from an
    earlier complete snapshot (or the epoch start) up to ``produced`` batches;
    ``data_owner`` is set then too when the dataset has the state protocol
    (``snapshot_every`` > 1 skipped this one), None when it has not (a replay for want
    of it). ``exhausted`` marks the snapshot after an iterable worker's last batch of the
    epoch: the one its iterator ran dry in (a short batch), or its "exhausted" reply.
    ``objects`` holds the states of the generator objects the worker's code holds
    (``_rng/objects.py``; encoded with their paths), or None when it found none.
    ``report`` is news for the main process about those objects (what was found, what
    cannot be captured); it is not part of the state and never enters a checkpoint.
    ``sealed`` is the snapshot as a checkpoint holds it, made once by the first
    ``state_dict()`` that needs it (``_format/build.py``).
    """

    rng: bytes | NativeRng
    produced: int
    data: Any = None
    data_owner: str | None = None
    complete: bool = True
    exhausted: bool = False
    objects: bytes | None = None
    report: RngReport | None = None
    sealed: Any = field(default=None, init=False, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The checkpoint form stays in the main process: a snapshot sent back to a worker
        # (an epoch start, a respawn) would carry ~10 KB of base64 it never reads.
        return (Snapshot, tuple(getattr(self, f.name) for f in fields(self) if f.init))


@dataclass(frozen=True, slots=True)
class Resume:
    """Position the worker for an epoch: restore ``base`` (None: keep the current state,
    i.e. the fresh seed state or, for persistent workers, where the last epoch left it),
    set the epoch position to ``base_produced``, replay ``replay`` batches, and finally
    set the RNGs to ``final_rng`` (and the generator objects to ``final_objects``) when given. ``new_epoch`` says that ``base`` is the
    state at an epoch start, so an iterator-level state in it belongs to the last epoch.
    ``exhausted``: the worker has produced its last batch of the epoch (nothing is
    replayed then; it answers every task with "exhausted"). ``seed``: the epoch's
    per-sample seed (``seed_per_sample``), which a replayed batch is drawn with too."""

    base: Snapshot | None
    base_produced: int
    replay: int
    final_rng: bytes | NativeRng | None
    new_epoch: bool
    exhausted: bool = False
    final_objects: bytes | None = None
    shared_seed: int | None = None  # the epoch's seed for an IterDataPipe (_workers/datapipe.py)

    seed: int | None = None  # seed_per_sample: the epoch's per-sample seed (_rng/per_sample.py)
