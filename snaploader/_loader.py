"""The public :class:`DataLoader`: torch's arguments, torch's stream, exact resume."""

from __future__ import annotations

import multiprocessing
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Final, Generic, TypeVar

import torch
import torch.utils.data as torch_data

from ._format.build import build_state
from ._format.consumed import consumed_of, unrebuilt
from ._format.parse import parse
from ._format.restore import Target, plan_restore
from ._format.resize import part_batches
from ._workers.datapipe import is_iter_datapipe
from ._format.fingerprint import Fingerprint, fingerprint_of
from ._format.schema import LoaderFacts
from ._epoch.iterator import SnapIterator
from ._epoch.settings import LoaderSettings
from ._options import Options
from ._state.ledger import EpochProgress, EpochStart, current_epoch
from ._state.published import Publisher
from ._rng.objects import ObjectRngs, RngCensus, described, discover
from ._epoch import sampler_rngs
from ._state.protocol import has_state_protocol, resolve_state_protocol, stateful_part
from ._rng.capture import RngSource
from ._lifecycle import LoaderLifecycle

# The type of the batches, as in torch: ``DataLoader[int]`` is valid in annotations.
_T_co = TypeVar("_T_co", covariant=True)


class _Default(int):
    """An int default that can be told apart from the same value passed explicitly."""


_SNAPSHOT_EVERY_DEFAULT: Final = _Default(1)


_V = TypeVar("_V")


