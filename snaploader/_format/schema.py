"""Whether a parsed checkpoint fits the loader it is loaded into: :class:`LoaderFacts`
(what the loader says of itself) and :func:`check_consistent`, with what its sampler
(:func:`check_sampler_resume`, :func:`another_world`) and dataset (:func:`check_seeds`)
say of it, run on the
:class:`~snaploader._format.checkpoint.Checkpoint` that ``_format/parse.py`` made, after
the fingerprint comparison and before anything forks (``_format/restore.plan_restore``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .checkpoint import Checkpoint
from .._errors import CheckpointFormatError
from .._state.ledger import share_count
from .._state.protocol import stateful_part
from .._state.records import Snapshot


def _fail(where: str, problem: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{where} {problem}")


@dataclass(frozen=True)
class LoaderFacts:
    """What a checkpoint must agree with about the loader it is loaded into."""

    iterable: bool
    dataset_has_protocol: bool  # and the loader uses it (state_protocol)
    batches_per_epoch: int | None  # map-style, when the sampler has a length
    state_protocol: bool = True  # the loader's option of that name
    logical_workers: int = 1  # the loader's logical worker count (for its new epochs)
    # The logical worker slots of the epoch the checkpoint describes: plan_restore sets
    # it from the checkpoint, which may have been taken with another count.
    slots: int = 1


def check_consistent(checkpoint: Checkpoint, facts: LoaderFacts) -> None:
    """Raise :class:`CheckpointFormatError` unless the position agrees with the loader:
    a state that loads must resume the stream it was taken from. The epoch goes on with
    the checkpoint's own logical worker slots (``checkpoint.slots``)."""
    if checkpoint.epoch == -1:
        return
    slots, turn, yielded, ended = checkpoint.slots, checkpoint.turn, checkpoint.yielded, checkpoint.ended
    if turn >= slots or (not facts.iterable and turn != 0):
        raise _fail("loader state['turn']", f"is {turn}; expected 0{'' if not facts.iterable else f' to {slots - 1}'}")
    batches = facts.batches_per_epoch
    if batches is not None:
        if yielded > batches or (ended and yielded != batches):
            raise _fail(
                "loader state['yielded']",
                f"is {yielded} for an epoch of {batches} batches{' that ended' if ended else ''}",
            )
        skip_from = 0 if ended else yielded
        if skip_from + checkpoint.skip > batches:
            raise _fail(
                "loader state['skip']",
                f"is {checkpoint.skip}, past the end of an epoch of {batches} batches from batch {skip_from}",
            )
    produced = [share_count(ledger) for ledger in checkpoint.workers]
    for w, ledger in enumerate(checkpoint.workers):
        where = f"loader state['workers'][{w}]"
        for key, snapshot in (("epoch_start", ledger.epoch_start), ("yielded", ledger.yielded), ("yielded_complete", ledger.yielded_complete)):
            if snapshot is not None:
                _check_snapshot(f"{where}[{key!r}]", snapshot, facts)
        if ledger.skipped and facts.iterable:
            raise _fail(f"{where}['skipped']", "is set for an iterable dataset, whose skipped batches are produced")
        if not facts.iterable and checkpoint.record.in_order:
            # Map-style batch k comes from worker k mod W: the counts are fixed.
            due = len(range(w, yielded, slots))
            if produced[w] != due:
                raise _fail(f"{where}['yielded']", f"says {produced[w]} batch(es) produced; batch {yielded} of the epoch needs {due}")
        elif not facts.iterable and batches is not None:
            # in_order=False: any prefix of the worker's share.
            share = len(range(w, batches, slots))
            if produced[w] > share:
                raise _fail(f"{where}['yielded']", f"says {produced[w]} batch(es) produced; its share of the epoch is {share}")
    if facts.iterable and ended and not all(ledger.exhausted for ledger in checkpoint.workers):
        raise _fail("loader state['ended']", "is True, but not every worker of the iterable ran dry")
    if facts.iterable and checkpoint.record.in_order:
        # The round-robin visits the slots not yet exhausted in order from slot 0: each
        # has produced the same number of batches, one more for those before ``turn``.
        live = [w for w, ledger in enumerate(checkpoint.workers) if not ledger.exhausted]
        rounds = {produced[w] - (1 if w < turn else 0) for w in live}
        if len(rounds) > 1 or any(r < 0 for r in rounds):
            raise _fail("loader state['workers']", f"hold batch counts {produced} that no round-robin at turn {turn} gives")


