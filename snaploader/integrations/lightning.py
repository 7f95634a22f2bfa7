"""Lightning: :class:`ExactResume`, the callback that makes a Trainer's checkpoints hold
the loader state of the batches the training step consumed, on every rank; and
:func:`fabric_state`, the same for Fabric's ``fabric.save``/``fabric.load``
(docs/lightning.md).

Lightning saves the state of every training loader that has ``state_dict()`` in its
checkpoints (``loops.fit_loop.state_dict.combined_loader``) and loads it back on
``fit(ckpt_path=...)``. Three things keep that from resuming exactly, which the
callback corrects when a checkpoint is written (``on_save_checkpoint``, which Lightning
calls on every rank) and read (``on_load_checkpoint``, before the loops are restored):

- **Ranks.** Under DDP only rank 0 writes the checkpoint, so every rank would be given
  rank 0's loader state. The callback gathers every rank's state to each rank when a
  checkpoint is written (``all_gather_object``: the checkpoint is written by all ranks
  together) and stores them under ``checkpoint["snaploader"]``, keyed by world size and
  rank; on resume each rank puts its own in place of rank 0's. Another world size is
  refused, naming ``snaploader.distributed.reshard``: Lightning gives each rank one
  loader, and a rank resuming several old ranks (or a re-partitioned epoch) needs a
  loader of its own making.
- **Read-ahead.** When the loader has no length (an ``IterableDataset`` without
  ``__len__``), Lightning's ``_PrefetchDataFetcher`` reads one batch ahead, to know which
  batch is the last: a checkpoint after step k would hold the state after batch k+1.
  It reads exactly one batch ahead whenever the loader has no length and its epoch is
  live, so the callback saves the state one batch back (``LoaderView.state_as_of``).
- **A checkpoint taken inside a step.** Lightning's SLURM auto-requeue writes its
  checkpoint from the SIGUSR1 handler, at any moment (so can ``OnExceptionCheckpoint``
  after an error in the step): between ``next()`` and the end of the step the loader
  has yielded the batch of a step that Lightning runs again on resume. The callback
  saves the state as of the batches Lightning counts as done (its ``batch_progress``,
  read as its restart logic reads it), one batch back; two back for a loader without
  length, from the view it kept at the end of the previous step.
- **The last step of an epoch.** Lightning ends an epoch after ``num_training_batches``
  without asking the loader for one more batch, and resumes a checkpoint of that step
  with the next epoch; the loader, which has not seen its epoch end, would give that
  epoch's (empty) rest first. The callback saves such a state as ended.
- **A checkpoint at an epoch's end.** Lightning does not load the loader's state when
  the checkpoint was written after an epoch's last step (``ModelCheckpoint``'s default
  moment, and ``save_last``): its fit loop is then not "restarting", and a fresh loader
  would start over with epoch 0's order. The callback loads it at ``on_train_start``
  and starts the fit loop's iterator again from it (Lightning made it in ``setup_data``,
  before any hook sees the loader).

Without the callback, a map-style loader under DDP is given rank 0's state on every
rank; the loader of each other rank raises the ``CheckpointMismatchError`` any code gets
for another rank's state, which names this callback (``_format/fingerprint.py``): the
core never looks at its caller, and a rank never resumes another's state unasked.
"""

from __future__ import annotations

import warnings
from typing import Any, Final

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader

from .._errors import CheckpointFormatError, CheckpointMismatchError
from .._loader import DataLoader
from .._view import LoaderView

# Where the callback and fabric_state keep every rank's state in a checkpoint.
_KEY: Final = "snaploader"
_RESHARD_HINT: Final = (
    "To change the world size, resume the interrupted epoch with "
    "snaploader.distributed.reshard(states, make_loader, rank=..., world_size=...) in a "
    "loop of your own, with states = the checkpoint's ['{key}']['states'] (docs/elastic.md)"
)


