"""Lightning: a run interrupted after a ModelCheckpoint and resumed with
``fit(ckpt_path=...)`` gives the training step the batches of the uninterrupted run,
for a map-style dataset and for an IterableDataset without ``__len__`` (with
``snaploader.integrations.lightning.ExactResume``; docs/lightning.md)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[integrations]')")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import snaploader  # noqa: E402
from snaploader.integrations.lightning import ExactResume

from ._datasets import Augmented  # noqa: E402
from ._iterable_datasets import IteratorStateStream  # noqa: E402
from ._support import assert_same_stream  # noqa: E402

pytestmark = pytest.mark.integration


class _Interrupted(Exception):
    pass


class _Recorder(pl.LightningModule):
    """Records every batch the training step is given, by global step; raises after
    step ``stop_after`` (as a killed run would stop there)."""

    def __init__(self, stop_after: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial weights in every run
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[int, torch.Tensor] = {}
        self.stop_after = stop_after

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen[self.global_step] = batch.clone()
        return self.layer(batch[:, :1].float()).sum()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.stop_after is not None and self.global_step == self.stop_after:
            raise _Interrupted

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _map_loader() -> snaploader.DataLoader:
    return snaploader.DataLoader(Augmented(40), batch_size=4, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5))


def _iterable_loader() -> snaploader.DataLoader:
    return snaploader.DataLoader(IteratorStateStream(n=40), batch_size=4, num_workers=2, generator=torch.Generator().manual_seed(5))


def _fit(make_loader: Callable[[], snaploader.DataLoader], ckpt_dir: Path, *, stop_after: int | None = None,
         ckpt_path: Path | None = None, exact: bool = True, every: int = 3) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """The batches the training step got, by global step, and the final weights."""
    module = _Recorder(stop_after)
    callbacks: list[pl.Callback] = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1)]
    if exact:
        callbacks.append(ExactResume())
    trainer = pl.Trainer(
        max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="lightning")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        try:
            trainer.fit(module, train_dataloaders=make_loader(), ckpt_path=ckpt_path)
        except _Interrupted:
            pass
    seen, weights = module.seen, module.layer.weight.detach().clone()
    del trainer, module
    gc.collect()  # the loader's workers go with the trainer
    return seen, weights


def _interrupted_and_resumed(make_loader: Callable[[], snaploader.DataLoader], tmp_path: Path, stop_after: int,
                             exact: bool = True, every: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    first, _ = _fit(make_loader, tmp_path / "run", stop_after=stop_after, exact=exact, every=every)
    resume_step = stop_after // every * every
    (ckpt,) = (tmp_path / "run").glob(f"*step={resume_step}.ckpt")
    second, weights = _fit(make_loader, tmp_path / "resumed", ckpt_path=ckpt, exact=exact, every=every)
    assert min(second) == resume_step
    merged = {step: batch for step, batch in first.items() if step < resume_step} | second
    return [merged[step] for step in sorted(merged)], weights


def _uninterrupted(make_loader: Callable[[], snaploader.DataLoader], tmp_path: Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    seen, weights = _fit(make_loader, tmp_path / "whole")
    assert len(seen) == 20
    return [seen[step] for step in sorted(seen)], weights


# (stop after step, checkpoint every): resumed from step 6 (mid epoch 0), 12 (mid
# epoch 1) and 10 (the end of epoch 0: 10 batches an epoch).
_CUTS = pytest.mark.parametrize("stop_after, every", [(7, 3), (14, 3), (11, 5)], ids=["epoch0", "epoch1", "epoch-end"])


@_CUTS
def test_map_style_resumes_exactly(tmp_path: Path, stop_after: int, every: int) -> None:
    expected, final = _uninterrupted(_map_loader, tmp_path)
    got, weights = _interrupted_and_resumed(_map_loader, tmp_path, stop_after, every=every)
    assert_same_stream(got, expected)
    assert torch.equal(weights, final)


@_CUTS
def test_iterable_without_length_resumes_exactly(tmp_path: Path, stop_after: int, every: int) -> None:
    expected, final = _uninterrupted(_iterable_loader, tmp_path)
    got, weights = _interrupted_and_resumed(_iterable_loader, tmp_path, stop_after, every=every)
    assert_same_stream(got, expected)
    assert torch.equal(weights, final)


def test_without_the_callback_lightning_skips_the_batch_it_read_ahead(tmp_path: Path) -> None:
    # Why ExactResume exists: Lightning's fetcher read batch 7 before the checkpoint
    # after step 6 was written, and the loader state it saved is past it.
    expected, _ = _uninterrupted(_iterable_loader, tmp_path)
    got, _ = _interrupted_and_resumed(_iterable_loader, tmp_path, 7, exact=False)
    assert torch.equal(got[5], expected[5])
    assert torch.equal(got[6], expected[7])
