"""Accelerate: :func:`prepare`, which gives a snaploader loader Accelerate's sharding and
device placement and makes ``accelerator.save_state``/``load_state`` carry its exact
state, each process its own (docs/accelerate.md).

Why not ``accelerator.prepare(loader)``: Accelerate's ``prepare_data_loader`` rebuilds
every loader it is given as a ``DataLoaderShard``, whose ``DataLoaderAdapter`` base
constructs the inner loader itself, as torch's ``DataLoader`` (or torchdata's
``StatefulDataLoader`` under ``use_stateful_dataloader``), from the old one's
attributes: the snaploader loader is dropped, and no argument or configuration names
another class. And the state Accelerate does save for stateful loaders
(``dl_state_dict.bin``) and for ``register_for_checkpointing`` objects
(``custom_checkpoint_<i>.pkl``) is written through ``accelerate.utils.save``, by the
main process only: every process would resume from process 0's position and worker
RNG states.

So :func:`prepare` uses Accelerate's public pieces instead of its loader class:

- sharding: the loader's batch sampler inside Accelerate's own ``BatchSamplerShard``,
  with the accelerator's process count and index, ``split_batches`` and
  ``even_batches``: each process gets the batches ``accelerator.prepare`` would give
  it. Before that, the shuffling generator is broadcast from process 0
  (``accelerate.utils.synchronize_rng_state``), as ``DataLoaderShard`` does at each
  epoch: every process then draws the same global order and keeps drawing it, since
  each draws the same amount. With one process the loader is used as it is.
- device placement: ``accelerate.utils.send_to_device`` on each batch, as
  ``DataLoaderShard`` does, when the accelerator places on device.
- checkpoints: ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``,
  which Accelerate calls on every process with the checkpoint folder. Each process
  writes its loader's state to a file of its own in that folder,
  ``snaploader_<loader>_rank<r>_of_<world>.json``, as Accelerate writes
  ``random_states_<r>.pkl``; ``load_state`` reads it back before the first batch.

The prepared loader is not a torch ``DataLoader``, so ``accelerator.prepare`` hands it
back untouched if it is passed there with the model and optimizer. It yields batches
directly, without ``DataLoaderShard``'s one-batch look-ahead, so its state is always
that of the batches the training loop has been given.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard
from accelerate.utils import RNGType, send_to_device, synchronize_rng_state
from torch.utils.data import IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from .._format.envelopes import loader_state_as_json, loader_state_from_json
from .._errors import CheckpointFormatError
from .._loader import DataLoader
from .._rebuild import rebuilt
from .._view import LoaderView

# Per accelerator: the snaploader loaders prepared on it, in order (their index names
# their checkpoint files).
_prepared: weakref.WeakKeyDictionary[Accelerator, list[DataLoader]] = weakref.WeakKeyDictionary()


class PreparedLoader:
    """A snaploader loader as :func:`prepare` returns it: this process's shard, batches
    on the accelerator's device, its state in the accelerator's checkpoints.

    Iterate it as the loader; ``len()``, ``state_dict()`` and ``load_state_dict()`` are
    the sharded loader's (:attr:`loader`), and other attributes are read from it.
    :meth:`save_to` and :meth:`load_from` write and read this process's state file in
    a checkpoint folder, for frameworks that checkpoint without ``save_state`` (the
    Hugging Face Trainer, docs/accelerate.md).
    """

    def __init__(self, loader: DataLoader, device: torch.device | None, non_blocking: bool, place: _Place) -> None:
        self.loader = loader
        self.device = device
        self.non_blocking = non_blocking
        self.place = place

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.device is not None:
                batch = send_to_device(batch, self.device, non_blocking=self.non_blocking)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any], **options: Any) -> None:
        self.loader.load_state_dict(state, **options)

    def save_to(self, folder: str | os.PathLike[str], state: dict[str, Any] | None = None) -> Path:
        """Write this process's loader state (or ``state``, one the loader made, such as
        a ``LoaderView``'s) into the checkpoint ``folder``; its path."""
        path = self.place.file(folder)
        partial = path.with_suffix(".json.partial")
        partial.write_text(loader_state_as_json(self.loader.state_dict() if state is None else state))
        # A process killed while writing leaves the previous file (or none), never half of one.
        os.replace(partial, path)
        return path

    def load_from(self, folder: str | os.PathLike[str]) -> None:
        """Restore this process's loader state from the checkpoint ``folder``."""
        path = self.place.file(folder)
        try:
            text = path.read_text()
        except FileNotFoundError:
            found = sorted(p.name for p in Path(folder).glob("snaploader_*.json"))
            raise CheckpointFormatError(
                f"the checkpoint {folder} has no state for snaploader loader {self.place.index} on "
                f"process {self.place.process} of {self.place.processes} (no {path.name}; it "
                f"holds {found}): resume with the number of processes it was saved with, and "
                "prepare the same loaders, in the same order, with "
                "snaploader.integrations.accelerate.prepare in the run that saves"
            ) from None
        self.loader.load_state_dict(loader_state_from_json(text, str(path), "snaploader.integrations.accelerate"))

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


@dataclass(frozen=True)
class _Place:
    """Which state file is this loader's: its order among the loaders prepared on the
    accelerator, this process's index and the number of processes."""

    index: int
    process: int
    processes: int

    def file(self, folder: str | os.PathLike[str]) -> Path:
        return Path(folder) / f"snaploader_{self.index}_rank{self.process}_of_{self.processes}.json"


