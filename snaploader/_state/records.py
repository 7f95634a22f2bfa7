"""What a worker's position is made of: the snapshot taken after each batch, and the
instruction that positions a worker for an epoch. Plain records, passed by reference at
``num_workers=0`` and pickled between processes otherwise (``_workers/messages.py``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .._errors import user_stacklevel

if TYPE_CHECKING:
    from collections.abc import Iterable

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


def has_state_protocol(obj: Any) -> bool:
    """True when ``obj`` has torchdata's ``state_dict()``/``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def check_own_states(dataset: Any, snapshots: Iterable[Snapshot | None]) -> None:
    """Run the dataset's optional ``check_state(state, owner)`` on each worker state a
    mid-epoch checkpoint holds for it (``snapshots``: each ledger's last and last
    complete snapshot; ``owner``: ``"dataset"`` or ``"iterator"``), in
    the main process, so that a state the dataset refuses (taken over other data, say)
    raises at ``load_state_dict()``, before anything forks, rather than in a worker."""
    check = getattr(dataset, "check_state", None)
    if not callable(check):
        return
    for snapshot in {id(s): s for s in snapshots if s is not None}.values():
        if snapshot.data_owner is not None and snapshot.complete:
            check(snapshot.data, snapshot.data_owner)


def resolve_state_protocol(option: Any, dataset: Any) -> tuple[bool, str | None]:
    """``DataLoader(state_protocol=option)`` for ``dataset``: whether its own protocol is
    used, and why not when the loader decided so itself (announced by a warning)."""
    if option is not None and not isinstance(option, bool):
        raise ValueError(f"state_protocol should be True, False or None, got {option!r}")
    lossy = lossy_state_protocol(dataset) if option is None else None
    if lossy is not None:
        warnings.warn(
            f"{lossy}. snaploader resumes it exactly by replay from the epoch start "
            "instead (as with state_protocol=False), which reads the epoch's batches "
            "before the checkpoint again; pass state_protocol=False to say so and silence "
            "this, or state_protocol=True to resume through the dataset's own state "
            "anyway (not exact)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return (lossy is None if option is None else option), lossy


# How far lossy_state_protocol() walks a dataset's chain of wrapped iterables.
_LOSSY_WALK_MAX = 64


def lossy_state_protocol(dataset: Any) -> str | None:
    """Why ``dataset``'s own state protocol is known to lose data on resume, or None.

    Known: a Hugging Face ``datasets.IterableDataset`` with ``shuffle(buffer_size=...)``
    anywhere in its chain (its state holds the source position, not the buffer: a load
    refills the buffer, and the examples that were in it are lost; with several
    workers the load can fail outright). Recognised by class and attribute names, so
    ``datasets`` is never imported here.
    """
    if not type(dataset).__module__.startswith("datasets."):
        return None
    stack = [getattr(dataset, "_ex_iterable", None)]
    for _ in range(_LOSSY_WALK_MAX):
        if not stack:
            break
        node = stack.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            size = getattr(node, "buffer_size", "?")
            return (
                f"{type(dataset).__qualname__} (Hugging Face datasets) is shuffled through a "
                f"buffer of {size} examples (shuffle(buffer_size=...)), and its state_dict() "
                "holds the source position but not the buffer: a resume through it loses the "
                "buffered examples"
            )
        stack.append(getattr(node, "ex_iterable", None))
        stack.extend(list(getattr(node, "ex_iterables", None) or ()))
    return None

