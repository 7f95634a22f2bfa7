"""The main process's record of where every worker stands in the epoch.

The state a worker needs to produce its first not-yet-yielded batch is exactly the
snapshot that came with its last *yielded* batch (or its epoch-start state if it has
yielded none this epoch). Keeping that one snapshot per worker, updated as batches are
yielded, is what makes ``state_dict()`` free: it never talks to a worker, never waits,
and is O(num_workers) in size whatever the dataset length. Prefetched-but-unconsumed
batches are simply produced again on restore, from those snapshots, identically.

``state_dict()`` may be called from any thread (async checkpointing does): the ledgers
are immutable, and each step of the epoch publishes a new :class:`Position` with one
attribute assignment, so a reader sees the position before a batch or after it, never
half of each. Between epochs the loader publishes the same way (``_state/published.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .._rng.objects import ObjectRngs
from .epoch_record import EpochRecord
from .records import Resume, Snapshot


@dataclass(frozen=True)
class WorkerLedger:
    """Where one worker slot stands, as of the batches the loader has yielded.

    ``epoch_start``: the worker's state when the epoch began (None: freshly seeded from
    the epoch's base seed). ``yielded``: the snapshot after its last yielded batch this
    epoch (None: none yet). ``yielded_complete``: the newest snapshot at or before
    ``yielded`` that positions the worker without replay. ``exhausted``: its iterable
    ran dry this epoch and the round-robin has moved past it. ``skipped``: map-style
    batches of this worker's share that a skip (``load_state_dict(skip=...)``) passed
    over since ``yielded``; they are counted as produced, but their fetches and RNG
    draws were never made, so the worker resumes from ``yielded`` as it stands.
    """

    epoch_start: Snapshot | None = None
    yielded: Snapshot | None = None
    yielded_complete: Snapshot | None = None
    exhausted: bool = False
    skipped: int = 0
    # The checkpoint form of this (immutable) ledger, made once (_format/build.py).
    cache: list[Any] = field(default_factory=list, compare=False, repr=False)

    def record(self, snapshot: Snapshot) -> WorkerLedger:
        """The ledger after the batch (or "exhausted" reply) ``snapshot`` came with."""
        return WorkerLedger(
            epoch_start=self.epoch_start,
            yielded=snapshot,
            yielded_complete=snapshot if snapshot.complete else self.yielded_complete,
            exhausted=self.exhausted or snapshot.exhausted,
        )

    def next_epoch(self) -> WorkerLedger:
        """The ledger a persistent worker starts its next epoch with."""
        start = self.yielded if self.yielded is not None else self.epoch_start
        return WorkerLedger(epoch_start=start)


def resume_from(
    epoch_start: Snapshot | None, at: Snapshot | None, at_complete: Snapshot | None
) -> Resume:
    """The message that puts a (new or live) worker where ``at`` was taken.

    ``at_complete`` is the newest complete snapshot at or before ``at``. An iterable
    without a state protocol, or one snapshotted every N batches, is replayed from it
    (or from the epoch start) up to ``at``; unless ``at`` follows the worker's last
    batch of the epoch: then only its RNG states matter, and nothing is replayed.
    """
    if at is None:
        return Resume(epoch_start, 0, 0, None, new_epoch=True)
    if at.complete:
        return Resume(at, at.produced, 0, None, new_epoch=False, exhausted=at.exhausted)
    if at.exhausted:
        return Resume(epoch_start, at.produced, 0, at.rng, True, True, at.objects)
    if at_complete is not None:
        return Resume(
            at_complete, at_complete.produced, at.produced - at_complete.produced, at.rng, False,
            final_objects=at.objects,
        )
    return Resume(epoch_start, 0, at.produced, at.rng, new_epoch=True, final_objects=at.objects)


def resume_after(ledger: WorkerLedger, received: Iterable[Snapshot] = ()) -> Resume:
    """Where a worker must stand: after its last yielded batch or, with ``received``
    (the snapshots of batches it sent that are not yet yielded, oldest first), after
    the last of those (for a respawn, which must not produce them again)."""
    at, at_complete = ledger.yielded, ledger.yielded_complete
    for snapshot in received:
        at = snapshot
        if snapshot.complete:
            at_complete = snapshot
    msg = resume_from(ledger.epoch_start, at, at_complete)
    if ledger.skipped and at is ledger.yielded:
        # A received snapshot already counts the skipped batches; the ledger's does not.
        msg = replace(msg, base_produced=msg.base_produced + ledger.skipped)
    return msg


def skip_map_batches(
    workers: list[WorkerLedger], yielded: int, skip: int
) -> list[WorkerLedger]:
    """The ledgers after skipping map-style batches ``yielded`` to ``yielded + skip``
    (exclusive) without producing them: batch k belongs to worker k mod W, so each
    worker's share of the skipped batches is added to its ``skipped`` count and its
    snapshot stays as it was (see docs/api.md, "Skipping batches")."""
    slots = len(workers)
    out = []
    for w, ledger in enumerate(workers):
        share = len(range(w, yielded + skip, slots)) - len(range(w, yielded, slots))
        out.append(replace(ledger, skipped=ledger.skipped + share, cache=[]) if share else ledger)
    return out


def share_count(ledger: WorkerLedger) -> int:
    """The batches of its share the worker has yielded (or skipped) this epoch."""
    return (0 if ledger.yielded is None else ledger.yielded.produced) + ledger.skipped


def first_due(workers: Sequence[WorkerLedger]) -> int:
    """Map-style: the first batch of the epoch not yet yielded, batch k being worker
    k mod W's (k // W)-th. In order it is the yielded count; with ``in_order=False``
    batches after it may have been yielded too (``_epoch/dispatch.py``)."""
    slots = len(workers)
    return min((w + share_count(ledger) * slots for w, ledger in enumerate(workers)), default=0)


def replay_without_protocol(ledger: WorkerLedger) -> int:
    """Batches a restored worker must read again from the epoch start because its
    iterable has no state protocol (0 when it has one: snapshot_every's replay from a
    recent snapshot is by choice and bounded)."""
    at = ledger.yielded
    if at is None or at.data_owner is not None:
        return 0
    return resume_from(ledger.epoch_start, at, ledger.yielded_complete).replay


@dataclass(frozen=True)
class Position:
    """Where an epoch stands, published whole (see the module docstring)."""

    yielded: int
    turn: int
    workers: tuple[WorkerLedger, ...]
    ended: bool = False
    sampler_state: Any = None  # the stateful sampler's state before the next batch
    skip: int = 0  # iterable: batches still to discard before the next one is yielded


@dataclass(eq=False)
class EpochProgress:
    """Everything ``state_dict()`` needs about the current epoch: what is fixed for the
    epoch, and the published :class:`Position`."""

    epoch: int
    rng_start: bytes
    base_seed: int
    drew_base_seed: bool
    position: Position
    # shared_seed, sampler_epoch, in_order, item_offset, epoch_length, sample_root: what
    # the checkpoint keeps of the epoch beside its position (_state/epoch_record.py)
    record: EpochRecord = EpochRecord()
    plan_skip: int = 0  # batches the plan skipped when it was built (a restore)
    plan: Any = field(default=None, repr=False)  # the IndexPlan, for sampler states
    # The resume self-check (_workers/selfcheck.py): after a restore of a checkpoint that
    # kept them, the (count, digest) each slot's next batch must match.
    next_batches: list[tuple[int, str] | None] = field(default_factory=list, repr=False)
    # The newest position with one batch fewer yielded than ``position``: the state of
    # "one batch back", for a consumer that reads one batch ahead (Lightning's fetcher;
    # _view.py).
    previous: Position | None = field(default=None, repr=False)
    # The logical worker count of the epoch (NOTE [ logical workers ] in _workers/worker_loop.py): 0
    # for the main-process contract of num_workers=0; one ledger per slot, max(1, it).
    logical_workers: int = 1
    # seed_per_sample: the seed every sample of the epoch derives its states from
    # (_rng/per_sample.py), sent with each task and resume; None when the option is off.
    sample_seed: int | None = None
    # The generator objects the sampler holds (_epoch/sampler_rngs.py), and their
    # encoded states at the epoch start and, once it ended, for the next epoch.
    sampler_objects: ObjectRngs | None = field(default=None, repr=False)
    sampler_rngs: bytes | None = field(default=None, repr=False)
    sampler_rngs_next: bytes | None = field(default=None, repr=False)
    # first_due() of the position it was computed for (the position is immutable)
    _due: tuple[Position | None, int] = field(default=(None, 0), repr=False, compare=False)
    # The checkpoint's pieces that are fixed for the epoch, made once (_format/build.py).
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def slots(self) -> int:
        return len(self.position.workers)

    def set_epoch_start(self, snapshot: Snapshot) -> None:
        """Record the epoch-start state of the single slot of the main-process
        contract (``Runner.own_epoch_start``), before anything is yielded."""
        (ledger,) = self.position.workers
        self.position = replace(self.position, workers=(replace(ledger, epoch_start=snapshot, cache=[]),))

    def resume(self, slot: int, received: Iterable[Snapshot] = ()) -> Resume:
        """:func:`resume_after` for ``slot``'s ledger, with the epoch's seeds: the shared
        seed of an IterDataPipe and the per-sample seed, when the epoch has them."""
        msg = resume_after(self.position.workers[slot], received)
        if self.record.shared_seed is not None:
            msg = replace(msg, shared_seed=self.record.shared_seed)
        if self.sample_seed is not None:
            msg = replace(msg, seed=self.sample_seed)
        return msg

    @property
    def workers(self) -> tuple[WorkerLedger, ...]:
        return self.position.workers

    @property
    def yielded(self) -> int:
        return self.position.yielded

    @property
    def ended(self) -> bool:
        return self.position.ended

    def attach_plan(self, plan: Any) -> None:
        """The epoch's IndexPlan, once drawn; the position then carries its state."""
        self.plan = plan
        self.position = replace(self.position, sampler_state=self._sampler_state(self.first_due()))

    def first_due(self) -> int:
        """``first_due`` of the published position (map-style), computed once per position."""
        position = self.position
        if self._due[0] is not position:
            self._due = (position, first_due(position.workers))
        return self._due[1]

    def _sampler_state(self, due: int) -> Any:
        # Before the first batch not yet yielded: a restore draws the plan on from there
        # and sends only the batches not yielded (the yielded count, in order).
        if self.plan is None:
            return None
        return self.plan.sampler_state_before(due - self.plan_skip)

    def advance(self, slot: int, snapshot: Snapshot, *, turn: int, yielded: bool) -> None:
        """Publish the position after ``slot``'s batch (``yielded``) or its "exhausted"
        reply, with the round-robin at ``turn``."""
        position = self.position
        workers = list(position.workers)
        workers[slot] = workers[slot].record(snapshot)
        count = position.yielded + 1 if yielded else position.yielded
        if yielded:
            self.previous = position
        # While a skip is pending, the batches taken are the skipped ones (_epoch/iterator.py).
        skip = position.skip - 1 if yielded and position.skip else position.skip
        due = first_due(workers)
        self.position = Position(count, turn, tuple(workers), False, self._sampler_state(due), skip)
        self._due = (self.position, due)
        if yielded and self.plan is not None:
            self.plan.forget_before(due - self.plan_skip)

    def end(self) -> None:
        """Publish that the epoch is over."""
        # A skip never carries over into the next epoch (docs/api.md).
        if self.sampler_objects is not None and self.sampler_objects.paths:
            self.sampler_rngs_next = self.sampler_objects.snapshot()[0]
        self.position = replace(
            self.position, ended=True, sampler_state=self._sampler_state(self.first_due()), skip=0
        )


