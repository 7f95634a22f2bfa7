"""Accelerate's own stateful-loader path (``DataLoaderConfiguration(use_stateful_dataloader=
True)``) with snaploader's loader in place of torchdata's ``StatefulDataLoader``: Accelerate
writes ``state["_iterator_finished"]`` into the loader's state after every batch
(``DataLoaderAdapter._update_state_dict``), and ``accelerator.load_state`` hands that state
back. A key snaploader does not own is not corruption (NOTE [ foreign keys ] in
_format/checkpoint.py). Real ``accelerate``; torchdata is not needed."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import snaploader

from ._datasets import Augmented
from ._support import assert_same_stream

pytest.importorskip("accelerate", reason="the Accelerate integration tests need accelerate (pip install 'snaploader[integrations]')")

import accelerate.data_loader  # noqa: E402
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402


@pytest.fixture
def stateful_accelerate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Accelerate's stateful path, building snaploader's DataLoader where it imports
    ``torchdata.stateful_dataloader.StatefulDataLoader`` (inside DataLoaderAdapter)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    package = types.ModuleType("torchdata")
    module = types.ModuleType("torchdata.stateful_dataloader")
    module.StatefulDataLoader = snaploader.DataLoader  # type: ignore[attr-defined]
    package.stateful_dataloader = module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchdata", package)
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", module)
    monkeypatch.setattr(accelerate.data_loader, "is_torchdata_stateful_dataloader_available", lambda: True)
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.11.0" if name == "torchdata" else version(name))
    yield
    # Accelerate keeps its state in process-wide singletons: leave none to other tests.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _prepared(workers: int) -> tuple[Accelerator, Any]:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = snaploader.DataLoader(
        Augmented(40), batch_size=4, shuffle=True, num_workers=workers, generator=torch.Generator().manual_seed(5)
    )
    prepared = accelerator.prepare(loader)
    assert isinstance(prepared.base_dataloader, snaploader.DataLoader)  # snaploader's, through Accelerate's path
    return accelerator, prepared


@pytest.mark.integration
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cut", [3, 10], ids=["mid-epoch", "epoch-end"])
def test_save_state_and_load_state_through_accelerates_stateful_path(
    stateful_accelerate: None, tmp_path: Path, workers: int, cut: int
) -> None:
    accelerator, prepared = _prepared(workers)
    reference = [batch for _ in range(2) for batch in prepared]
    accelerator, prepared = _prepared(workers)
    head: list[torch.Tensor] = []
    for batch in prepared:
        head.append(batch)
        if len(head) == cut:
            break
    saved = prepared.state_dict()
    assert saved["_iterator_finished"] is (cut == 10)  # Accelerate's note, beside snaploader's fields
    accelerator.save_state(str(tmp_path / "ckpt"))
    del prepared

    accelerator, resumed = _prepared(workers)
    accelerator.load_state(str(tmp_path / "ckpt"))  # CheckpointFormatError before the fix
    tail = [batch for batch in resumed]
    if cut < 10:
        assert_same_stream(head + tail, reference[:10], "the rest of the interrupted epoch")
        tail += [batch for batch in resumed]
    # At the last batch Accelerate's read-ahead had ended the loader's epoch: the state
    # describes the next one, whose batches the first pass after the resume yields.
    assert_same_stream(head + tail, reference, "both epochs")


@pytest.mark.integration
def test_an_edit_of_snaploaders_own_field_is_still_refused_naming_it(stateful_accelerate: None, tmp_path: Path) -> None:
    accelerator, prepared = _prepared(0)
    for _, _ in zip(range(2), prepared):
        pass
    accelerator.save_state(str(tmp_path / "ckpt"))
    path = tmp_path / "ckpt" / "dl_state_dict.bin"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "yielded": "x"}, path)
    accelerator, _ = _prepared(0)
    with pytest.raises(snaploader.CheckpointFormatError, match=r"loader state\['yielded'\] should be int, got str"):
        accelerator.load_state(str(tmp_path / "ckpt"))
