"""Lightning's preemption paths with ``ExactResume`` (docs/lightning.md): a checkpoint
written at an epoch's end (``ModelCheckpoint``'s default moment, resumed with
``ckpt_path="last"``), which Lightning resumes without loading the loader's state; and
SLURM's auto-requeue, whose SIGUSR1 handler writes ``hpc_ckpt_N.ckpt`` at any moment of
a step (the job relaunched with the SLURM variables emulated, in fresh processes:
tests/_lightning_slurm_child.py). Batches and final weights are compared with the
uninterrupted run's, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[integrations]')")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

import snaploader  # noqa: E402
from snaploader.integrations.lightning import ExactResume  # noqa: E402

from ._datasets import Augmented  # noqa: E402
from ._iterable_datasets import IteratorStateStream  # noqa: E402
from ._streams import assert_same_stream  # noqa: E402

pytestmark = pytest.mark.integration

_EPOCHS = 3


class _Stop(Exception):
    pass


class _Recorder(pl.LightningModule):
    """Records the batch of every global step; raises at the start of epoch ``stop_at``
    (after the checkpoint of the epoch before it was written)."""

    def __init__(self, stop_at: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 1)
        self.seen: dict[int, torch.Tensor] = {}
        self.stop_at = stop_at

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.stop_at:
            raise _Stop

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[self.global_step] = batch.clone()
        return self.layer(batch.float()).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(num_workers: int) -> snaploader.DataLoader:
    return snaploader.DataLoader(Augmented(24), batch_size=4, shuffle=True, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(5))


def _fit(num_workers: int, folder: Path, *, stop_at: int | None = None, ckpt_path: str | None = None,
         exact: bool = True) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    module = _Recorder(stop_at)
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=folder, save_last=True)]  # saves at each epoch's end
    if exact:
        callbacks.append(ExactResume())
    trainer = pl.Trainer(max_epochs=_EPOCHS, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        try:
            trainer.fit(module, train_dataloaders=_loader(num_workers), ckpt_path=ckpt_path)
        except _Stop:
            pass
    return module.seen, module.layer.weight.detach().clone()


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_at", [1, 2], ids=["after-epoch0", "after-epoch1"])
def test_an_epoch_end_checkpoint_resumes_with_the_next_epoch_exactly(tmp_path: Path, num_workers: int, stop_at: int) -> None:
    expected, final = _fit(num_workers, tmp_path / "whole")
    assert len(expected) == 6 * _EPOCHS
    first, _ = _fit(num_workers, tmp_path / "run", stop_at=stop_at)
    assert sorted(first) == list(range(6 * stop_at))
    second, weights = _fit(num_workers, tmp_path / "run", ckpt_path="last")
    assert sorted(second) == list(range(6 * stop_at, 6 * _EPOCHS))
    merged = first | second
    assert_same_stream([merged[s] for s in sorted(merged)], [expected[s] for s in sorted(expected)])
    assert torch.equal(weights, final)


class _FailsInStep(_Recorder):
    """Raises inside training step ``fail_at`` (after it was given its batch)."""

    def __init__(self, fail_at: int | None) -> None:
        super().__init__(None)
        self.fail_at = fail_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[self.global_step] = batch.clone()
        if self.global_step == self.fail_at:
            raise _Stop
        return self.layer(batch[:, :1].float().repeat(1, 8)).pow(2).mean()


def _exception_fit(kind: str, folder: Path, *, fail_at: int | None = None, ckpt_path: Path | None = None,
                   exact: bool = True) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    module = _FailsInStep(fail_at)
    callbacks: list[pl.Callback] = [OnExceptionCheckpoint(dirpath=folder, filename="on_exception")]
    if exact:
        callbacks.append(ExactResume())
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)
    dataset = Augmented(24) if kind == "map" else IteratorStateStream(n=24)
    loader = snaploader.DataLoader(dataset, batch_size=4, shuffle=kind == "map" or None, num_workers=2,
                                   generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        try:
            trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
        except _Stop:
            pass
    return module.seen, module.layer.weight.detach().clone()


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_on_exception_checkpoint_of_an_error_inside_a_step_resumes_exactly(tmp_path: Path, kind: str) -> None:
    # The step that raised is run again on resume: the loader must give it its batch.
    expected, final = _exception_fit(kind, tmp_path / "whole")
    first, _ = _exception_fit(kind, tmp_path / "run", fail_at=8)
    second, weights = _exception_fit(kind, tmp_path / "resumed", ckpt_path=tmp_path / "run" / "on_exception.ckpt")
    assert min(second) == 8
    merged = {s: b for s, b in first.items() if s < 8} | second
    assert_same_stream([merged[s] for s in sorted(merged)], [expected[s] for s in sorted(expected)])
    assert torch.equal(weights, final)


_SLURM_ENV = {
    "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost",
}


def _slurm_run(kind: str, phase: str, folder: Path, moment: str = "none", seed: int = 0) -> dict[str, Any]:
    stub = folder / "bin" / "scontrol"
    if not stub.exists():
        stub.parent.mkdir(parents=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    env = os.environ | _SLURM_ENV | {"PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    child = subprocess.run([sys.executable, "-m", "tests._lightning_slurm_child", kind, phase, str(folder), moment, str(seed)],
                           env=env, cwd=root, capture_output=True, text=True, timeout=240)
    killed = phase == "signalled" and child.returncode == -9
    assert child.returncode == 0 or killed, f"{phase} exited with {child.returncode}:\n{child.stderr[-4000:]}"
    return torch.load(folder / f"{phase}.pt", weights_only=True)


_REFERENCES: dict[str, dict[str, Any]] = {}


@pytest.mark.parametrize(
    "kind, moment, seed",
    [("map", "training_step", 0), ("map", "on_train_batch_end", 0), ("map", "timer", 1), ("iterable", "training_step", 0), ("iterable", "timer", 2)],
)
def test_slurm_requeue_from_a_signal_inside_a_step_resumes_exactly(tmp_path: Path, kind: str, moment: str, seed: int) -> None:
    if kind not in _REFERENCES:
        (tmp_path / "reference").mkdir()
        _REFERENCES[kind] = _slurm_run(kind, "reference", tmp_path / "reference")
    expected = _REFERENCES[kind]
    first = _slurm_run(kind, "signalled", tmp_path, moment, seed)
    hpc = torch.load(tmp_path / "root" / "hpc_ckpt_1.ckpt", weights_only=False)
    resume_step = hpc["global_step"]
    assert resume_step in (12, 13, 14)  # the signal came during step 13 (or the fetch after it)
    second = _slurm_run(kind, "relaunched", tmp_path)
    assert min(second["seen"]) == resume_step
    merged = {s: b for s, b in first["seen"].items() if s < resume_step} | second["seen"]
    assert sorted(merged) == sorted(expected["seen"]) == list(range(20))
    assert_same_stream([merged[s] for s in sorted(merged)], [expected["seen"][s] for s in sorted(merged)])
    assert torch.equal(second["weights"], expected["weights"])