def _check_snapshot(where: str, snapshot: Snapshot, facts: LoaderFacts) -> None:
    owner = snapshot.data_owner
    if owner is not None and not facts.state_protocol:
        raise _fail(
            f"{where}['data_owner']",
            f"is {owner!r}: the checkpoint holds the dataset's own state, and this loader "
            "was built with state_protocol=False, which would resume without it. Build "
            "the loader with state_protocol=True to resume this checkpoint, or start "
            "the epoch afresh",
        )
    if not facts.iterable:
        expected_owner = "dataset" if facts.dataset_has_protocol else None
        if owner is None and expected_owner is not None and snapshot.complete and not snapshot.exhausted:
            raise _fail(
                f"{where}['data_owner']",
                "is None: the checkpoint holds none of the dataset's own state (it was taken "
                "with state_protocol=False), and this loader was built with state_protocol=True "
                "over a dataset with state_dict()/load_state_dict(), which would resume from "
                "it. Build the loader with state_protocol=False to resume this checkpoint, or "
                "start the epoch afresh",
            )
        if owner != expected_owner or not snapshot.complete or snapshot.exhausted:
            raise _fail(
                where,
                f"is not a map-style dataset's snapshot (data_owner {owner!r}, complete "
                f"{snapshot.complete}, exhausted {snapshot.exhausted}; expected "
                f"{expected_owner!r}, True, False)",
            )
        return
    if owner in ("dataset", "both") and not facts.dataset_has_protocol:
        raise _fail(f"{where}['data_owner']", f"is {owner!r}, but this dataset has no state_dict()/load_state_dict()")
    if owner is None and facts.dataset_has_protocol:
        raise _fail(
            f"{where}['data_owner']",
            "is None, but this dataset has state_dict()/load_state_dict(); a checkpoint "
            "taken with state_protocol=False resumes only in a loader built with "
            "state_protocol=False",
        )
    if snapshot.complete and owner is None:
        raise _fail(f"{where}['complete']", "is True for a snapshot that holds no dataset or iterator state")


def another_world(index_sampler: Any, position: Any) -> tuple[int, bool] | None:
    """For the mid-epoch ``position`` (a ``SamplerPosition``) of a stateful sampler that
    deals one stream to the ranks, taken on another world size: this rank's items of
    the epoch (``len(sampler)``) that stand before it in this world, and whether none
    are left after it. None for any other sampler or a position of this world size."""
    stateful = stateful_part(index_sampler)
    offset_of = getattr(stateful, "_snaploader_item_offset", None)
    if stateful is None or offset_of is None or position is None:
        return None
    offset = offset_of(position.state)
    return None if offset is None else (offset, offset >= len(stateful))


def check_sampler_resume(index_sampler: Any, position: Any, allowed: frozenset[str], prefix: bool) -> None:
    """Let a stateful sampler that checks its own resume (a Mixture's: its weights and
    sources) see the checkpoint's state of it and ``allow_mismatch`` before anything is
    loaded; refuse ``allow_mismatch`` names that only such a sampler checks when this
    loader's has no such check. ``position``: the checkpoint's ``SamplerPosition`` or
    None; ``prefix``: whether the batches behind the position are the epoch's first ones
    (not so mid-epoch with ``in_order=False``)."""
    stateful = stateful_part(index_sampler)
    check = getattr(stateful, "_snaploader_check_resume", None)
    if check is None:
        if "weights" in allowed:
            raise ValueError(
                f"allow_mismatch names 'weights', which only a Mixture's sampler checks; this "
                f"loader's sampler is {type(index_sampler).__name__}: leave 'weights' out"
            )
        return
    if position is not None:
        check(position.state, allowed, prefix)


def shared_seed_error(epoch: int, had_shared_seed: bool, dataset: Any) -> CheckpointFormatError:
    had = "an IterDataPipe" if had_shared_seed else "a dataset that is not an IterDataPipe"
    return CheckpointFormatError(
        f"restoring epoch {epoch}: loader state['shared_seed'] says the checkpoint "
        f"was taken with {had}, but this loader's dataset is a "
        f"{type(dataset).__qualname__}. Load the checkpoint into a loader "
        "of the same dataset, or start the epoch afresh"
    )


def check_seeds(checkpoint: Checkpoint, datapipe: bool, dataset: Any) -> None:
    """Whether the interrupted epoch drew an IterDataPipe's shared seed before its base
    seed (``_workers/datapipe.py``), as this loader's dataset will when the epoch is
    drawn again: refused here, at ``load_state_dict()``, not at ``iter()``. (The base
    seed's agreement with ``rng_start`` is the parse's.)"""
    if datapipe != (checkpoint.record.shared_seed is not None):
        raise shared_seed_error(checkpoint.epoch, checkpoint.record.shared_seed is not None, dataset)