def prepare(accelerator: Accelerator, loader: DataLoader, *, device_placement: bool | None = None) -> PreparedLoader:
    """``loader`` ready for training under ``accelerator``: this process's batches (the
    ones ``accelerator.prepare`` would give it), placed on ``accelerator.device``, with
    the loader's state saved by ``accelerator.save_state`` and restored by
    ``accelerator.load_state``, each process its own.

    Call it in the run that saves and in the run that resumes, with a loader built
    with the same arguments, before ``load_state``. ``device_placement`` defaults to
    the accelerator's. Pass the model and optimizer to ``accelerator.prepare`` as usual.
    """
    loader = _checked(accelerator, loader)
    if accelerator.num_processes > 1:
        loader = _sharded(accelerator, loader)
    on_device = accelerator.device_placement if device_placement is None else device_placement
    loaders = _prepared.setdefault(accelerator, [])
    place = _Place(len(loaders), accelerator.process_index, accelerator.num_processes)
    prepared = PreparedLoader(loader, accelerator.device if on_device else None, bool(accelerator.non_blocking), place)
    # Accelerate calls these on every process, with the checkpoint folder.
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: prepared.save_to(output_dir))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: prepared.load_from(input_dir))
    loaders.append(loader)
    return prepared


def _checked(accelerator: Any, loader: Any) -> DataLoader:
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            "snaploader.integrations.accelerate.prepare(accelerator, loader) takes an "
            f"accelerate.Accelerator first, got {type(accelerator).__module__}.{type(accelerator).__qualname__}"
        )
    if not isinstance(loader, DataLoader):
        if hasattr(loader, "base_dataloader"):
            raise TypeError(
                "prepare() was given a loader that accelerator.prepare already rebuilt (as "
                "torch's DataLoader, which has no exact state): pass the snaploader "
                "DataLoader itself to snaploader.integrations.accelerate.prepare, not "
                "through accelerator.prepare"
            )
        raise TypeError(
            f"prepare() takes a snaploader.DataLoader, got {type(loader).__module__}."
            f"{type(loader).__qualname__}; build the loader with snaploader.DataLoader "
            "(same arguments as torch's)"
        )
    if any(loader is seen for seen in _prepared.get(accelerator, [])):
        raise ValueError(
            "this loader was already prepared on this accelerator; use the loader "
            "prepare() returned the first time (a second prepare would save its state twice)"
        )
    if accelerator.dispatch_batches:
        raise ValueError(
            "the accelerator is configured with dispatch_batches=True (process 0 reads every "
            "batch and sends slices to the others); snaploader's prepare() shards by batch "
            "on every process instead, so that each keeps its own exact state: leave "
            "DataLoaderConfiguration(dispatch_batches=...) unset or set it to False"
        )
    mesh = accelerator.torch_device_mesh
    if accelerator.num_processes > 1 and mesh is not None and mesh.mesh_dim_names is not None:
        if {"tp", "cp"} & set(mesh.mesh_dim_names):
            raise ValueError(
                "the accelerator has a device mesh with tensor or context parallel dimensions "
                f"({mesh.mesh_dim_names}), where several processes read the same batch; "
                "snaploader's prepare() gives each process its own batches, so it does not "
                "cover this set-up"
            )
    return loader


def _sharded(accelerator: Accelerator, loader: DataLoader) -> DataLoader:
    """A new loader, built with ``loader``'s arguments, that yields this process's
    batches of ``loader``'s stream, as Accelerate's ``BatchSamplerShard`` picks them."""
    world, rank = accelerator.num_processes, accelerator.process_index
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"the loader reads an IterableDataset, and there are {world} processes: "
            "snaploader's prepare() shards map-style datasets only (Accelerate would read "
            "an iterable on process 0 and dispatch it). Make each process's dataset yield "
            "its own part (by accelerator.process_index) and checkpoint the loader with "
            "snaploader.dcp_state(loader) (docs/dcp.md)"
        )
    if loader.batch_sampler is None:
        raise ValueError(
            "the loader has batch_size=None (no batching), and there are "
            f"{world} processes: Accelerate shards batches, so give the loader a "
            "batch_size or a batch_sampler"
        )
    sampler = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        raise ValueError(
            "the loader's sampler is a DistributedSampler, which already gives each process "
            "its part; prepare() would shard that part again. Build the loader as for one "
            "process (shuffle=True or your own sampler) and let prepare() shard it"
        )
    if LoaderView.of(loader).used:
        raise ValueError(
            "prepare() was given a loader that was already iterated or loaded from a state; "
            "with several processes it builds a new, sharded loader from the arguments, "
            "so prepare the loader first and restore it with accelerator.load_state"
        )
    generator = loader.generator
    if generator is None:
        # As Accelerate does for a sampler without one: every process must draw the
        # same order, so the draws come from a generator that can be broadcast.
        generator = torch.Generator()
        generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            sampler.generator = generator
    for shared in {id(g): g for g in (generator, getattr(sampler, "generator", None)) if g is not None}.values():
        synchronize_rng_state(RNGType.GENERATOR, generator=shared)
    shard = BatchSamplerShard(
        loader.batch_sampler,  # type: ignore[arg-type]
        num_processes=world,
        process_index=rank,
        split_batches=accelerator.split_batches,
        even_batches=accelerator.even_batches,
    )
    return rebuilt(loader, batch_sampler=shard, generator=generator)


__all__ = ["PreparedLoader", "prepare"]
