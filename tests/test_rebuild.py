"""snaploader/_rebuild.py: a loader rebuilt from another carries every argument of torch's
DataLoader and every snaploader option (Accelerate's sharded copy, verify's rebuild)."""

from __future__ import annotations

import inspect
import multiprocessing
from dataclasses import fields
from typing import Any

import pytest
import torch
import torch.utils.data as torch_data

import snaploader
from snaploader._rebuild import TORCH_ARGUMENTS, rebuilt
from snaploader._options import Options

# More workers than this machine's cores is not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def _parameters(init: Any) -> list[str]:
    return [name for name in inspect.signature(init).parameters if name not in ("self", "dataset")]


def test_the_table_is_torch_arguments_and_the_options() -> None:
    # An argument added to torch's DataLoader or to snaploader's (an option) and not to
    # the table would reset to its default in every rebuilt loader.
    assert list(TORCH_ARGUMENTS) == _parameters(torch_data.DataLoader.__init__)
    own = [name for name in _parameters(snaploader.DataLoader.__init__) if name not in TORCH_ARGUMENTS]
    assert sorted(own) == sorted([field.name for field in fields(Options)] + ["snapshot_every_n_steps"])


def _init(worker: int) -> None:
    return None


def _collate(batch: list[Any]) -> list[Any]:
    return batch


def _rngs() -> dict[str, Any]:
    return {}


def _every_argument_set() -> tuple[snaploader.DataLoader, dict[str, Any]]:
    """A loader with every torch argument and every option away from its default."""
    generator = torch.Generator().manual_seed(3)
    given: dict[str, Any] = {
        "batch_size": 3, "sampler": torch_data.SubsetRandomSampler(range(10), generator=generator),
        "num_workers": 2, "collate_fn": _collate, "pin_memory": True, "drop_last": True, "timeout": 7.0,
        "worker_init_fn": _init, "multiprocessing_context": multiprocessing.get_context("spawn"),
        "generator": generator, "prefetch_factor": 3, "persistent_workers": True,
        "pin_memory_device": "cpu", "in_order": False,
        "snapshot_every": 2, "replay": "refuse", "max_worker_retries": 1, "check_resume": False,
        "rng_objects": _rngs, "exclude_rngs": ("numpy",), "state_protocol": False,
        "logical_workers": 4, "seed_per_sample": True,
    }
    loader = snaploader.DataLoader(list(range(10)), **given)
    return loader, given


def _read(loader: snaploader.DataLoader, name: str) -> Any:
    if name in TORCH_ARGUMENTS:
        return getattr(loader, name)
    return getattr(loader._snaploader_options, name)


def test_a_rebuilt_loader_has_every_argument() -> None:
    loader, given = _every_argument_set()
    assert set(given) == set(TORCH_ARGUMENTS) - {"shuffle", "batch_sampler"} | {f.name for f in fields(Options)}
    again = rebuilt(loader)
    for name, value in given.items():
        assert _read(again, name) == value, name
    assert again.dataset is loader.dataset


def test_changes_replace_only_what_they_name() -> None:
    loader, given = _every_argument_set()
    again = rebuilt(loader, list(range(20)), num_workers=3, timeout=1.0)
    assert (again.num_workers, again.timeout, len(again.dataset)) == (3, 1.0, 20)
    assert again._snaploader_options.logical_workers == 4 and again.prefetch_factor == 3
    # A batch sampler replaces what torch refuses beside one.
    batches = torch_data.BatchSampler(torch_data.SequentialSampler(range(10)), 2, False)
    sharded = rebuilt(loader, batch_sampler=batches)
    assert sharded.batch_sampler is batches and sharded.batch_size is None and not sharded.drop_last
    assert sharded.in_order is False and sharded._snaploader_options.seed_per_sample
    # No workers: the arguments only workers take fall back to their defaults.
    alone = rebuilt(loader, num_workers=0)
    assert (alone.prefetch_factor, alone.persistent_workers, alone.multiprocessing_context) == (None, False, None)


def test_logical_workers_by_default_follow_the_new_count() -> None:
    loader = snaploader.DataLoader(list(range(10)), batch_size=2, num_workers=2)
    assert rebuilt(loader, num_workers=3)._snaploader_options.logical_workers == 3


def test_a_shuffled_torch_loader_is_rebuilt_shuffled_with_its_generator() -> None:
    generator = torch.Generator().manual_seed(1)
    loader = torch_data.DataLoader(list(range(10)), batch_size=2, shuffle=True, generator=generator)
    again = rebuilt(loader)
    assert isinstance(again.sampler, torch_data.RandomSampler) and again.sampler.generator is generator


def test_an_unknown_change_is_refused() -> None:
    loader = snaploader.DataLoader(list(range(4)))
    with pytest.raises(TypeError, match=r"does not take: \['batchsize'\]"):
        rebuilt(loader, batchsize=2)
