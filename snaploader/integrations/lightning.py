"""Lightning: :class:`ExactResume`, the callback that makes a Lightning checkpoint hold
the loader state of the batches the training step consumed (docs/lightning.md).

Lightning saves the state of every training loader that has ``state_dict()`` in its
checkpoints (``loops.fit_loop.state_dict.combined_loader``) and loads it back on
``fit(ckpt_path=...)``, so a snaploader loader resumes with no glue when Lightning reads
batches one at a time. When the loader has no length (an ``IterableDataset`` without
``__len__``), Lightning's ``_PrefetchDataFetcher`` reads one batch ahead, to know which
batch is the last: a checkpoint taken after step k then holds the state after batch
k+1, and the resumed run never sees batch k+1. Lightning offers no hook that says how
far its fetcher has read; but it reads exactly one batch ahead whenever the loader has
no length and its epoch has not ended (once the loader said the epoch ended, the step
has consumed everything). So when a checkpoint is written, the callback replaces such a
loader's state by its state one batch back (the ledger keeps it,
``snaploader._lookback``).

The other way round, Lightning ends an epoch after ``num_training_batches`` (the
loader's length, or ``limit_train_batches``) without asking the loader for one more
batch, and resumes a checkpoint taken at that last step with the next epoch; the
loader, which has not seen its epoch end, would give that epoch's (empty) rest first.
The callback saves such a state as ended.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import CombinedLoader

from .._loader import DataLoader
from .._lookback import state_dict_as_of, state_dict_ending_epoch, yielded_in_epoch


class ExactResume(Callback):
    """Make the loader state in Lightning's checkpoints match the batches the training
    step consumed, also when Lightning reads a batch ahead (a loader without length).

    Add it to the Trainer's callbacks, in the run that saves and in the run that
    resumes: ``Trainer(..., callbacks=[ExactResume(), ModelCheckpoint(...)])``.
    It supports one training loader (a snaploader DataLoader, possibly inside a
    one-element list or dict); with several, Lightning's combined batches come from
    loaders that cycle and end at different times, and it leaves their states as the
    loaders give them (a warning says so when one of them has no length).
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaders = self._loaders(trainer)
        if len(loaders) > 1 and any(isinstance(l, DataLoader) and _no_length(l) for l in loaders):
            warnings.warn(
                "snaploader's ExactResume callback corrects Lightning's one-batch look-ahead "
                f"for one training loader, and this Trainer has {len(loaders)}: their states "
                "are saved as the loaders give them, so a resume may skip the batch Lightning "
                "had read ahead. Combine the datasets into one loader to resume exactly",
                UserWarning,
                stacklevel=2,
            )

    @staticmethod
    def _loaders(trainer: pl.Trainer) -> list[Any]:
        iterables = trainer.train_dataloader
        if iterables is None:
            return []
        return list(CombinedLoader(iterables).flattened)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        loaders = self._loaders(trainer)
        if len(loaders) != 1 or not isinstance(loaders[0], DataLoader):
            return
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        states = fit_state.get("combined_loader")
        if not states:
            return
        loader = loaders[0]
        yielded = yielded_in_epoch(loader)
        ended = loader._published.progress is None or loader._published.progress.ended
        consumed = yielded - 1 if _no_length(loader) and not ended and yielded > 0 else yielded
        # One stateful loader, so Lightning stored one state: the loader's own.
        if consumed >= trainer.num_training_batches and not ended:
            # Lightning resumes this checkpoint with the next epoch (and would call
            # iter() on the loader without reading it to its end): so must the loader.
            states[0] = state_dict_ending_epoch(loader)
        elif consumed != yielded:
            states[0] = state_dict_as_of(loader, consumed)


def _no_length(loader: DataLoader) -> bool:
    try:
        len(loader)
    except TypeError:
        return True
    return False


__all__ = ["ExactResume"]
