"""snaploader's own options live in one record (``Options``): the loader checks them once,
and ``snaploader verify``'s rebuilt loader and every worker see each of them as given."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

import snaploader
from snaploader._options import Options
from snaploader._tools import verify_loader
from snaploader._workers.logical_worker import WorkerRuntime

# Every option at a value other than its default. Adding a field to Options without
# adding it here fails test_every_option_is_set_to_a_non_default_value.
NON_DEFAULT: dict[str, Any] = {
    "snapshot_every": 3,
    "replay": "refuse",
    "max_worker_retries": 5,
    "check_resume": False,
    "rng_objects": None,  # set below: a module-level function, so that workers can import it
    "exclude_rngs": ("dataset.unused_rng",),
    "state_protocol": False,
    "logical_workers": 4,
    "seed_per_sample": True,
}


def extra_generators() -> Any:
    return []


NON_DEFAULT["rng_objects"] = extra_generators


def _comparable(arguments: dict[str, Any]) -> dict[str, Any]:
    """Options as values that mean the same in another process (functions by name)."""
    return {
        name: f"{value.__module__}.{value.__qualname__}" if callable(value) else value
        for name, value in arguments.items()
    }


class WhatTheWorkerSees(torch.utils.data.Dataset[dict[str, Any]]):
    """Each sample is the options of the worker that fetched it, found up the stack."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, Any]:
        frame = sys._getframe(1)
        while frame is not None and not isinstance(frame.f_locals.get("self"), WorkerRuntime):
            frame = frame.f_back  # type: ignore[assignment]
        assert frame is not None, "no worker runtime up the stack"
        runtime: WorkerRuntime = frame.f_locals["self"]
        seen = _comparable(runtime.setup.options.arguments())
        return {"options": seen, "logical": runtime.setup.logical}


def _listed(batch: list[Any]) -> list[Any]:
    return batch


def _loader(**torch_arguments: Any) -> snaploader.DataLoader[Any]:
    return snaploader.DataLoader(WhatTheWorkerSees(), batch_size=2, collate_fn=_listed, **torch_arguments,
                                 **NON_DEFAULT)


def test_every_option_is_set_to_a_non_default_value() -> None:
    defaults = Options()
    assert set(NON_DEFAULT) == {field.name for field in fields(Options)}
    for name, value in NON_DEFAULT.items():
        assert value != getattr(defaults, name), name


def test_the_loader_keeps_every_option_in_one_record() -> None:
    loader = _loader(num_workers=2)
    assert loader._snaploader_options.arguments() == NON_DEFAULT
    for name, value in NON_DEFAULT.items():
        assert getattr(loader, name) == value, name  # the documented attributes


def test_verify_rebuilds_the_loader_with_every_option(tmp_path: Path) -> None:
    loader = _loader(num_workers=2)
    rebuilt = verify_loader.rebuild(loader, loader.dataset, loader.collate_fn)
    assert rebuilt._snaploader_options == loader._snaploader_options
    # And through the target verify is given, as `snaploader verify` imports it.
    target = tmp_path / "pipeline_with_options.py"
    target.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
        from tests.test_options import _loader

        def make():
            return _loader(num_workers=2)
    """))
    built = verify_loader.build(f"{target}:make")
    assert built.loader._snaploader_options == loader._snaploader_options


def test_a_torch_loader_is_verified_with_the_default_options() -> None:
    theirs = torch.utils.data.DataLoader(WhatTheWorkerSees(), batch_size=2, num_workers=2)
    rebuilt = verify_loader.rebuild(theirs, theirs.dataset, theirs.collate_fn)
    assert rebuilt._snaploader_options == Options(logical_workers=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_worker_sees_every_option(num_workers: int) -> None:
    loader = _loader(num_workers=num_workers)
    samples = [sample for batch in loader for sample in batch]
    assert len(samples) == 8
    expected = _comparable(NON_DEFAULT)
    for sample in samples:
        assert sample["options"] == expected
        assert sample["logical"] == 4  # the stream's worker count, whatever hosts it