class ExactResume(Callback):
    """Make the loader state in Lightning's checkpoints that of the batches the training
    step consumed, on every rank: each rank's own under DDP, one batch back when
    Lightning reads ahead (a loader without length), ended at an epoch's last step.

    Add it to the Trainer's callbacks, in the run that saves and in the run that
    resumes: ``Trainer(..., callbacks=[ExactResume(), ModelCheckpoint(...)])``.
    It supports one training loader (a snaploader DataLoader, possibly inside a
    one-element list or dict); with several, Lightning's combined batches come from
    loaders that cycle and end at different times, and it leaves their states as the
    loaders give them (a warning says so when one of them has no length).
    """

    def __init__(self) -> None:
        self._step_end_view: LoaderView | None = None  # the loader at the last step's end
        self._unloaded: dict[str, Any] | None = None  # a state Lightning may not load

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = self._loaders(trainer)
        state, self._unloaded = self._unloaded, None
        if state is not None and not trainer.fit_loop.restarting and len(loaders) == 1 and isinstance(loaders[0], DataLoader):
            # A checkpoint of an epoch's end: Lightning left the state unloaded (its
            # _load_combined_loader_states runs only when restarting) and has already
            # made its iterator from the fresh loader. Lightning sets the sampler's epoch
            # only after this hook; the loaded epoch's start needs it now.
            _set_sampler_epoch(loaders[0], trainer.current_epoch)
            loaders[0].load_state_dict(state)
            # An iterator not yet next()ed starts the loaded epoch at the load
            # (NOTE [ a load before the first next() ] in _loader.py); one that was is
            # invalidated, and Lightning's fetcher must make another.
            if not LoaderView.of(loaders[0]).live and trainer.fit_loop._data_fetcher is not None:
                iter(trainer.fit_loop._data_fetcher)
        if len(loaders) > 1 and any(isinstance(l, DataLoader) and _no_length(l) for l in loaders):
            warnings.warn(
                "snaploader's ExactResume callback corrects Lightning's one-batch look-ahead "
                f"for one training loader, and this Trainer has {len(loaders)}: their states "
                "are saved as the loaders give them, so a resume may skip the batch Lightning "
                "had read ahead. Combine the datasets into one loader to resume exactly",
                UserWarning,
                stacklevel=2,
            )

        if len(loaders) == 1 and isinstance(loaders[0], DataLoader) and not _no_length(loaders[0]):
            if trainer.num_training_batches < len(loaders[0]):
                warnings.warn(
                    f"Lightning ends each epoch after {trainer.num_training_batches} of the "
                    f"loader's {len(loaders[0])} batches (limit_train_batches), and a snaploader "
                    "checkpoint of a map-style epoch cannot hold an epoch ended early: a resume "
                    "from an epoch's last step goes on with that epoch's rest, not exactly as "
                    "the uninterrupted run (docs/lightning.md, Limits)",
                    UserWarning,
                    stacklevel=2,
                )

    @staticmethod
    def _loaders(trainer: pl.Trainer) -> list[Any]:
        iterables = trainer.train_dataloader
        if iterables is None:
            return []
        return list(CombinedLoader(iterables).flattened)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        loaders = self._loaders(trainer)
        if len(loaders) == 1 and isinstance(loaders[0], DataLoader):
            self._step_end_view = LoaderView.of(loaders[0])  # one read of a published record

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # A view holds the loader's live epoch, which does not pickle (ddp_spawn pickles
        # the callbacks at the next fit).
        self._step_end_view = None

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        states = _loader_states(checkpoint)
        loaders = self._loaders(trainer)
        if not states or len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
            return
        # One stateful loader, so Lightning stored one state: the loader's own.
        views = [LoaderView.of(loaders[0]), self._step_end_view]
        states[0] = _consumed_state(views, _steps_done(trainer), trainer.num_training_batches)
        checkpoint[_KEY] = _every_rank(states[0])

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        states = _loader_states(checkpoint)
        saved = checkpoint.get(_KEY)
        if states and saved is not None:
            # Lightning loads ``states`` into the loader after this hook (restore_loops).
            states[0] = _this_rank(saved, "the Lightning checkpoint")
        self._unloaded = states[0] if states and len(states) == 1 else None


def _steps_done(trainer: pl.Trainer) -> int:
    """The batches of the epoch that Lightning does not run again when it resumes a
    checkpoint written now: its restart logic (``TrainingEpochLoop.reset``) goes on
    after ``completed``, or after ``processed`` when the checkpoint was written at the
    end of a step (``on_train_batch_end``: every count but ``completed`` one ahead)."""
    current: Any = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker
    at_step_end = current.ready == current.started == current.processed == current.completed + 1
    return current.processed if at_step_end else current.completed


def _consumed_state(views: list[LoaderView | None], consumed: int, batches_per_epoch: int | float) -> dict[str, Any]:
    """The loader's state as of the ``consumed`` batches of its epoch that the training
    step has done: ``views[0]`` is the loader now, ``views[1]`` at the last step's end."""
    view = views[0]
    assert view is not None
    if consumed >= batches_per_epoch and view.live:
        # Lightning resumes this checkpoint with the next epoch (and would call iter()
        # on the loader without reading it to its end): so must the loader.
        if _no_length(view.loader) or len(view.loader) == consumed:
            return view.state_ending_epoch()
        # limit_train_batches below a map-style loader's length: its format has no
        # epoch ended early, and on_train_start has warned that the resume is not exact.
    if not view.live:
        return view.state_dict()  # an epoch ended (or none begun): nothing is ahead
    for candidate in views:
        if candidate is not None and candidate.epoch == view.epoch and consumed in (candidate.yielded, candidate.yielded - 1):
            return candidate.state_as_of(consumed)
    warnings.warn(
        f"snaploader's ExactResume: the checkpoint was written when Lightning had run "
        f"{consumed} batches of epoch {view.epoch} and the loader had yielded {view.yielded}, "
        "further apart than the states the loader keeps; the loader's state is saved as it "
        "is, and a resume from this checkpoint skips the batches in between",
        UserWarning,
        stacklevel=2,
    )
    return view.state_dict()


