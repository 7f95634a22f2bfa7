"""A loader rebuilt from another with changes: every argument of torch's DataLoader and
every snaploader option carried over, so that none is lost on the way (Accelerate's
sharded copy, verify's loader in another topology)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch.utils.data as torch_data

from ._loader import DataLoader
from ._options import Options

# torch's DataLoader arguments (torch/utils/data/dataloader.py, DataLoader.__init__)
# after the dataset; tests/test_rebuild.py checks this against torch's signature.
TORCH_ARGUMENTS = (
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)
# The arguments that only a loader with workers takes (torch refuses them with none).
_WORKER_ONLY = {"multiprocessing_context": None, "prefetch_factor": None, "persistent_workers": False}
# The arguments that a batch sampler replaces (torch refuses them beside one).
_BATCH_SAMPLER_EXCLUDES = {"batch_size": 1, "shuffle": None, "sampler": None, "drop_last": False}


def _shuffle_and_sampler(loader: torch_data.DataLoader[Any]) -> tuple[bool | None, Any]:
    """(shuffle, sampler) arguments that rebuild ``loader``'s sampler."""
    sampler = loader.sampler
    if isinstance(loader.dataset, torch_data.IterableDataset):
        return None, None
    if type(sampler) is torch_data.RandomSampler and not sampler.replacement and (
        sampler._num_samples is None and sampler.generator is loader.generator
    ):
        return True, None
    if type(sampler) is torch_data.SequentialSampler:
        return None, None
    return None, sampler


def torch_arguments(loader: torch_data.DataLoader[Any]) -> dict[str, Any]:
    """Every argument of torch's DataLoader (``TORCH_ARGUMENTS``) that gives ``loader``
    back: its batch sampler where it has its own (``batch_size=None``), else its sampler
    (``shuffle=True`` for the one ``shuffle=True`` builds), batch size and ``drop_last``."""
    arguments = {name: getattr(loader, name) for name in TORCH_ARGUMENTS if name not in ("shuffle", "sampler")}
    if loader.batch_size is None and loader.batch_sampler is not None:
        return {**arguments, **_BATCH_SAMPLER_EXCLUDES}
    arguments["shuffle"], arguments["sampler"] = _shuffle_and_sampler(loader)
    arguments["batch_sampler"] = None
    return arguments


def snaploader_options(loader: torch_data.DataLoader[Any]) -> dict[str, Any]:
    """snaploader's options of ``loader``, all of them (``loader._snaploader_options``);
    a torch loader has none (the defaults). ``logical_workers`` equal to the worker count
    is the default (None), which follows a rebuilt loader's own count."""
    if not isinstance(loader, DataLoader):
        return {}
    options = loader._snaploader_options.arguments()
    if options["logical_workers"] == loader.num_workers:
        options["logical_workers"] = None
    return options


def rebuilt(loader: torch_data.DataLoader[Any], dataset: Any = None, **changes: Any) -> DataLoader:
    """A snaploader DataLoader with ``loader``'s arguments and options (its dataset unless
    ``dataset`` is given), ``changes`` (any of them, by name) in their place. A batch
    sampler among the changes replaces the batch size, sampler, shuffle and drop_last;
    no workers drop the arguments only workers take."""
    unknown = sorted(set(changes) - set(TORCH_ARGUMENTS) - {field.name for field in fields(Options)})
    if unknown:
        raise TypeError(f"rebuilt() got arguments that the DataLoader does not take: {unknown}")
    arguments = {**torch_arguments(loader), **snaploader_options(loader)}
    if changes.get("batch_sampler") is not None:
        arguments.update(_BATCH_SAMPLER_EXCLUDES)
    arguments.update(changes)
    if arguments["num_workers"] == 0:
        arguments.update(_WORKER_ONLY)
    return DataLoader(loader.dataset if dataset is None else dataset, **arguments)


__all__ = ["TORCH_ARGUMENTS", "rebuilt", "snaploader_options", "torch_arguments"]