def current_epoch(progress: EpochProgress | None) -> int:
    """A loader's epoch (``DataLoader.epoch``) when its last epoch is ``progress`` and no
    checkpoint is loaded: that epoch while it runs, the next one once it ended (what the
    next ``iter()`` starts, :meth:`EpochStart.after`), 0 before the first."""
    if progress is None:
        return 0
    return progress.epoch + 1 if progress.ended else progress.epoch


@dataclass(frozen=True)
class EpochStart:
    """How the next epoch begins: fresh, or restored from a checkpoint."""

    epoch: int
    rng_start: bytes | None = None  # the epoch-start RNG state to replay (a restore)
    base_seed: int | None = None  # a restore's, or persistent workers' earlier seed
    draw_base_seed: bool = True
    yielded: int = 0
    turn: int = 0
    workers: list[WorkerLedger] | None = None
    sampler_state: Any = None
    next_batches: list[tuple[int, str] | None] | None = None  # the self-check's
    skip: int = 0  # batches to skip before the next one is yielded (load_state_dict)
    logical_workers: int | None = None  # the epoch's logical worker count (None: the loader's)
    # A restore's record of the epoch (_state/epoch_record.py): its shared seed,
    # sampler epoch, order, epoch part (another batch size or dataset length,
    # _format/resize.py) and per-sample root; a fresh epoch's has only the root (None:
    # this epoch's base seed is the root, a loader's first epoch).
    record: EpochRecord = EpochRecord()
    # A checkpoint taken at num_workers=0 between epochs: the dataset's own state at the
    # end of the last one, loaded into the dataset at this epoch's start (it carries
    # over at num_workers=0, as in torch). None: nothing to load.
    dataset_state: Any = None
    # An epoch part resumed with another dataset length: the index sampler rebuilt over
    # the old range (_format/resize.py; None: the loader's own).
    index_sampler: Any = None

    @staticmethod
    def after(progress: EpochProgress, persistent: bool, logical: int) -> EpochStart:
        """The epoch after ``progress``'s, for a loader of ``logical`` logical workers:
        persistent workers carry their RNG states and base seed over, as torch's
        persistent workers do, when the count is the same; otherwise the epoch begins
        as a new loader's would (docs/elastic.md)."""
        if not persistent or progress.logical_workers != logical:
            return EpochStart(epoch=progress.epoch + 1, record=progress.record.next_epoch())
        return EpochStart(
            epoch=progress.epoch + 1,
            base_seed=progress.base_seed,
            draw_base_seed=False,
            workers=[ledger.next_epoch() for ledger in progress.workers],
            logical_workers=logical,
            record=progress.record.next_epoch(),
        )
