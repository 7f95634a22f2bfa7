"""One logical worker's work: seeding like torch, positioning for an epoch (a
:class:`Resume`), fetching like torch, and the snapshot after every batch.

One :class:`WorkerRuntime` is one *logical* worker (NOTE [ logical workers ] in
``_workers/worker_loop.py``, which holds the worker process's loop that hosts one or
more of them). The same class also runs in the main process for ``num_workers=0``
(``_workers/inline_runner.py``), with the main process's RNG states swapped out around
each call.

A loader of 0 logical workers (``num_workers=0``) keeps torch's contract: its single
runtime reports ``get_worker_info() is None``, runs no ``worker_init_fn`` and uses the
dataset object it is given, not a copy; only its RNG states are its own, seeded like
worker 0's.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from .._errors import CheckpointFormatError, CheckpointMismatchError
from .._rng.objects import ObjectRngs, RngReport
from .._rng.per_sample import Domain, SampleSeeder
from .._format.plain import check_plain
from .datapipe import is_iter_datapipe, seed_graph, seeded_generators, shard_graph
from .messages import Kind, Result, Task, WorkerError, WorkerSetup
from .._state.protocol import has_state_protocol
from .._state.records import Resume, Snapshot
from .._rng.capture import NativeRng, RngState, capture_rng, restore_rng

# Per-sample states are made this many keys at a time: one NumPy pass per few samples,
# while the words (7.5 KB a key) stay in the cache the dataset's own work also needs.
_SEED_CHUNK = 8


def seed_like_torch(base_seed: int, worker_id: int) -> int:
    """Seed the three global RNGs exactly as torch seeds worker ``worker_id``."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


def set_worker_info(info: torch_worker.WorkerInfo | None) -> None:
    # torch.utils.data.get_worker_info() and snaploader.get_worker_info() read this.
    torch_worker._worker_info = info


