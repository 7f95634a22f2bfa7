"""The checkpoint's layout, and a loader state read back into the start of an epoch
(:func:`read_state`: parse, compare, plan). ``_format/build.py`` builds it from the
ledger (``state_dict()``).

A checkpoint is JSON-safe plain data (dict with str keys, list, str, int, float, bool,
None; ``_format/plain.py``), so ``json.dumps`` and ``torch.load(weights_only=True)`` both take
it. It is untrusted input on load: ``_format/parse.py`` turns it into a typed
:class:`~snaploader._format.checkpoint.Checkpoint` (every field's type and range, the
integrity digest, blobs decoded once), then :func:`read_state` compares it with the
loader (the fingerprint, ``_format/schema.py``), replays the RNG states' twist codes
and builds the restore plan, all before anything forks; every problem is a
:class:`CheckpointFormatError` naming the key path.
Layout (version 3; version 2 is read too, see ``checkpoint.READABLE_VERSIONS``)::

    format         "snaploader"
    version        3
    digest         "sha256:<hex>" over the canonical JSON of the rest, each ledger
                   replaced by the SHA-256 of its own (checkpoint.digest_of)
    fingerprint    {dataset_kind, dataset_length, batch_size, num_workers, drop_last,
                    sampler, batch_sampler, persistent_workers, generator,
                    distributed}: distributed is torch's DistributedSampler's
                   {num_replicas, rank, shuffle, seed, drop_last} or None for another
                   sampler; absent in older version-3 files (then not compared)
    epoch          index of the epoch this describes (-1: none started yet)
    ended          True when that epoch is over: the next iter() starts epoch + 1
    yielded        batches yielded in that epoch
    turn           iterable datasets: the worker whose batch comes next
    rng_kind       "generator" or "global": what the epoch's draws came from
    rng_start      base64 of that generator's state at the epoch start, or None
    rng_next       base64 of the generator's state for the next epoch, or None
    base_seed      the epoch's worker base seed; drew_base_seed: drawn this epoch
    shared_seed    an IterDataPipe's seed for the epoch (drawn from rng_start before
                   base_seed; rank 0's under torch.distributed), or None for another
                   dataset; absent in older files: None
    sampler_state  {state, done}: the stateful sampler's state before the next batch
                   (done: it has nothing left this epoch), or None
    sampler_epoch  the sampler's ``epoch`` (DistributedSampler), or None
    logical_workers the epoch's logical worker count (0: num_workers=0's main-process
                   contract); the stream's, whatever num_workers resumes it
                   (NOTE [ logical workers ] in _workers/process_main.py)
    skip           batches still to skip before the next one is yielded (a skip asked
                   with ``load_state_dict(skip=...)`` and not yet carried out; it
                   applies to the next epoch when ``ended``); absent in older files: 0
    in_order       False when the epoch's batches may have been yielded out of the fixed
                   order (in_order=False): the ledgers' counts are then the position,
                   and ``yielded`` only their sum; absent in older files: True
    item_offset    sampler items consumed before the epoch's batch 0, for an epoch
                   resumed with another batch size (_epoch/resize.py); written only
                   when not 0 (absent: 0)
    epoch_length   the dataset length the epoch runs over when a resume changed it
                   (_epoch/resize.py); written only then (absent: the fingerprint's)
    sample_root    seed_per_sample: the run's per-sample root, the base seed of the
                   loader's first epoch (NOTE [ per-sample root ] in
                   _rng/per_sample.py); written only with the option (absent: the
                   epoch's base seed is the root)
    sampler_rngs   base64 of the states of the generator objects the sampler and batch
                   sampler hold (encoded as a snapshot's objects, _rng/kinds.py): at the
                   epoch start, or for the next epoch when ``ended``
                   (_epoch/sampler_rngs.py); written only when they hold one (absent: None)
    next_batches   one None per ledger (NOTE [ one state per position ] in _format/checkpoint.py);
                   files written before 2026-12-03 may hold per worker {produced, digest}
                   of its next batch when it had already arrived, still checked after a
                   restore (the resume self-check, _workers/selfcheck.py)
    workers        one ledger per logical worker (see _state/ledger.py):
                   {worker, epoch_start, yielded, yielded_complete, exhausted, skipped}
                   (worker: its logical index, equal to its place in the list)
                   (skipped: map-style batches of the worker's share a skip passed
                   over since its last snapshot; absent in older files: 0), each snapshot
                   {rng (base64 of the raw states, _rng/capture.py; older files may hold
                   twist codes, _rng/twist.py), produced, data,
                   data_owner ("dataset", "iterator", or "both", torchdata's pair
                   of an iterable whose iterator is not the dataset: then data is
                   {"dataset": ..., "iterator": ...}; or None), complete, exhausted,
                   objects (base64 of the generator objects' states, _rng/kinds.py, or
                   None)};
                   yielded_complete is "same as yielded" when it is; epoch_start is
                   None unless resuming starts from it (nothing yielded yet, a replay
                   with no complete snapshot, an exhausted worker's last state)

Keys other than these at the top level are not snaploader's (NOTE [ foreign keys ] in
_format/checkpoint.py): not covered by the digest, not read.

User data (``data``, ``sampler_state.state``) is stored through ``_format/plain.py``'s ``encode``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .checkpoint import Checkpoint
from .fingerprint import Fingerprint, check_fingerprint
from .parse import parse
from .schema import LoaderFacts, check_consistent
from .._errors import CheckpointFormatError
from .._state.ledger import EpochStart, WorkerLedger
from .._state.records import Snapshot
from .._rng.twist import expand_for, has_codes

# -- reading a checkpoint ----------------------------------------------------------------


def _carried_dataset_state(ledgers: list[WorkerLedger], logical: int) -> Any:
    if logical != 0 or not ledgers:
        return None
    last = ledgers[0].yielded or ledgers[0].epoch_start
    if last is None or last.data_owner not in ("dataset", "both") or not last.complete:
        return None
    return last.data["dataset"] if last.data_owner == "both" else last.data


def _expanded(checkpoint: Checkpoint) -> list[WorkerLedger]:
    """The ledgers with their RNG states' twist codes replayed: once, here, after every
    cheap check passed, within the bound the parse checked (NOTE [ checkpoint limits ])."""
    base_seed = checkpoint.base_seed
    if base_seed is None:
        return list(checkpoint.workers)
    out = []
    for w, ledger in enumerate(checkpoint.workers):
        done: dict[int, Snapshot] = {}

        def expanded(snapshot: Snapshot | None, key: str) -> Snapshot | None:
            if snapshot is None or not isinstance(snapshot.rng, bytes) or not has_codes(snapshot.rng):
                return snapshot
            if id(snapshot) not in done:
                try:
                    rng = expand_for(snapshot.rng, base_seed, w)
                except ValueError as exc:
                    raise CheckpointFormatError(
                        f"loader state['workers'][{w}][{key!r}]['rng'] is not where logical worker {w}'s "
                        f"generators went from base seed {base_seed}: {exc}"
                    ) from None
                done[id(snapshot)] = replace(snapshot, rng=rng)
            return done[id(snapshot)]

        out.append(replace(
            ledger,
            epoch_start=expanded(ledger.epoch_start, "epoch_start"),
            yielded=expanded(ledger.yielded, "yielded"),
            yielded_complete=expanded(ledger.yielded_complete, "yielded_complete"),
            cache=[],
        ))
    return out


@dataclass(frozen=True)
class Restore:
    """What a validated checkpoint asks of a loader: the next epoch's start, and for a
    checkpoint taken between epochs, the sampler state and generator state to set."""

    checkpoint: Checkpoint
    start: EpochStart
    ledgers: list[WorkerLedger]
    sampler_state: dict[str, Any] | None
    rng_next: bytes | None
    # num_workers=0 iterates the dataset object itself, so what its own state_dict()
    # held at the end of a finished epoch carries into the next, as in torch: the
    # loader's dataset is set to it (None: nothing to set).
    dataset_state: Any = None


def read_state(
    state: Any, mine: Fingerprint, allowed: frozenset[str], facts: LoaderFacts, persistent: bool
) -> Restore:
    """Parse ``state``, check it against this loader and say how to resume from it.
    The epoch it describes goes on with its own logical worker count, whatever this
    loader's ``num_workers``; the epochs after it have this loader's (``facts.logical``;
    NOTE [ logical workers ] in _workers/process_main.py)."""
    checkpoint = parse(state)
    check_fingerprint(checkpoint.fingerprint, mine, allowed)
    saved = checkpoint.fingerprint
    if (
        any(saved[key] != mine.values[key] for key in ("batch_size", "dataset_length"))
        or checkpoint.item_offset
        or checkpoint.epoch_length is not None
        or (facts.counted_elsewhere is not None and facts.counted_elsewhere(checkpoint.sampler_state))
    ):
        # an epoch part of another batch size or length (_epoch/resize.py), or one
        # counted in another world's batches: this loader's batch count says nothing of it
        facts = replace(facts, batches_per_epoch=None)
    check_consistent(checkpoint, facts)
    ledgers = _expanded(checkpoint)
    logical = checkpoint.logical_workers
    position = checkpoint.sampler_state
    sampler_state = None if position is None else {"state": position.state, "done": position.done}
    if checkpoint.ended:
        if persistent and checkpoint.epoch >= 0 and ledgers and logical == facts.logical:
            start = EpochStart(
                epoch=checkpoint.epoch + 1,
                base_seed=checkpoint.base_seed,
                draw_base_seed=False,
                workers=[ledger.next_epoch() for ledger in ledgers],
                skip=checkpoint.skip,
                logical=logical,
                sample_root=checkpoint.sample_root,
            )
        else:
            start = EpochStart(epoch=checkpoint.epoch + 1, skip=checkpoint.skip, sample_root=checkpoint.sample_root)
        dataset_state = _carried_dataset_state(ledgers, logical)
        return Restore(checkpoint, start, ledgers, sampler_state, checkpoint.rng_next, dataset_state)
    expected = [None if e is None else (e.produced, e.digest) for e in checkpoint.next_batches]
    start = EpochStart(
        epoch=checkpoint.epoch,
        expected_digests=expected,
        restore_rng=checkpoint.rng_start,
        base_seed=checkpoint.base_seed,
        draw_base_seed=checkpoint.drew_base_seed,
        shared_seed=checkpoint.shared_seed,
        yielded=checkpoint.yielded,
        turn=checkpoint.turn,
        workers=ledgers,
        sampler_state=sampler_state,
        sampler_epoch=checkpoint.sampler_epoch,
        skip=checkpoint.skip,
        logical=logical,
        in_order=checkpoint.in_order,
        item_offset=checkpoint.item_offset,
        epoch_length=checkpoint.epoch_length,
        sample_root=checkpoint.sample_root,
    )
    return Restore(checkpoint, start, ledgers, None, None)
