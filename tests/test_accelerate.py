"""Accelerate: ``snaploader.integrations.accelerate.prepare`` shards like Accelerate and
``accelerator.save_state``/``load_state`` resume each process's stream exactly, in
fresh processes, after a SIGKILL (docs/accelerate.md). Real ``accelerate``."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import snaploader

from ._support import assert_same_stream, run_ranks

pytest.importorskip("accelerate", reason="the Accelerate integration tests need accelerate (pip install 'snaploader[integrations]')")

from accelerate import Accelerator  # noqa: E402
from snaploader.integrations import accelerate as snap_accelerate

_CHILD_TIMEOUT_S = 120
_EPOCHS = 2
_CUTS = {0: 2, 1: 3}  # as in tests/_accelerate_child.py


def _run(phase: str, folder: Path, world: int) -> list[list[list[torch.Tensor]]]:
    """Run ``phase`` on ``world`` fresh processes; each one's consumed batches by epoch."""
    results = run_ranks(["tests._accelerate_child", phase, str(folder)], world, _CHILD_TIMEOUT_S)
    expected = -signal.SIGKILL if phase == "save" else 0
    for rank, (code, log) in enumerate(results):
        assert code == expected, f"process {rank} of the {phase} run exited with {code}:\n{log[-4000:]}"
    return [torch.load(folder / f"{phase}{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.mark.integration
@pytest.mark.parametrize("world", [1, 2], ids=["one-process", "two-gloo-processes"])
def test_save_state_mid_epoch_resumes_every_process_exactly(tmp_path: Path, world: int) -> None:
    reference = _run("reference", tmp_path, world)
    saved = _run("save", tmp_path, world)
    resumed = {k: _run(f"load{k}", tmp_path, world) for k in _CUTS}
    batches = 11 if world == 1 else 6  # 11 batches of 4; two processes get 6 each (even_batches)
    for rank in range(world):
        assert [len(epoch) for epoch in reference[rank]] == [batches] * _EPOCHS
        for cut_epoch, cut in _CUTS.items():
            # what the killed run consumed up to its save, then what the resumed run consumed
            got = [*saved[rank][:cut_epoch], saved[rank][cut_epoch][:cut] + resumed[cut_epoch][rank][cut_epoch],
                   *resumed[cut_epoch][rank][cut_epoch + 1:]]
            for epoch in range(_EPOCHS):
                assert_same_stream(got[epoch], reference[rank][epoch], f"process {rank}, saved in epoch {cut_epoch}, epoch {epoch}")
    if world == 2:
        assert not torch.equal(reference[0][0][0], reference[1][0][0]), "the processes should read different batches"
        indices = [int(i) for rank in range(2) for batch in reference[rank][0] for i in batch[:, 0]]
        assert sorted(set(indices)) == list(range(44)), "together the processes should read the whole dataset"


@pytest.fixture
def accelerator() -> Iterator[Accelerator]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield Accelerator(cpu=True)
    # Accelerate keeps its state in process-wide singletons: leave none to other tests.
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def _loader(n: int = 12, **options: object) -> snaploader.DataLoader:
    return snaploader.DataLoader(torch.utils.data.TensorDataset(torch.arange(float(n))), batch_size=4, **options)  # type: ignore[arg-type]


@pytest.mark.integration
def test_prepared_loader_passes_through_accelerator_prepare(accelerator: Accelerator) -> None:
    prepared = snap_accelerate.prepare(accelerator, _loader())
    assert accelerator.prepare(prepared) is prepared
    assert len(prepared) == 3 and prepared.dataset is prepared.loader.dataset
    assert [batch[0].device for batch in prepared] == [accelerator.device] * 3


@pytest.mark.integration
def test_bad_inputs_say_what_to_do(accelerator: Accelerator, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="takes an accelerate.Accelerator first, got builtins.object"):
        snap_accelerate.prepare(object(), _loader())  # type: ignore[arg-type]
    torch_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4.0)))
    with pytest.raises(TypeError, match="takes a snaploader.DataLoader, got torch.utils.data.dataloader.DataLoader"):
        snap_accelerate.prepare(accelerator, torch_loader)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="accelerator.prepare already rebuilt"):
        snap_accelerate.prepare(accelerator, accelerator.prepare(_loader()))
    loader = _loader()
    snap_accelerate.prepare(accelerator, loader)
    with pytest.raises(ValueError, match="already prepared on this accelerator"):
        snap_accelerate.prepare(accelerator, loader)
    accelerator.save_state(str(tmp_path / "saved"))
    fresh = Accelerator(cpu=True)
    snap_accelerate.prepare(fresh, _loader())
    snap_accelerate.prepare(fresh, _loader())  # a second loader, never saved
    with pytest.raises(snaploader.CheckpointFormatError, match=r"no state for snaploader loader 1 on process 0 of 1 .*\['snaploader_0_rank0_of_1.json'\]"):
        fresh.load_state(str(tmp_path / "saved"))
    (tmp_path / "saved" / "snaploader_0_rank0_of_1.json").write_text("{")
    damaged = Accelerator(cpu=True)
    snap_accelerate.prepare(damaged, _loader())
    with pytest.raises(snaploader.CheckpointFormatError, match="not valid JSON"):
        damaged.load_state(str(tmp_path / "saved"))
