"""The main process's record of where every worker stands in the epoch.

The state a worker needs to produce its first not-yet-yielded batch is exactly the
snapshot that came with its last *yielded* batch (or its epoch-start state if it has
yielded none this epoch). Keeping that one snapshot per worker, updated as batches are
yielded, is what makes ``state_dict()`` free: it never talks to a worker, never waits,
and is O(num_workers) in size whatever the dataset length. Prefetched-but-unconsumed
batches are simply produced again on restore, from those snapshots, identically.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from .snapshot import Snapshot
from .worker import Resume

_SAME_AS_YIELDED: Final = "same as yielded"


@dataclass
class WorkerLedger:
    """Where one worker slot stands, as of the batches the loader has yielded.

    ``epoch_start``: the worker's state when the epoch began (None: freshly seeded from
    the epoch's base seed). ``yielded``: the snapshot after its last yielded batch this
    epoch (None: none yet). ``yielded_complete``: the newest snapshot at or before
    ``yielded`` that positions the worker without replay. ``exhausted``: its iterable
    ran dry this epoch and the round-robin has moved past it.
    """

    epoch_start: Snapshot | None = None
    yielded: Snapshot | None = None
    yielded_complete: Snapshot | None = None
    exhausted: bool = False

    def record(self, snapshot: Snapshot) -> None:
        self.yielded = snapshot
        if snapshot.complete:
            self.yielded_complete = snapshot
        if snapshot.exhausted:
            self.exhausted = True

    def next_epoch(self) -> WorkerLedger:
        """The ledger a persistent worker starts its next epoch with."""
        start = self.yielded if self.yielded is not None else self.epoch_start
        return WorkerLedger(epoch_start=start)

    def to_plain(self) -> dict[str, Any]:
        def plain(snapshot: Snapshot | None) -> dict[str, Any] | None:
            return None if snapshot is None else snapshot.to_plain()

        # Usually the newest complete snapshot is the newest one; say so, not twice.
        same = self.yielded_complete is not None and self.yielded_complete is self.yielded
        return {
            "epoch_start": plain(self.epoch_start),
            "yielded": plain(self.yielded),
            "yielded_complete": _SAME_AS_YIELDED if same else plain(self.yielded_complete),
            "exhausted": self.exhausted,
        }

    @staticmethod
    def from_plain(plain: dict[str, Any]) -> WorkerLedger:
        def snap(value: dict[str, Any] | None) -> Snapshot | None:
            return None if value is None else Snapshot.from_plain(value)

        yielded = snap(plain["yielded"])
        complete = plain["yielded_complete"]
        return WorkerLedger(
            epoch_start=snap(plain["epoch_start"]),
            yielded=yielded,
            yielded_complete=yielded if complete == _SAME_AS_YIELDED else snap(complete),
            exhausted=bool(plain["exhausted"]),
        )


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
        return Resume(epoch_start, at.produced, 0, at.rng, new_epoch=True, exhausted=True)
    if at_complete is not None:
        return Resume(
            at_complete, at_complete.produced, at.produced - at_complete.produced, at.rng, False
        )
    return Resume(epoch_start, 0, at.produced, at.rng, new_epoch=True)


def replay_without_protocol(ledger: WorkerLedger) -> int:
    """Batches a restored worker must read again from the epoch start because its
    iterable has no state protocol (0 when it has one: snapshot_every's replay from a
    recent snapshot is by choice and bounded)."""
    at = ledger.yielded
    if at is None or at.data_owner is not None:
        return 0
    return resume_from(ledger.epoch_start, at, ledger.yielded_complete).replay


@dataclass
class EpochProgress:
    """Everything ``state_dict()`` needs about the current epoch; plain fields only."""

    epoch: int
    rng_kind: str
    rng_start: bytes
    base_seed: int
    drew_base_seed: bool
    workers: list[WorkerLedger]
    yielded: int = 0
    turn: int = 0
    ended: bool = False
    sampler_epoch: int | None = None
    plan_skip: int = 0  # batches the plan skipped when it was built (a restore)
    plan: Any = field(default=None, repr=False)  # the IndexPlan, for sampler states

    def sampler_state(self) -> Any:
        if self.plan is None:
            return None
        return self.plan.sampler_state_before(self.yielded - self.plan_skip)
