"""The main process's ledger (``_state/ledger.py``) on its own: which ``Resume`` puts a
worker back, what a skip and a yielded batch do to the position, how an epoch follows
another. Pure bookkeeping, so no worker process is started here; the end-to-end tests
(test_resume.py, test_iterable.py, test_skip.py) check the same rules through workers."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from snaploader._format.build import _sealed
from snaploader._state.ledger import (
    EpochProgress,
    EpochStart,
    Position,
    WorkerLedger,
    first_due,
    replay_without_protocol,
    resume_after,
    resume_from,
    share_count,
    skip_map_batches,
)
from snaploader._state.records import Resume, Snapshot

START = Snapshot(b"start", 0)


def snap(produced: int, *, complete: bool = True, owner: str | None = None, exhausted: bool = False) -> Snapshot:
    return Snapshot(f"rng{produced}".encode(), produced, None, owner, complete, exhausted, f"obj{produced}".encode())


# -- resume_from: the message that puts a worker where a snapshot was taken --------------


def test_a_worker_that_yielded_nothing_starts_the_epoch_afresh() -> None:
    assert resume_from(START, None, None) == Resume(START, 0, 0, None, new_epoch=True)


def test_a_complete_snapshot_positions_the_worker_alone() -> None:
    at = snap(5)
    assert resume_from(START, at, at) == Resume(at, 5, 0, None, new_epoch=False)


def test_an_incomplete_snapshot_replays_from_the_last_complete_one() -> None:
    # snapshot_every=3: the state at batch 3 is complete, the one at 5 is not.
    complete, at = snap(3, owner="iterator"), snap(5, complete=False, owner="iterator")
    msg = resume_from(START, at, complete)
    assert (msg.base, msg.base_produced, msg.replay) == (complete, 3, 2)
    assert (msg.final_rng, msg.final_objects, msg.new_epoch) == (at.rng, at.objects, False)


def test_without_a_complete_snapshot_the_whole_share_is_replayed_from_the_epoch_start() -> None:
    at = snap(4, complete=False)
    msg = resume_from(START, at, None)
    assert (msg.base, msg.base_produced, msg.replay, msg.new_epoch) == (START, 0, 4, True)
    assert (msg.final_rng, msg.final_objects) == (at.rng, at.objects)


def test_after_its_last_batch_a_worker_replays_nothing() -> None:
    at = snap(4, complete=False, exhausted=True)
    msg = resume_from(START, at, None)
    assert (msg.replay, msg.exhausted, msg.base_produced, msg.final_rng) == (0, True, 4, at.rng)


# -- resume_after: after the yielded batches, or after the received ones (a respawn) --------


def test_a_respawn_resumes_after_the_last_received_batch() -> None:
    ledger = WorkerLedger(START).record(snap(2))
    received = [snap(3, complete=False), snap(4), snap(5, complete=False)]
    msg = resume_after(ledger, received)
    # From batch 4 (the newest complete), replaying 5: never producing 3 to 5 twice.
    assert (msg.base, msg.base_produced, msg.replay, msg.final_rng) == (received[1], 4, 1, received[2].rng)


def test_skipped_batches_count_as_produced_from_the_yielded_snapshot_only() -> None:
    ledger = WorkerLedger(START).record(snap(2))
    skipped = skip_map_batches([ledger, WorkerLedger(START)], yielded=4, skip=4)[0]
    assert skipped.skipped == 2  # batches 4 and 6 of two workers' stream
    assert resume_after(skipped).base_produced == 4
    # A received snapshot already counts the skipped batches.
    assert resume_after(skipped, [snap(5)]).base_produced == 5


# -- map-style positions --------------------------------------------------------------


@given(st.integers(1, 6), st.integers(0, 40), st.integers(0, 40))
def test_a_skip_gives_each_worker_its_share_of_the_skipped_batches(workers: int, yielded: int, skip: int) -> None:
    # A ledger per worker as after `yielded` batches in order (batch k is worker k mod W's).
    ledgers = [
        WorkerLedger(START) if n == 0 else WorkerLedger(START).record(snap(n))
        for n in (len(range(w, yielded, workers)) for w in range(workers))
    ]
    assert first_due(ledgers) == yielded
    after = skip_map_batches(ledgers, yielded, skip)
    assert first_due(after) == yielded + skip
    assert sum(share_count(ledger) for ledger in after) == yielded + skip
    # The snapshots stay: no skipped batch was fetched, none of its RNG draws made.
    assert [ledger.yielded for ledger in after] == [ledger.yielded for ledger in ledgers]


def test_first_due_out_of_order_is_the_first_batch_not_yielded() -> None:
    # in_order=False: worker 1 is two batches ahead of worker 0 (batches 1, 3, 5 yielded).
    ledgers = [WorkerLedger(START), WorkerLedger(START).record(snap(3))]
    assert first_due(ledgers) == 0
    assert first_due([WorkerLedger(START).record(snap(1)), ledgers[1]]) == 2


def test_replay_without_protocol_counts_only_what_the_protocol_would_have_saved() -> None:
    without = WorkerLedger(START).record(snap(6, complete=False))
    by_choice = WorkerLedger(START).record(snap(6, complete=False, owner="dataset"))
    assert replay_without_protocol(without) == 6
    assert replay_without_protocol(by_choice) == 0  # snapshot_every's bounded replay
    assert replay_without_protocol(WorkerLedger(START)) == 0


# -- the published position -------------------------------------------------------------


def _progress(workers: int, logical: int | None = None) -> EpochProgress:
    position = Position(yielded=0, turn=0, workers=tuple(WorkerLedger(START) for _ in range(workers)))
    return EpochProgress(epoch=2, rng_start=b"g", base_seed=7, drew_base_seed=True, position=position,
                         logical_workers=logical or workers)


def test_advance_publishes_a_new_position_and_keeps_the_one_before() -> None:
    progress = _progress(2)
    first = progress.position
    progress.advance(0, snap(1), turn=1, yielded=True)
    assert progress.position is not first and first.yielded == 0  # published, never mutated
    assert (progress.yielded, progress.position.turn, progress.previous) == (1, 1, first)
    assert progress.workers[0].yielded == snap(1) and progress.workers[1].yielded is None
    # An "exhausted" reply moves the worker, not the yielded count.
    progress.advance(1, snap(0, exhausted=True), turn=0, yielded=False)
    assert progress.yielded == 1 and progress.workers[1].exhausted and progress.previous == first


def test_a_pending_skip_is_used_up_by_yielded_batches_and_never_outlives_the_epoch() -> None:
    progress = _progress(1)
    progress.position = Position(0, 0, progress.workers, skip=2)
    progress.advance(0, snap(1), turn=0, yielded=True)
    assert progress.position.skip == 1
    progress.end()
    assert progress.ended and progress.position.skip == 0


def test_persistent_workers_carry_their_state_into_the_next_epoch() -> None:
    progress = _progress(2)
    progress.advance(0, snap(3), turn=1, yielded=True)
    start = EpochStart.after(progress, persistent=True, logical=2)
    assert (start.epoch, start.base_seed, start.draw_base_seed, start.logical_workers) == (3, 7, False, 2)
    assert start.workers is not None
    assert [ledger.epoch_start for ledger in start.workers] == [snap(3), START]
    assert all(ledger.yielded is None for ledger in start.workers)


def test_a_new_logical_worker_count_or_no_persistence_starts_the_next_epoch_afresh() -> None:
    progress = _progress(2)
    assert EpochStart.after(progress, persistent=False, logical=2) == EpochStart(epoch=3)
    assert EpochStart.after(progress, persistent=True, logical=3) == EpochStart(epoch=3)


def test_a_ledger_remembers_its_newest_complete_snapshot_and_stays_exhausted() -> None:
    ledger = WorkerLedger(START).record(snap(1)).record(snap(2, complete=False))
    assert ledger.yielded_complete == snap(1)
    ended = ledger.record(snap(3, complete=False, exhausted=True)).record(snap(3, complete=False))
    assert ended.exhausted
    assert ended.next_epoch() == WorkerLedger(epoch_start=snap(3, complete=False))


def test_a_snapshot_sent_to_a_worker_leaves_its_checkpoint_form_behind() -> None:
    # state_dict() keeps each snapshot's checkpoint form on it (_format/build.py); a
    # snapshot pickled for a worker (an epoch start, a respawn) must not carry it.
    snapshot = Snapshot(rng=bytes(range(256)) * 40, produced=3, data={"k": [1, 2]}, data_owner="dataset")
    before = pickle.dumps(snapshot)
    _sealed(snapshot, "test")
    assert snapshot.sealed is not None
    after = pickle.loads(pickle.dumps(snapshot))
    assert after == snapshot and after.sealed is None
    assert len(pickle.dumps(snapshot)) == len(before)