class WorkerRuntime:
    """Produces the batches of one logical worker and the snapshot after each.

    ``setup`` is this logical worker's own (a host gives each one it holds a copy, as
    each torch worker process has its own); ``setup.logical`` is the logical worker
    count, 0 for the main-process contract (see the module docstring)."""

    def __init__(self, setup: WorkerSetup, worker_id: int, *, in_main_process: bool) -> None:
        self.setup = setup
        self.worker_id = worker_id
        self.dataset = setup.dataset
        # In the main process a state_dict() may alias live objects, so it is copied;
        # and RNG states are kept unencoded, for the cheap swap around every batch.
        self.in_main_process = in_main_process
        self.main_contract = setup.logical == 0
        self.info: torch_worker.WorkerInfo | None = None
        self.pending_error: WorkerError | None = None
        self.iterator: Iterator[Any] | None = None
        self.ended = False
        self.exhausted = False
        self.produced = 0
        self.checked_plain = False
        # The dataset's (or its iterator's) own load_state_dict() positioned it, and no
        # batch came since: an error of the next fetch names that state as the cause.
        self.own_state_loaded = False
        self.seed_rng: bytes | None = None  # RNG states right after seeding
        self.objects = ObjectRngs([], [])  # generator objects the worker's code holds
        self.objects_now: tuple[bytes | None, RngReport | None] = (None, None)  # as of the last snapshot
        self._seeder: SampleSeeder | None = None  # seed_per_sample, over ``objects``

    # -- start-up and positioning -------------------------------------------------

    def initialize(self) -> None:
        """Seed as torch does, publish the worker info, run ``worker_init_fn`` (neither
        of the last two under the main-process contract)."""
        seed = seed_like_torch(self.setup.base_seed, self.worker_id)
        self.seed_rng = capture_rng()
        world_size, rank = self.setup.world
        if self.main_contract:
            set_worker_info(None)
            self._shard(0, world_size, rank)
            self._discover()
            return
        self.info = torch_worker.WorkerInfo(
            id=self.worker_id,
            num_workers=self.setup.logical,
            seed=seed,
            dataset=self.dataset,
        )
        set_worker_info(self.info)
        # torch shards a DataPipe in a wrapper around worker_init_fn, before it runs
        self._shard(self.setup.logical, world_size, rank)
        if self.setup.worker_init_fn is not None:
            try:
                self.setup.worker_init_fn(self.worker_id)
            except Exception as exc:
                self.pending_error = WorkerError.capture(exc)
        self._discover()

    def _shard(self, workers: int, world_size: int, rank: int) -> None:
        try:
            shard_graph(self.dataset, self.worker_id, workers, world_size, rank)
        except Exception as exc:  # two sharding_filters in one branch, say
            self.pending_error = WorkerError.capture(exc)

    def _discover(self) -> None:
        """Find the generator objects the worker's code holds (``_rng/objects.py``): at start,
        after ``worker_init_fn``, and at every resume, where a new iterator appears."""
        setup = self.setup
        roots = [("dataset", self.dataset), ("collate_fn", setup.collate_fn),
                 ("worker_init_fn", setup.worker_init_fn)]
        if self.iterator is not None:
            roots.append(("iterator", self.iterator))
        self._seeder = None
        try:
            self.objects = ObjectRngs.find(
                roots, setup.options.rng_objects, setup.options.exclude_rngs, seeded_generators(self.dataset)
            )
        except Exception as exc:  # rng_objects() or an exclude_rngs predicate raised
            self.objects = ObjectRngs([], [])
            self.pending_error = self.pending_error or WorkerError.capture(exc)

    @property
    def seeder(self) -> SampleSeeder:
        if self._seeder is None:
            self._seeder = SampleSeeder(self.objects)
        return self._seeder

    def _restore_rng(self, state: RngState) -> None:
        # The main process checked a checkpoint's states and replayed their twist codes
        # (_format/restore.py); the error path stays for a state that still cannot be set.
        try:
            restore_rng(state, self.seed_rng)
        except ValueError as exc:
            self.pending_error = self.pending_error or WorkerError.capture(
                CheckpointFormatError(
                    f"worker {self.worker_id} cannot restore its RNG states from the "
                    f"checkpoint: {exc}. Load an unedited checkpoint, or start the epoch afresh"
                )
            )

    def _restore_objects(self, blob: bytes | None, skip_iterator: bool = False) -> None:
        try:
            self.objects.restore(blob, self.worker_id, skip_iterator)
        except CheckpointFormatError as exc:
            self.pending_error = self.pending_error or WorkerError.capture(exc)

    def resume(self, msg: Resume) -> None:
        base = msg.base
        self.ended = self.exhausted = False
        self.checked_plain = False
        self.own_state_loaded = False
        self.iterator = None
        self._discover()
        # iter(dataset) may draw from the global RNGs (a shuffle seed, say). Mid-epoch,
        # that draw happened before ``base`` was taken, so the RNGs are restored after
        # the iterator is made; at an epoch start it comes after ``base``, so before.
        mid_epoch = None if msg.new_epoch else base
        if base is not None:
            if mid_epoch is None:
                self._restore_rng(base.rng)
                # the last epoch's iterator, and the generators it held, are gone
                self._restore_objects(base.objects, skip_iterator=True)
            # torchdata's order: the dataset's state before iter(dataset), the iterator's after
            if base.data_owner in ("dataset", "both") and base.complete:
                self.own_state_loaded = True
                try:
                    self.dataset.load_state_dict(self._copied(own_part(base, "dataset")))
                except Exception as exc:
                    self.pending_error = WorkerError.capture(_blame_own_state(exc, self.dataset, "while its load_state_dict() restored"))
        self.produced = msg.base_produced
        if self.setup.iterable:
            iterator_state = mid_epoch is not None and mid_epoch.data_owner in ("iterator", "both") and mid_epoch.complete
            try:
                if msg.shared_seed is not None and is_iter_datapipe(self.dataset):
                    # every epoch, replayed or not, before the pipe's iterator is made
                    seed_graph(self.dataset, msg.shared_seed)
                self.iterator = iter(self.dataset)
            except Exception as exc:
                self.pending_error = self.pending_error or WorkerError.capture(exc)
                self.iterator = iter(())
            if iterator_state and mid_epoch is not None:
                self.own_state_loaded = True
                try:
                    self.iterator.load_state_dict(self._copied(own_part(mid_epoch, "iterator")))  # type: ignore[union-attr]
                except Exception as exc:
                    how = "while its iterator's load_state_dict() restored"
                    self.pending_error = self.pending_error or WorkerError.capture(_blame_own_state(exc, self.dataset, how))
                    self.iterator = iter(())
            self._discover()
        if mid_epoch is not None:
            self._restore_rng(mid_epoch.rng)
            self._restore_objects(mid_epoch.objects)
        if self.setup.iterable:
            target = self.produced + msg.replay
            while self.produced < target and not self.exhausted:
                self._replay_one(msg.seed)
            if self.produced < target:
                # A checkpoint of this data never claims more batches than the iterator
                # gives; stop here rather than loop on, and say so when the batch is due.
                self.pending_error = WorkerError.capture(
                    CheckpointFormatError(
                        f"the checkpoint says worker {self.worker_id} had produced {target} "
                        f"batch(es) of this epoch, but its iterator ran dry after "
                        f"{self.produced - 1} on replay: the checkpoint does not belong to "
                        "this dataset (or the dataset's data changed). Load the checkpoint "
                        "taken with this data, or start the epoch afresh"
                    )
                )
        if msg.final_rng is not None:
            self._restore_rng(msg.final_rng)
            self._restore_objects(msg.final_objects)
        if msg.exhausted:
            self.exhausted = True

    def _replay_one(self, seed: int | None) -> None:
        try:
            self._fetch_iterable(seed)
        except StopIteration:
            self.exhausted = True
        except Exception:  # the original run raised here too and went on
            pass
        self.produced += 1

    # -- producing ----------------------------------------------------------------

    def run(self, task: Task) -> Result:
        if self.exhausted:
            return Result(task.key, Kind.EXHAUSTED, None, self.snapshot())
        kind = Kind.BATCH
        payload: Any
        if self.pending_error is not None:
            kind, payload, self.pending_error = Kind.ERROR, replace(self.pending_error, start_up=True), None
        else:
            try:
                if self.setup.iterable:
                    payload = self._fetch_iterable(task.seed)
                else:
                    payload = self._fetch_map(task.indices, task.seed, task.key)
            except StopIteration as exc:
                if self.setup.iterable:
                    self.exhausted = True
                    return Result(task.key, Kind.EXHAUSTED, None, self.snapshot())
                kind, payload = Kind.ERROR, WorkerError.capture(exc)
            except Exception as exc:
                if self.own_state_loaded:
                    _blame_own_state(exc, self.dataset, "in the first batch after its own load_state_dict() restored")
                kind, payload = Kind.ERROR, WorkerError.capture(exc)
            self.own_state_loaded = False
        self.produced += 1
        try:
            snapshot = self.snapshot()
        except Exception as exc:
            # A state_dict() that raises or returns non-plain data is the user's error:
            # report it like one raised in __getitem__, not as a worker crash.
            objects, report = self.objects_now
            bare = Snapshot(self._capture_rng(), self.produced, complete=not self.setup.iterable,
                            objects=objects, report=report)
            return Result(task.key, Kind.ERROR, WorkerError.capture(exc), bare)
        return Result(task.key, kind, payload, snapshot)

    def _fetch_map(self, indices: Any, seed: int | None, key: int) -> Any:
        setup = self.setup
        if seed is not None:
            return self._fetch_map_seeded(indices, seed, key)
        if not setup.auto_collation:
            return setup.collate_fn(self.dataset[indices])
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:
            data = getitems(indices)
        else:
            data = [self.dataset[i] for i in indices]
        return setup.collate_fn(data)

    def _fetch_map_seeded(self, indices: Any, seed: int, key: int) -> Any:
        # seed_per_sample: each sample's draws from its own states, and collate_fn's
        # from the batch's (_rng/per_sample.py). A __getitems__ gets one index a call:
        # nothing can reset the generators between the items of one call.
        setup, seeder = self.setup, self.seeder
        single = not setup.auto_collation
        batch = [indices] if single else list(indices)
        getitems = None if single else getattr(self.dataset, "__getitems__", None)
        data = []
        for at in range(0, len(batch), _SEED_CHUNK):
            chunk = batch[at : at + _SEED_CHUNK]
            for index, row in zip(chunk, seeder.states(seed, Domain.SAMPLE, chunk)):
                seeder.put(row)
                data.append(getitems([index])[0] if getitems else self.dataset[index])
        seeder.put(seeder.states(seed, Domain.BATCH, [key])[0])
        return setup.collate_fn(data[0] if single else data)

    def _fetch_iterable(self, seed: int | None) -> Any:
        # Mirrors torch's _IterableDatasetFetcher exactly, drop_last included.
        if self.ended or self.iterator is None:
            raise StopIteration
        setup = self.setup
        iterator = self.iterator
        batch_size = (setup.batch_size or 1) if setup.auto_collation else 1
        if seed is not None:
            # seed_per_sample: item j of this logical worker's epoch from the states of
            # (seed, worker, j); collate_fn's draws go on from the last item's.
            seeder = self.seeder
            rows = iter(seeder.states(seed, Domain.ITEM, range(self.produced * batch_size, (self.produced + 1) * batch_size), stream=self.worker_id))

            def draw() -> Any:
                seeder.put(next(rows))
                return next(iterator)
        else:
            draw = iterator.__next__
        if not setup.auto_collation:
            return setup.collate_fn(draw())
        data = []
        for _ in range(batch_size):
            try:
                data.append(draw())
            except StopIteration:
                self.ended = True
                break
        if not data or (setup.drop_last and len(data) < batch_size):
            raise StopIteration
        return setup.collate_fn(data)

    # -- snapshots ----------------------------------------------------------------

    def _capture_rng(self) -> RngState:
        if self.in_main_process:
            return NativeRng.take(self.seed_rng)
        return capture_rng(self.seed_rng)

    def snapshot(self) -> Snapshot:
        setup = self.setup
        rng = self._capture_rng()
        objects, report = self.objects_now = self.objects.snapshot()
        owner: str | None = None
        if not setup.options.state_protocol:
            pass  # the user chose replay over the dataset's own protocol
        elif setup.iterable and has_state_protocol(self.iterator):
            # As torchdata's: the dataset's state too, unless the dataset is its own iterator
            both = self.iterator is not self.dataset and has_state_protocol(self.dataset)
            owner = "both" if both else "iterator"
        elif has_state_protocol(self.dataset):
            owner = "dataset"
        # A batch cut short by the end of the iterator is the worker's last: torch's
        # fetcher never calls next() again after that, so neither may a restored worker.
        exhausted = self.exhausted or self.ended
        if setup.iterable:
            due = exhausted or setup.options.state_due(self.produced)
            if owner is None or not due:
                # data_owner without data: a replay from an earlier snapshot of a
                # stateful dataset (snapshot_every > 1), not one for want of the protocol
                return Snapshot(rng, self.produced, None, owner, False, exhausted, objects, report)
        if owner is None:
            return Snapshot(rng, self.produced, objects=objects, report=report)
        parts = {"dataset": self.dataset, "iterator": self.iterator} if owner == "both" else {
            owner: self.iterator if owner == "iterator" else self.dataset}
        states = {part: source.state_dict() for part, source in parts.items()}  # type: ignore[union-attr]
        if not self.checked_plain:
            for part, source in parts.items():
                check_plain(states[part], f"{type(source).__qualname__}.state_dict()")
            self.checked_plain = True
        data = states if owner == "both" else states[owner]
        return Snapshot(rng, self.produced, self._copied(data), owner, True, exhausted, objects, report)

    def _copied(self, data: Any) -> Any:
        if not self.in_main_process or data is None:
            return data
        # Plain data: a pickle round trip copies it several times faster than
        # deepcopy (1 ms against 6.6 ms for a 10,000-int shuffle buffer).
        return pickle.loads(pickle.dumps(data, pickle.HIGHEST_PROTOCOL))


def own_part(snapshot: Snapshot, owner: str) -> Any:
    """The dataset's or iterator's own state in ``snapshot`` (its part, for "both")."""
    return snapshot.data[owner] if snapshot.data_owner == "both" else snapshot.data


def _blame_own_state(exc: BaseException, dataset: Any, how: str) -> BaseException:
    """``exc``, with a note naming the dataset's own state protocol as the likely cause
    of a failed restore, and the option that resumes without it."""
    if isinstance(exc, (CheckpointFormatError, CheckpointMismatchError)):
        return exc  # the dataset refused the state itself, saying why: no guess to add
    name = type(dataset).__qualname__
    exc.add_note(
        f"Raised {how} {name}'s own state from a snapshot (a checkpoint's, or the last "
        f"epoch's end with persistent workers): that state, or what {name}'s "
        "load_state_dict() does with it, is the likely cause. As in torchdata, the "
        "dataset's load_state_dict() runs before iter(dataset) and its iterator's after it "
        "(the dataset's own when __iter__ returns self); the state may also lack "
        "something the next batch needs, or come from another logical worker count "
        "(docs/iterable.md, \"Datasets with their own state\"). Build the loader with "
        "state_protocol=False to resume it exactly by replay from the epoch start instead"
    )
    return exc