class _Option(Generic[_V]):
    """A loader attribute that reads the option of its name from ``loader._snaploader_options``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loader: Any, owner: type | None = None) -> _V:
        return getattr(loader._snaploader_options, self.name)  # type: ignore[no-any-return]

    def __set__(self, loader: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only: build a new loader with {self.name}={value!r:.40}")


def _own_sampler(dataset: Any, shuffle: bool | None, sampler: Any, batch_sampler: Any, generator: Any) -> Any:
    """The sampler a dataset brings for itself (a Mixture's, which orders its own
    epochs) when the user gave neither ``sampler`` nor ``batch_sampler``; ``sampler`` otherwise."""
    make = getattr(dataset, "__snaploader_sampler__", None)
    if make is None or sampler is not None or batch_sampler is not None:
        return sampler
    if shuffle:
        raise ValueError(
            f"shuffle=True with a {type(dataset).__name__}: it orders its own samples (a seeded "
            "blend of its sources, each in a shuffled order), so leave shuffle out"
        )
    return make(generator)


class DataLoader(LoaderLifecycle, torch_data.DataLoader[_T_co]):  # type: ignore[misc]  # _iterator: _lifecycle.py
    """A drop-in for :class:`torch.utils.data.DataLoader` whose ``state_dict()``, taken
    at any moment, resumes the batch stream bit for bit in a new process.

    The positional and keyword arguments are torch's, in torch's order, with torch's
    defaults and validation. snaploader's own options are keyword-only:

    * ``snapshot_every`` (int, default 1): for an iterable dataset whose iterator (or
      the dataset) implements ``state_dict()``, call it only every N batches; resume
      then replays at most N-1 batches from the last such state, exactly. 0: only after
      a worker's last batch (resume replays from the epoch start).
      ``snapshot_every_n_steps`` is accepted as torchdata's name for it (not both).
    * ``replay`` ("warn", "allow" or "refuse"; default "warn"): what to do when an exact
      resume of an iterable dataset without the state protocol must replay batches
      from the epoch start: warn once, replay silently, or raise
      :class:`~snaploader.ReplayRefusedError`.
    * ``max_worker_retries`` (int, default 3): how many times a worker that dies on the
      same batch is respawned before :class:`~snaploader.WorkerCrashedError`.
    * ``check_resume`` (bool, default True): compare the batches regenerated after a
      restore with the digests an older release's checkpoint kept of them
      (:class:`~snaploader.ResumeMismatchWarning`); this release writes none (docs/api.md).
    * ``rng_objects`` (callable or None): called in each worker after ``worker_init_fn``;
      returns an object (or a list or dict of them) holding generators the search of
      the dataset, ``collate_fn`` and ``worker_init_fn`` cannot reach (a global of
      another module, say), to capture them too.
    * ``exclude_rngs`` (paths, or a predicate ``(path, generator) -> bool``): generator
      objects not to capture; a path leaves out everything under it.
      :meth:`captured_rngs` lists what is captured.
    * ``logical_workers`` (int or None, default None: ``num_workers``): the worker count
      that defines the stream (batch k from logical worker k mod W, each seeded and
      given ``get_worker_info()`` as torch's worker k), hosted by ``num_workers``
      processes (the main process at 0). A checkpoint resumes exactly whatever the
      ``num_workers`` of the loader it is loaded into; see ``docs/elastic.md``.
    * ``state_protocol`` (default None): True uses the dataset's (or iterator's) own
      ``state_dict()``/``load_state_dict()`` in checkpoints; False ignores them (an
      iterable resumes by replay from the epoch start, exactly; a map-style dataset's
      state is not restored); None: True, except for datasets known to lose data
      through it (HF's shuffled IterableDataset): False, with a warning. docs/iterable.md.
    * ``seed_per_sample`` (bool, default False): each sample's random draws come from
      states derived from (the epoch's base seed, the epoch, its index) alone, the
      same whatever the topology reading it; not torch's stream for the same seed
      (``docs/elastic.md``, "Per-sample seeds").

    Differences from torch are listed in ``docs/differences.md``.
    """

    def __init__(
        self,
        dataset: torch_data.Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: torch_data.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: torch_data.Sampler[Any] | Iterable[Any] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        snapshot_every: int = _SNAPSHOT_EVERY_DEFAULT,
        replay: str = "warn",
        max_worker_retries: int = 3,
        check_resume: bool = True,
        rng_objects: Callable[[], Any] | None = None,
        exclude_rngs: Iterable[str] | Callable[[str, Any], bool] = (),
        snapshot_every_n_steps: int | None = None,
        state_protocol: bool | None = None,
        logical_workers: int | None = None,
        seed_per_sample: bool = False,
    ) -> None:
        sampler = _own_sampler(dataset, shuffle, sampler, batch_sampler, generator)
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if num_workers > 0 and self.prefetch_factor == 0:
            raise ValueError(
                "prefetch_factor=0 with num_workers > 0 would never send a batch to a "
                "worker (torch's DataLoader accepts it at construction, then raises "
                "AssertionError at iter()); use prefetch_factor >= 1"
            )
        state_protocol, self._lossy_protocol = resolve_state_protocol(state_protocol, dataset)
        self._snaploader_options = Options.checked(
            num_workers,
            snapshot_every=snapshot_every,
            snapshot_every_n_steps=snapshot_every_n_steps,
            replay=replay,
            max_worker_retries=max_worker_retries,
            check_resume=check_resume,
            rng_objects=rng_objects,
            exclude_rngs=exclude_rngs,
            state_protocol=state_protocol,
            logical_workers=logical_workers,
            seed_per_sample=seed_per_sample,
            snapshot_every_given=snapshot_every is not _SNAPSHOT_EVERY_DEFAULT,
        )
        self._rng_census = RngCensus(per_sample=seed_per_sample)
        self._sample_seed: int | None = None  # _draw_with_sample_seed's
        self._iterable = isinstance(self.dataset, torch_data.IterableDataset)
        self._pending: EpochStart | None = None
        self._published = Publisher()  # what state_dict() reads
        self._persistent_iter: SnapIterator | None = None
        # Every iterator of this loader still alive (weakly: an iterator dropped by the
        # user must not be kept), so that load_state_dict() can invalidate them.
        self._iterators: weakref.WeakSet[SnapIterator] = weakref.WeakSet()

    # -- the options, as read-only attributes of their own names (docs/api.md) ----------

    snapshot_every: _Option[int] = _Option()
    replay: _Option[str] = _Option()
    max_worker_retries: _Option[int] = _Option()
    check_resume: _Option[bool] = _Option()
    rng_objects: _Option[Callable[[], Any] | None] = _Option()
    exclude_rngs: _Option[tuple[str, ...] | Callable[[str, Any], bool]] = _Option()
    state_protocol: _Option[bool] = _Option()
    logical_workers: _Option[int] = _Option()
    seed_per_sample: _Option[bool] = _Option()

    # -- iteration -------------------------------------------------------------------

    def _settings(self) -> LoaderSettings:
        context = self.multiprocessing_context
        accelerator = torch.accelerator.current_accelerator()
        return LoaderSettings(
            dataset=self.dataset,
            index_sampler=self._index_sampler,
            iterable=self._iterable,
            auto_collation=self._auto_collation,
            context=multiprocessing.get_context() if context is None else context,
            pin_memory=bool(self.pin_memory) and torch.accelerator.is_available(),
            pin_device=None if accelerator is None else accelerator.type,
            reported_length=self._IterableDataset_len_called,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            timeout_s=float(self.timeout),
            persistent_workers=self.persistent_workers,
            generator=self.generator,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            collate_fn=self.collate_fn,
            worker_init_fn=self.worker_init_fn,
            options=self._snaploader_options,
            rng_census=self._rng_census,
            lossy_protocol=self._lossy_protocol,
            in_order=self.in_order,
            sample_seed=self._sample_seed,
        )

    def _warn_pin_memory(self) -> None:
        # The same warnings torch's iterator gives, at the same moment.
        if self.pin_memory and self.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as "
                f"the device,ignore pin_memory_device='{self.pin_memory_device}'.",
                stacklevel=3,
            )
        if self.pin_memory and not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, then "
                "device pinned memory won't be used.",
                stacklevel=3,
            )

    def __iter__(self) -> SnapIterator:  # type: ignore[override]
        self._warn_pin_memory()
        return self._begin(self._persistent_iter)

    def _begin(self, reuse: SnapIterator | None) -> SnapIterator:
        """The next epoch, in ``reuse`` (persistent, or not yet next()ed) or a new iterator."""
        start = self._next_start()
        settings = self._settings()
        # NOTE [ epoch start ] in _state/published.py
        with self._published.starting(RngSource(self.generator).next_epoch_state) as publish:
            if reuse is not None and not reuse.closed:
                reuse.start_epoch(start, settings)
                iterator = reuse
            else:
                if self.num_workers > 0:
                    self.check_worker_number_rationality()
                iterator = SnapIterator(settings, start)
            if self.persistent_workers:
                self._persistent_iter = iterator
            self._iterators.add(iterator)
            publish(iterator.progress)
        return iterator

    def _next_start(self) -> EpochStart:
        start, self._pending = self._upcoming_start() or EpochStart(epoch=0), None
        return start

    def _upcoming_start(self) -> EpochStart | None:
        """What the next ``iter()`` starts; None for a loader never iterated nor loaded."""
        if self._pending is not None:
            return self._pending
        previous = self._published.progress
        if previous is None:
            return None
        return EpochStart.after(previous, self.persistent_workers, self._snaploader_options.logical_workers)

    def _draw_with_sample_seed(self, *, sample_seed: int) -> None:
        """For ``snaploader.distributed``: draw every sample with ``sample_seed`` (the
        epoch a re-partitioned loader reads the rest of) instead of this loader's own."""
        if not self._snaploader_options.seed_per_sample or type(sample_seed) is not int or not 0 <= sample_seed < 2**64:
            raise ValueError(f"sample_seed={sample_seed!r:.40}: expected an int in [0, 2**64), for a loader with seed_per_sample=True")
        self._sample_seed = sample_seed

    @property
    def epoch(self) -> int:
        """The loader's epoch, from 0: the one under way (from ``iter()`` to its
        ``StopIteration``), else the one the next ``iter()`` yields, a loaded checkpoint's
        included; ``for epoch in range(loader.epoch, epochs)`` resumes right (docs/api.md)."""
        return self._pending.epoch if self._pending is not None else current_epoch(self._published.progress)

    def batches_remaining(self) -> int | None:
        """How many batches the epoch in progress still yields: ``len(loader)`` minus
        those already yielded (or skipped). After :meth:`load_state_dict`, what the next
        ``iter()`` yields (a checkpoint taken after an epoch ended: the whole next epoch);
        before the first epoch or after one ended, ``len(loader)``. An epoch resumed with
        another batch size or dataset length, or a Mixture's on another world size,
        counts its own batches. None when the
        epoch's length is not known: an iterable dataset, or a sampler without
        ``len()``. For a progress bar or an LR schedule after a restore, where
        ``len(loader)`` is still the whole epoch."""
        part: EpochStart | EpochProgress | None = self._pending
        done = 0 if self._pending is None else self._pending.yielded + self._pending.skip
        if part is None and (progress := self._published.progress) is not None and not progress.ended:
            part, done = progress, progress.yielded
        total = self._epoch_length(part)
        return None if total is None else max(0, total - done)

    def _epoch_length(self, part: EpochStart | EpochProgress | None = None) -> int | None:
        """Batches in an epoch, or in the epoch part ``part`` describes (resumed with
        another batch size or dataset length), when known: map-style, a sized sampler."""
        if self._iterable:
            return None
        offset, length = (0, None) if part is None else (part.record.item_offset, part.record.epoch_length)
        return part_batches(self._index_sampler, offset, length)

    def captured_rngs(self) -> list[tuple[str, str]]:
        """The generator objects whose states checkpoints carry, as (path, kind) pairs,
        such as ``("dataset.transform.transforms[0].random_generator", "numpy PCG64")``.

        Once a batch has been produced, this is what the workers found (including
        generators made by ``worker_init_fn`` and ``rng_objects``). Before that, it is
        what a search of this process's dataset, ``collate_fn`` and ``worker_init_fn``
        finds, without running them; iterators' generators show up only from workers;
        then those the sampler and batch sampler hold (``sampler.``, ``batch_sampler.``)."""
        roots = [("dataset", self.dataset), ("collate_fn", self.collate_fn), ("worker_init_fn", self.worker_init_fn)]
        held = [] if self._iterable else self._sampler_objects().kinds()
        return (self._rng_census.captured() or described(discover(roots, self._snaploader_options.exclude_rngs)[0])) + held

    def _sampler_objects(self) -> ObjectRngs:
        """The generators the sampler and batch sampler hold (_epoch/sampler_rngs.py)."""
        return sampler_rngs.find(self._index_sampler, self._auto_collation, (self.dataset, self.generator), self._snaploader_options.exclude_rngs)

    # -- checkpoints -------------------------------------------------------------------

    def _fingerprint(self) -> Fingerprint:
        return fingerprint_of(
            dataset=self.dataset,
            iterable=self._iterable,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            drop_last=self.drop_last,
            sampler=self.sampler,
            batch_sampler=self.batch_sampler,
            persistent_workers=self.persistent_workers,
            generator=self.generator,
            seed_per_sample=self._snaploader_options.seed_per_sample,
        )

    def _facts(self) -> LoaderFacts:
        return LoaderFacts(
            iterable=self._iterable,
            logical_workers=self._snaploader_options.logical_workers,
            dataset_has_protocol=self._snaploader_options.state_protocol and has_state_protocol(self.dataset),
            state_protocol=self._snaploader_options.state_protocol,
            batches_per_epoch=self._epoch_length(),
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: plain data, O(num_workers) in size, taken without
        talking to a worker. Load it with :meth:`load_state_dict` into a loader built
        with the same arguments, in this process or another."""
        source = RngSource(self.generator)
        seen = self._published.read(source.next_epoch_state)
        return build_state(self._fingerprint(), seen, source, self._snaploader_options.logical_workers)

    def consumed(self) -> dict[str, Any]:
        """What the current epoch has consumed, rebuilt from :meth:`state_dict`'s position
        (nothing is recorded sample by sample): ``epoch``, ``ended``, ``batches`` (yielded
        or skipped), ``skipped``, ``indices`` (the dataset indices of those batches, or None
        with the reason in ``indices_unknown``) and ``sources`` (a Mixture's per-source
        ledger, None otherwise). ``snaploader inspect CKPT --consumed`` prints the same from
        a checkpoint file. See docs/mixtures.md, "What was consumed"."""
        checkpoint = parse(self.state_dict())
        stateful = None if self._iterable else stateful_part(self._index_sampler)
        unknown = None if self._iterable else unrebuilt(self._index_sampler, self.generator)
        return consumed_of(checkpoint, getattr(stateful, "_snaploader_consumed", None), unknown)

    # NOTE [ a load before the first next() ]
    # load_state_dict makes every iterator of the loader that was already advanced raise
    # at its next next(): it would yield a stream state_dict() no longer describes. An
    # iterator that no next() was called on instead starts the loaded epoch at once, as
    # iter() after the load would (_begin). torchdata loads an iterable dataset's state
    # before iter(dataset) and its iterator's after it, and a dataset that is its own
    # iterator (__iter__ returns self) has only the latter; one that reads a nested loader
    # makes that loader's iterator in __iter__ and hands its state to the loader
    # afterwards, so this is what lets it resume in torchdata's order.
    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        allow_mismatch: Iterable[str] = (),
        skip: int = 0,
        skip_to: int | None = None,
    ) -> None:
        """Make the next ``iter(loader)`` continue where ``state`` was taken.

        ``skip=N`` passes over the next N batches, ``skip_to=k`` over those before batch
        k of the epoch (a loss-spike rollback): a map-style dataset reads none of them,
        an iterable's workers read and discard them; ``state_dict()`` records the skip.
        See docs/api.md, "Skipping batches". ``ValueError`` for a skip that goes
        backwards or past the end of an epoch of known length.

        Raises :class:`~snaploader.CheckpointFormatError` for a malformed ``state`` and
        :class:`~snaploader.CheckpointMismatchError` when it was taken from a loader
        built differently, unless the differing names are in ``allow_mismatch``; and
        :class:`~snaploader.ReplayRefusedError` when the loader was built with
        ``replay="refuse"`` and resuming needs a replay from the epoch start.
        """
        allowed = frozenset(allow_mismatch)
        target = Target(
            facts=self._facts(),
            fingerprint=self._fingerprint(),
            persistent=self.persistent_workers,
            dataset=self.dataset,
            index_sampler=None if self._iterable else self._index_sampler,
            source=RngSource(self.generator),
            replay=self._snaploader_options.replay,
            lossy=self._lossy_protocol,
            datapipe=is_iter_datapipe(self.dataset),
            sampler_objects=None if self._iterable or {"sampler", "batch_sampler"} & allowed else self._sampler_objects(),
        )
        plan = plan_restore(state, target, allowed, skip, skip_to)
        # An iterator that went on would yield the old stream while state_dict() reports
        # the loaded one: it raises instead (NOTE [ a load before the first next() ] above).
        untouched = next((it for it in self._iterators if not it.taken and not it.closed), None)
        for iterator in list(self._iterators):
            if iterator is not untouched:
                iterator.invalidate()
        self._iterators.clear()
        self._persistent_iter = None
        if target.sampler_objects is not None:
            target.sampler_objects.write(plan.sampler_rngs)
        if plan.sampler_state is not None:
            stateful = None if self._iterable else stateful_part(self._index_sampler)
            if stateful is not None:
                stateful.load_state_dict(plan.sampler_state["state"])
        # The dataset's own state is loaded when the next epoch starts (_epoch/iterator.py),
        # not here under the training loop's RNGs, where an abandoned iterator could move it.
        self._pending = plan.start
        self._published.load(plan.published)
        if plan.generator_state is not None and self.generator is not None:
            self.generator.set_state(plan.generator_state)
        if untouched is not None:
            self._begin(untouched)
