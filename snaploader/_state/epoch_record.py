"""What a checkpoint records of its epoch beside the position, in one frozen record:
:class:`EpochRecord`. The parsed checkpoint holds it (``Checkpoint.record``), a restored
epoch starts from it (``EpochStart.record``), the live epoch carries it
(``EpochProgress.record``) and ``state_dict()`` writes it back, each whole, never field
by field. The checkpoint's field table is derived from it: each field's
:class:`Column` says what plain types it takes, its range, whether an older file may
lack it (its default is then what that absence means) and whether it is written only
when it is not its default (``_format/checkpoint.py``'s ``TOP_FIELDS`` and
``ADDED_TOP``; ``_format/parse.py`` and ``_format/build.py`` go over the columns).

Adding a field the checkpoint keeps for an epoch: a field here, with its column and
its default; then the code that sets it (the epoch start, ``_epoch/iterator.py``, where
an epoch's own value is drawn; or a restore, ``_format/resize.py``) and the code that
reads it. A check that ties it to another field goes in ``_format/parse.py`` beside the
others. Files without the field keep loading, so the format version does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Final

_NONE: Final = type(None)


@dataclass(frozen=True)
class Column:
    """How one field of the record is kept in a checkpoint (plain data)."""

    kinds: tuple[type, ...]  # the plain types it takes
    low: int | None = None  # a count or index: its lower bound (and below 2**62)
    seed: bool = False  # a torch seed: in [-2**63, 2**63)
    sparse: bool = False  # written only when not its default (absent: the default)
    required: bool = False  # every file of this version has it (absent: refused)


def _column(default: Any, column: Column) -> Any:
    return field(default=default, metadata={"column": column})


@dataclass(frozen=True)
class EpochRecord:
    """The facts of an epoch a checkpoint keeps beside its position; every one has the
    value a loader's fresh epoch starts from as its default."""

    # An IterDataPipe's seed for the epoch, drawn from the epoch's generator state before
    # the base seed (rank 0's under torch.distributed; _workers/datapipe.py); None for
    # another dataset.
    shared_seed: int | None = _column(None, Column((int, _NONE), seed=True))
    # The sampler's ``epoch`` (DistributedSampler's set_epoch), or None.
    sampler_epoch: int | None = _column(None, Column((int, _NONE), low=0, required=True))
    # False when the epoch's batches may have been yielded out of the fixed order
    # (in_order=False, or a restore of such a checkpoint): the ledgers' counts are then
    # the position, and ``yielded`` only their sum (_epoch/dispatch.py).
    in_order: bool = _column(True, Column((bool,)))
    # An epoch part resumed with another batch size or world size (_format/resize.py):
    # the sampler items consumed before its batch 0.
    item_offset: int = _column(0, Column((int,), low=0, sparse=True))
    # An epoch part resumed with another dataset length (_format/resize.py): the length
    # it runs over (None: the fingerprint's).
    epoch_length: int | None = _column(None, Column((int, _NONE), low=0, sparse=True))
    # seed_per_sample: the run's per-sample root, the base seed of the loader's first
    # epoch, carried from epoch to epoch and through checkpoints
    # (NOTE [ per-sample root ] in _rng/per_sample.py); None: the option is off, or the
    # epoch's base seed is the root (a first epoch's start, an older file).
    sample_root: int | None = _column(None, Column((int, _NONE), sparse=True))

    def next_epoch(self) -> EpochRecord:
        """The record the epoch after this one starts from: the per-sample root carries
        over; the rest is the next epoch's own (drawn, or its defaults)."""
        return EpochRecord(sample_root=self.sample_root)


COLUMNS: Final[tuple[tuple[str, Any, Column], ...]] = tuple(
    (f.name, f.default, f.metadata["column"]) for f in fields(EpochRecord)
)

