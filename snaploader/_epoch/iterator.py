"""One epoch in the main process: where it starts, what is sent where, what comes next.

```
  EpochStart ──► start_epoch: RngSource draws (base seed, then the sampler's, replayed
                 on restore), workers started or positioned (Resume per slot)
  IndexPlan ──indices──► dispatch ──Task──► slot k mod W (map-style)
                                  ──Task──► every slot not yet done (iterable)
  __next__: takes the next result in the fixed order from the Runner (pinned by its thread
            with pin_memory), records its snapshot in the ledger, tops up the dispatch, returns it.
```

- Order is decided by data, never timing: map-style batch k comes from slot k mod W;
  iterable batches come round-robin from the slots not yet exhausted, and a slot
  counts as exhausted only when its own "exhausted" reply, or the short batch its
  iterator ran dry in, is reached (both are data, not timing). ``in_order=False``
  lets timing pick the slot, never what a slot yields (``_epoch/dispatch.py``).
- The iterator holds a :class:`LoaderSettings`, never the loader: a loader with
  persistent workers holds its iterator, and the reverse link would make a cycle that
  only the cyclic gc frees, leaving workers running after ``del loader``; and
  ``for b in DataLoader(...)`` must work with no loader left.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial
import warnings
import weakref
from typing import Any, Final

from torch.utils.data._utils import pin_memory as torch_pin_memory

from .._errors import (
    CheckpointFormatError,
    WorkerCrashedError,
    length_message,
    short_indices,
    user_stacklevel,
)
from .._workers.inline_runner import InlineRunner
from .._state.ledger import (
    EpochProgress, EpochStart, Position, WorkerLedger, first_due, share_count, skip_map_batches,
)
from .dispatch import MapDispatch, by_position, pick, round_robin
from .plan import IndexPlan, epoch_aware_part
from . import sampler_rngs
from .._state.replay import announce_replay
from .._workers.datapipe import SharedSeeds, world
from .._workers.messages import Kind, Result, Task, WorkerError, WorkerSetup
from .._workers.pinning import PinningRunner
from .._workers.process_runner import ProcessRunner
from .._rng.capture import RngSource
from .._workers.runner import Runner, RunnerClosed
from .._state.protocol import load_carried_state
from .._workers.selfcheck import check_restored_batch
from .settings import LoaderSettings

_SETTLE_TIMEOUT_S: Final = 5.0
_INVALIDATED: Final = "this iterator was invalidated by load_state_dict(); call iter(loader) to resume from the loaded state"
_CLOSED_WHILE_WAITING: Final = "this iterator was closed by another thread while next() waited; call iter(loader)"


class SnapIterator:
    """Iterator over one loader's batches; persistent workers reuse it across epochs."""

    def __init__(self, settings: LoaderSettings, start: EpochStart) -> None:
        self.settings = settings
        self.runner: Runner | None = None
        self._runner_finalizer: weakref.finalize | None = None
        self.base_seed: int | None = None
        self.closed = False
        self.invalidated: str | None = None  # why next() raises: set by invalidate()
        self.progress: EpochProgress
        self.mapping: MapDispatch | None = None  # map-style: what is sent where
        self.as_ready = False  # in_order=False with worker processes (_epoch/dispatch.py)
        self.shared_seeds = SharedSeeds(settings.dataset)  # an IterDataPipe's, torch's way
        self.start_epoch(start)

    @property
    def dispatched(self) -> int:
        """Map-style: the batches of the epoch drawn from the plan so far."""
        return 0 if self.mapping is None else self.mapping.dispatched

    @property
    def worker_pids(self) -> list[int]:
        """The pids of this iterator's live worker processes (for monitoring)."""
        return [] if self.runner is None else self.runner.worker_pids

    # -- epoch start ----------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # As torch's iterators: one holds its workers, pipes and threads. The loader
        # pickles without its iterators (_lifecycle.py); a copy starts where it stood.
        raise NotImplementedError(
            f"{type(self).__name__} cannot be pickled: it holds the loader's workers. Pickle "
            "the loader instead (it goes without its iterators), or its state_dict()"
        )

    def start_epoch(self, start: EpochStart, settings: LoaderSettings | None = None) -> None:
        """Begin the epoch ``start`` describes; ``settings`` as of this ``iter()``."""
        if settings is not None:
            self.settings = settings
        settings = self.settings
        self.taken = False  # next() called this epoch (NOTE [ a load before the first next() ] in _loader.py)
        self.as_ready = not settings.in_order and settings.num_workers > 0
        index_sampler = settings.index_sampler if start.index_sampler is None else start.index_sampler
        sampler_with_epoch = None if settings.iterable else epoch_aware_part(index_sampler)
        if start.record.sampler_epoch is not None and sampler_with_epoch is not None:
            sampler_with_epoch.set_epoch(start.record.sampler_epoch)
        source = RngSource(settings.generator)
        restoring = start.rng_start is not None
        rng_start = start.rng_start if start.rng_start is not None else source.get_state()
        logical = settings.options.logical_workers if start.logical_workers is None else start.logical_workers
        workers = list(start.workers or [WorkerLedger() for _ in range(max(1, logical))])
        yielded, skip, expected = start.yielded, start.skip, start.next_batches
        at_start = first_due(workers)  # where a restored stateful sampler stands
        if skip and not settings.iterable:
            # Map-style: the plan skips the indices and each worker keeps its snapshot,
            # so no skipped batch is fetched and none of its RNG draws is made. An
            # iterable's skipped batches are produced and discarded (_skip_batches).
            shifted = skip_map_batches(workers, yielded, skip)
            if expected is not None:
                expected = [None if a is not b else e for a, b, e in zip(workers, shifted, expected)]
            workers, yielded, skip = shifted, yielded + skip, 0
        if start.dataset_state is not None:
            load_carried_state(settings.dataset, start.dataset_state)
        replaying = source.replaying(rng_start) if restoring else contextlib.nullcontext()
        with replaying:
            shared_seed = self.shared_seeds.draw(source, start, restoring)
            base_seed = start.base_seed
            if start.draw_base_seed or base_seed is None:
                base_seed = source.draw_base_seed()
                if restoring and start.base_seed is not None and base_seed != start.base_seed:
                    raise CheckpointFormatError(
                        f"restoring epoch {start.epoch}: the generator state in the "
                        f"checkpoint gives base seed {base_seed}, the checkpoint says "
                        f"{start.base_seed}; the checkpoint was edited or is corrupt"
                    )
            self.shared_seeds.after_base_seed(source, logical, start.draw_base_seed)
            root = base_seed if start.record.sample_root is None else start.record.sample_root
            self.progress = EpochProgress(
                epoch=start.epoch,
                rng_start=rng_start,
                base_seed=base_seed,
                drew_base_seed=start.draw_base_seed,
                position=Position(yielded=yielded, turn=start.turn, workers=tuple(workers), skip=skip),
                # the epoch's own facts drawn or read now; the rest as the start has them
                record=replace(
                    start.record,
                    sampler_epoch=None if sampler_with_epoch is None else int(sampler_with_epoch.epoch),
                    in_order=start.record.in_order and not self.as_ready,
                    shared_seed=shared_seed,
                    sample_root=None if not settings.options.seed_per_sample else root,
                ),
                plan_skip=first_due(workers),
                logical_workers=logical,
                sample_seed=settings.sample_seed_for(root, start.epoch),
            )
            self._warn_or_refuse_replay()
            self._ready_workers(base_seed)
            # The sampler draws after the workers exist, as in torch: forked workers then
            # do not each inherit a copy of the epoch's index list.
            plan, self.mapping = None, None
            if not settings.iterable:
                sampler_rngs.begin(self.progress, index_sampler, settings.auto_collation, (settings.dataset, settings.generator), settings.options.exclude_rngs)
                start_at = self.progress.plan_skip
                plan = IndexPlan(
                    index_sampler, start_at, start.sampler_state, state_at=at_start, item_offset=start.record.item_offset
                )
                counts = [share_count(ledger) for ledger in workers]
                self.mapping = MapDispatch(
                    plan, start_at, counts, settings.prefetch, not self.as_ready, self.progress.sample_seed
                )
        self.progress.attach_plan(plan)
        if expected is not None and settings.options.check_resume:
            self.progress.next_batches = list(expected)
        self._dispatch()

    def _ready_workers(self, base_seed: int) -> None:
        """Start the workers (or reuse persistent ones) and position each for the epoch."""
        runner = self.runner
        # Persistent workers still busy with an abandoned epoch would answer old tasks
        # first; start them afresh from the ledger instead. Workers started for another
        # logical worker count (the epoch a checkpoint of another count resumed) too.
        if runner is None or runner.busy() or (self.base_seed, runner.logical) != (base_seed, self.progress.logical_workers):
            self._stop_workers()
            self.base_seed = base_seed
            runner = self.runner = self._start_runner(base_seed)
        # Persistent workers too are put at their epoch-start state explicitly, so a
        # worker respawned last epoch cannot drift from the ledger.
        runner.begin_epoch(self.progress)
        for slot in range(len(self.progress.workers)):
            runner.send(slot, self.progress.resume(slot))
        # Taken after iter(dataset) (some datasets have a state only then), never loaded back.
        first = self.progress.workers[0]
        if first.epoch_start is None and first.yielded is None and (own := runner.own_epoch_start()):
            self.progress.set_epoch_start(own)

    def _warn_or_refuse_replay(self) -> None:
        # Once per restore: only a restored epoch start has workers mid-epoch.
        options = self.settings.options
        announce_replay(
            self.progress.workers, self.settings.dataset, options.replay,
            state_protocol=options.state_protocol, lossy=self.settings.lossy_protocol, warn=True,
        )

    def _start_runner(self, base_seed: int) -> Runner:
        settings = self.settings
        setup = WorkerSetup(
            dataset=settings.dataset,
            iterable=settings.iterable,
            auto_collation=settings.auto_collation,
            batch_size=settings.batch_size,
            drop_last=settings.drop_last,
            collate_fn=settings.collate_fn,
            worker_init_fn=settings.worker_init_fn,
            logical=self.progress.logical_workers,
            base_seed=base_seed,
            options=settings.options,
            world=world(),
        )
        if settings.num_workers == 0:
            inline = InlineRunner(setup)
            inline.census = settings.rng_census
            return inline
        # pin_memory=True: a thread receives and pins ahead, as torch's does (_workers/pinning.py).
        make = partial(PinningRunner, device=settings.pin_device) if settings.pin_memory else ProcessRunner
        runner = make(
            setup,
            settings.context,
            processes=settings.num_workers,
            timeout_s=settings.timeout_s,
            max_retries=settings.options.max_worker_retries,
        )
        runner.census = settings.rng_census
        # NOTE [ shutdown under gc ]: a persistent iterator and its loader form a cycle.
        # The cyclic gc may run the pipes' own __del__ (which closes their fds but keeps
        # the numbers) before ours, and our close() would then close fd numbers that may
        # be reused already. Weakref callbacks run before any __del__, so the workers
        # are shut down from one.
        self._runner_finalizer = weakref.finalize(self, runner.close)
        return runner

    # -- dispatch ------------------------------------------------------------------

    def _dispatch(self) -> None:
        runner = self.runner
        if runner is None:
            return
        settings = self.settings
        if settings.iterable:
            for slot, state in enumerate(runner.slots):
                if self.progress.workers[slot].exhausted or state.failed is not None:
                    continue
                while not state.done and len(state.outstanding) < settings.prefetch:
                    runner.send(slot, Task(state.sent, None, self.progress.sample_seed))
                    state.sent += 1
            return
        if self.mapping is not None and self.progress.logical_workers > 0:
            self.mapping.top_up(runner, self.progress.first_due())

    # -- yielding ------------------------------------------------------------------

    def __iter__(self) -> SnapIterator:
        return self

    def __next__(self) -> Any:
        if self.invalidated:
            raise RuntimeError(self.invalidated)
        self.taken = True
        if self.closed or self.progress.ended:
            raise StopIteration
        try:
            return self._next_batch()
        except RunnerClosed:
            # Another thread stopped the workers while this one waited on them.
            raise RuntimeError(self.invalidated or _CLOSED_WHILE_WAITING) from None

    def _next_batch(self) -> Any:
        try:
            if self.progress.position.skip:
                self._skip_batches()
            found = self._next_result()
        except WorkerCrashedError:
            self.close()
            raise
        if found is None:
            self._end_epoch()
            raise StopIteration
        slot, task, result = found
        progress = self.progress
        if progress.next_batches and result.kind is Kind.BATCH:
            self._self_check(slot, result)
        turn = (slot + 1) % progress.slots if self.settings.iterable else progress.position.turn
        progress.advance(slot, result.snapshot, turn=turn, yielded=True)
        self._dispatch()
        if result.kind is Kind.ERROR:
            if not isinstance(result.payload, WorkerError):
                raise TypeError(f"an error result carried a {type(result.payload).__name__}")
            raise result.payload.rebuild(self._where(slot, task))
        if self.settings.iterable:
            self._check_reported_length()
        data = result.payload
        if self.settings.pin_memory and self.settings.num_workers == 0:  # as torch's, in this thread
            data = torch_pin_memory.pin_memory(data, self.settings.pin_device)
        return data

    def _next_result(self, ordered: bool = False) -> tuple[int, Task, Result] | None:
        """The slot, task and result of the next batch (in the fixed order when
        ``ordered`` or not ``as_ready``), or None at the end of the epoch. An iterable
        slot's "exhausted" reply is published here."""
        progress = self.progress
        runner = self.runner
        if runner is None:
            return None
        as_ready = self.as_ready and not ordered
        if self.mapping is not None:
            first = progress.first_due()
            if progress.logical_workers == 0:  # torch's num_workers=0 draws a batch's indices in its next()
                self.mapping.top_up(runner, first)
            if self.mapping.finished(first):
                return None
            slot = pick(runner, by_position(progress.workers)) if as_ready else first % progress.slots
            return (slot, *runner.next_result(slot))
        while live := round_robin(progress.workers, progress.position.turn):
            # When next_result raises (a poison batch, a timeout), the published turn
            # still points at this slot (or an exhausted one before it), so
            # state_dict() resumes at its batch.
            slot = pick(runner, live) if as_ready else live[0]
            task, result = runner.next_result(slot)
            if result.kind is Kind.EXHAUSTED:
                progress.advance(slot, result.snapshot, turn=(slot + 1) % progress.slots, yielded=False)
                continue
            return slot, task, result
        return None

    def _skip_batches(self) -> None:
        """Take and discard the batches an iterable's pending skip passes over (each
        worker reads its own, errors of its fetches included, never one of its start or
        restore); the epoch's end stops it (_format/skip.py)."""
        progress = self.progress
        asked = progress.position.skip
        while progress.position.skip:
            found = self._next_result(ordered=True)  # a skip counts in the fixed order
            if found is None:
                warnings.warn(
                    f"the skip asked for {asked} batch(es) of epoch {progress.epoch}, but "
                    f"the epoch ended after {asked - progress.position.skip}; the skip does "
                    "not carry over into the next epoch",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
                return
            slot, task, result = found
            if result.kind is Kind.ERROR and isinstance(result.payload, WorkerError) and result.payload.start_up:
                # no batch of the original run, so not one to skip: raised as without a skip
                raise result.payload.rebuild(self._where(slot, task))
            if progress.next_batches and result.kind is Kind.BATCH:
                self._self_check(slot, result)
            progress.advance(slot, result.snapshot, turn=(slot + 1) % progress.slots, yielded=True)
            self._dispatch()

    def _self_check(self, slot: int, result: Result) -> None:
        worker = f"worker {slot}" if self.settings.num_workers > 0 else "the main process"
        check_restored_batch(self.progress, slot, result, worker)

    def _check_reported_length(self) -> None:
        # torch's warning, in torch's words: len(loader) was asked of an iterable
        # dataset, and more batches than that came.
        reported = self.settings.reported_length
        yielded = self.progress.yielded
        if reported is None or yielded <= reported:
            return
        message = length_message(self.settings.dataset, reported, yielded, self.settings.num_workers)
        warnings.warn(message, stacklevel=user_stacklevel())

    def _where(self, slot: int, task: Task) -> str:
        if self.settings.num_workers == 0:
            place = "in the main process (num_workers=0)"
        elif self.settings.num_workers != self.progress.slots:
            place = f"in DataLoader logical worker {slot}"
        else:
            place = f"in DataLoader worker process {slot}"
        epoch = self.progress.epoch
        if self.settings.iterable:
            where = f"{place} while loading batch {self.progress.yielded - 1} of epoch {epoch}"
        else:
            where = f"{place} while loading batch {task.key} of epoch {epoch} (sample indices {short_indices(task.indices)})"
        return where

    def _end_epoch(self) -> None:
        self.progress.end()
        if not self.settings.persistent_workers:
            self.close()
        elif self.runner is not None:
            try:
                self.runner.settle(_SETTLE_TIMEOUT_S)
            except WorkerCrashedError:
                self.close()
                raise

    # -- shutdown ------------------------------------------------------------------

    def _stop_workers(self) -> None:
        if self._runner_finalizer is not None:
            self._runner_finalizer.detach()
            self._runner_finalizer = None
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def close(self) -> None:
        """Stop the workers; the iterator yields nothing more."""
        self.closed = True
        self._stop_workers()

    def invalidate(self, why: str = _INVALIDATED) -> None:
        """The loader loaded another state (or ended its workers): stop the workers, and make
        every later ``next()`` raise ``RuntimeError(why)``, not go on with a stale stream."""
        self.invalidated = why
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