def _loader_states(checkpoint: dict[str, Any]) -> list[dict[str, Any]] | None:
    fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
    return fit_state.get("combined_loader") or None


def _no_length(loader: DataLoader[Any]) -> bool:
    try:
        len(loader)
    except TypeError:
        return True
    return False


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _every_rank(state: Any) -> dict[str, Any]:
    """``{"world_size": N, "states": [rank 0's state, ...]}``: ``state`` of every rank,
    gathered to each (a collective call under ``torch.distributed``: every rank makes
    it at the same point, as Lightning and Fabric write checkpoints)."""
    rank, world = _rank_and_world()
    states: list[Any] = [state]
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, state)
    return {"world_size": world, "states": states}


def _this_rank(saved: Any, where: str) -> Any:
    """This rank's entry of what :func:`_every_rank` gathered; a clear error when the
    world size differs or the entry is not what it wrote."""
    rank, world = _rank_and_world()
    if not isinstance(saved, dict) or not isinstance(saved.get("states"), list) or saved.get("world_size") != len(saved["states"]):
        raise CheckpointFormatError(
            f"{where} has a '{_KEY}' entry that snaploader did not write (expected "
            "{'world_size': N, 'states': [N states]}); it was modified after it was saved"
        )
    if saved["world_size"] != world:
        raise CheckpointMismatchError(
            f"{where} holds the loader states of {saved['world_size']} rank(s), and this run has "
            f"{world}: each rank resumes its own rank's state, so resume with "
            f"{saved['world_size']} rank(s). " + _RESHARD_HINT.format(key=_KEY)
        )
    return saved["states"][rank]


class FabricState:
    """A loader's state for ``fabric.save``/``fabric.load``, every rank's (made by
    :func:`fabric_state`).

    Fabric writes a checkpoint from rank 0 only, so a loader put in the state dict
    directly would give rank 0's state to every rank. This object's ``state_dict()``
    gathers every rank's (``fabric.save`` is called on every rank), and
    ``load_state_dict()`` loads this rank's. It also carries the count of epochs the
    ``fabric.setup_dataloaders`` wrapper started, from which Fabric sets the
    DistributedSampler's epoch at each ``iter()``: a new wrapper would count from 0.
    """

    def __init__(self, loader: Any) -> None:
        self.wrapper = loader if hasattr(loader, "_num_iter_calls") and hasattr(loader, "_dataloader") else None
        self.loader = loader._dataloader if self.wrapper is not None else loader
        if not isinstance(self.loader, DataLoader):
            raise TypeError(
                "fabric_state() takes a snaploader.DataLoader, or what fabric.setup_dataloaders "
                f"returned for one; got {type(self.loader).__module__}.{type(self.loader).__qualname__}"
            )

    def state_dict(self) -> dict[str, Any]:
        view = LoaderView.of(self.loader)
        started = None
        if self.wrapper is not None:
            # A live epoch is continued by the next iter(), which counts it again.
            started = self.wrapper._num_iter_calls - (1 if view.live else 0)
        return _every_rank({"loader": view.state_dict(), "epochs_started": started})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        mine = _this_rank(state_dict, "the Fabric checkpoint")
        self.loader.load_state_dict(mine["loader"])
        if self.wrapper is not None and mine["epochs_started"] is not None:
            self.wrapper._num_iter_calls = mine["epochs_started"]


def fabric_state(loader: Any) -> FabricState:
    """``loader``'s state, every rank's, for Fabric's checkpoints: put it in the state
    dict given to ``fabric.save`` and ``fabric.load``, in place of the loader::

        state = {"model": model, "optimizer": optimizer, "loader": fabric_state(loader)}
        fabric.save(path, state)    # and, in the run that resumes, fabric.load(path, state)

    ``loader`` is what ``fabric.setup_dataloaders`` returned (or the snaploader loader
    itself). Resume with the world size the checkpoint was saved with."""
    return FabricState(loader)


__all__ = ["ExactResume", "FabricState", "fabric_state"]
