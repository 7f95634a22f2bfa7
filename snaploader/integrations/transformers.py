"""The Hugging Face Trainer: :class:`SnapTrainer`, a ``transformers.Trainer`` whose
training loader is a snaploader ``DataLoader`` and whose checkpoints hold each
process's loader state, so that ``train(resume_from_checkpoint=...)`` resumes the batch
stream exactly (docs/transformers.md). A script changes two lines: the import, and
``Trainer(`` → ``SnapTrainer(``.

How it fits the Trainer (transformers 5.x):

- **The loader.** ``get_train_dataloader`` builds a snaploader loader with the arguments
  the Trainer's own ``_get_dataloader`` uses (its sampler, collator with unused columns
  removed, the ``dataloader_*`` arguments, ``seed_worker``), with one generator seeded
  by ``data_seed`` (or ``seed``) for the shuffling, since the resume needs a generator
  whose state it can carry; then :func:`snaploader.integrations.accelerate.prepare`
  shards it as ``accelerator.prepare`` would (``BatchSamplerShard``) and moves batches
  to the device. The loader is built once per Trainer.
- **Checkpoints.** The Trainer writes ``checkpoint-<step>`` itself, not through
  ``accelerator.save_state``, so a callback's ``on_save`` (called on every process once
  the folder is written) adds this process's loader state to it, as
  ``snaploader_0_rank<r>_of_<n>.json``; ``train(resume_from_checkpoint=True or a path)``
  reads it back before the first batch. A checkpoint at an epoch's last step is saved
  as the end of that epoch (``LoaderView.state_ending_epoch``): the Trainer resumes it
  with the next epoch and never asks the loader for the (empty) rest.
- **``ignore_data_skip``.** On resume the Trainer skips the epoch's first batches by
  rebuilding the loader as torch's (``skip_first_batches``) unless ``ignore_data_skip``
  is set, which would throw the snaploader loader away and skip batches it had already
  resumed past. SnapTrainer sets it. With it set, the Trainer counts the resumed
  epoch's batches from 0, which changes nothing when gradient accumulation divides the
  epoch's batches (checkpoints fall on accumulation boundaries); otherwise the epoch's
  last, shorter accumulation would not be synchronised at the right batch, so a
  mid-epoch resume is refused with a ``ValueError`` naming the numbers.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset, RandomSampler
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import BatchRebalanceSampler, LengthGroupedSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker

from .._loader import DataLoader
from .._view import LoaderView
from .accelerate import PreparedLoader, prepare


class SnapTrainer(Trainer):
    """``transformers.Trainer`` with a snaploader training loader whose state every
    checkpoint holds, each process its own; takes the Trainer's arguments.

    ``train(resume_from_checkpoint=True)`` (the last checkpoint in ``output_dir``) or
    ``train(resume_from_checkpoint=path)`` resumes the batch stream bit for bit.
    ``args.ignore_data_skip`` is set to True (the loader resumes itself). Override
    :meth:`build_train_loader` to build the loader yourself (any snaploader
    ``DataLoader``; it is then sharded and checkpointed the same way).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The loader resumes itself; the Trainer's own skip would rebuild it as torch's.
        self.args.ignore_data_skip = True
        self._snap_loader: PreparedLoader | None = None
        self._snap_resume: str | None = None
        self.add_callback(_LoaderCheckpoints(self))

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            # As the Trainer resolves it, so that the loader reads the same folder;
            # none found: the Trainer raises its own error.
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        self._snap_resume = resume_from_checkpoint if isinstance(resume_from_checkpoint, (str, os.PathLike)) else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> PreparedLoader:  # type: ignore[override]
        if self._snap_loader is None:
            self._snap_loader = prepare(self.accelerator, self.build_train_loader())
        if self._snap_resume is not None:
            folder, self._snap_resume = self._snap_resume, None
            self._snap_loader.load_from(folder)
            _check_accumulation(self._snap_loader, self.args.gradient_accumulation_steps)
        return self._snap_loader

    def build_train_loader(self) -> DataLoader[Any]:
        """The snaploader loader for ``train_dataset``, built as the Trainer builds its
        own (before sharding across processes)."""
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        collator = self.data_collator
        if _is_hf_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="Training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="Training")
        args = self.args
        generator = torch.Generator().manual_seed(args.data_seed if args.data_seed is not None else args.seed)
        options: dict[str, Any] = {
            "batch_size": self._train_batch_size,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "in_order": args.dataloader_in_order,
            "generator": generator,
        }
        if not isinstance(dataset, IterableDataset):
            sampler = self._get_train_sampler(dataset)
            if isinstance(sampler, BatchRebalanceSampler):
                raise ValueError(
                    "train_sampling_strategy='batch_rebalance' builds a batch sampler that is "
                    "already split by process, which snaploader's SnapTrainer would split again; "
                    "use 'random', 'sequential' or 'group_by_length' with SnapTrainer"
                )
            if isinstance(sampler, (RandomSampler, LengthGroupedSampler)) and sampler.generator is None:
                sampler.generator = generator  # its order then resumes with the loader's state
            options.update(
                sampler=sampler,
                drop_last=args.dataloader_drop_last,
                worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
            )
        return DataLoader(dataset, **options)


class _LoaderCheckpoints(TrainerCallback):
    """Adds this process's loader state to each checkpoint folder the Trainer writes."""

    def __init__(self, trainer: SnapTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self.trainer._snap_loader
        if loader is None:
            return
        folder = Path(str(args.output_dir)) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        view = LoaderView.of(loader.loader)
        at_end = view.live and _length(loader) == view.yielded
        # The Trainer resumes a checkpoint of an epoch's last step with the next epoch.
        loader.save_to(folder, view.state_ending_epoch() if at_end else view.state_dict())


def _check_accumulation(loader: PreparedLoader, accumulation: int) -> None:
    view = LoaderView.of(loader.loader)
    batches = _length(loader)
    if accumulation > 1 and view.yielded > 0 and batches is not None and batches % accumulation:
        raise ValueError(
            f"the checkpoint was taken {view.yielded} batches into an epoch of {batches} batches, "
            f"with gradient_accumulation_steps={accumulation}, which does not divide {batches}: "
            "the Trainer would synchronise the epoch's last, shorter accumulation at the wrong "
            "batch after this resume. Make the batches per epoch (per process) a multiple of "
            "gradient_accumulation_steps (dataloader_drop_last, or the dataset's size), or "
            "resume from a checkpoint taken at an epoch's end"
        )


def _length(loader: PreparedLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _is_hf_dataset(dataset: Any) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


__all__ = ["SnapTrainer"]
