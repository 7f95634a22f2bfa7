"""snaploader's DataLoader where Lightning looks closely at torch's (with the real
``lightning``, without snaploader's callback): the loader pickles for
``strategy="ddp_spawn"``; persistent workers end with ``Trainer.fit``, returned or
raised; a subclass may define ``options`` (Lightning's ``_replace_dunder_methods``
re-instantiation included); an uninterrupted ``fit`` gives torch's stream."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as torch_data

pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[integrations]')")

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.utilities.data import _replace_dunder_methods  # noqa: E402
from lightning.pytorch.utilities.data import _update_dataloader  # noqa: E402

import snaploader  # noqa: E402

pytestmark = pytest.mark.integration


class _Raised(Exception):
    pass


class _Recorder(pl.LightningModule):
    def __init__(self, raise_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []
        self.raise_at = raise_at

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.raise_at:
            raise _Raised
        self.seen.append(batch.tolist())
        return self.layer(batch[:, None].float()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(**kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(max_epochs=3, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                                   enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    return pl.Trainer(**(options | kwargs))


def _fit(module: pl.LightningModule, loader: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        _trainer(**kwargs).fit(module, train_dataloaders=loader)


def _workers() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("snaploader-worker")]


@pytest.mark.parametrize("raises", [False, True], ids=["returned", "raised"])
def test_persistent_workers_end_with_the_fit(raises: bool) -> None:
    # Without ExactResume, and with the loader still referenced: Lightning's teardown
    # resets loader._iterator, which ends snaploader's workers as it ends torch's.
    loader = snaploader.DataLoader(list(range(24)), batch_size=4, shuffle=True, num_workers=2,
                                   persistent_workers=True, generator=torch.Generator().manual_seed(5))
    module = _Recorder(raise_at=8 if raises else None)
    if raises:
        with pytest.raises(_Raised):
            _fit(module, loader)
    else:
        _fit(module, loader)
    assert len(module.seen) == (8 if raises else 18)
    assert not _workers(), "the loader's workers outlived Trainer.fit"
    # The loader is usable afterwards, as torch's is: a new fit starts its workers again.
    _fit(_Recorder(), loader, max_epochs=1)
    assert not _workers()


_SPAWN_SCRIPT = """
import sys, warnings
import torch, lightning.pytorch as pl, snaploader

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        print("trained on", sorted(batch.tolist()), flush=True)  # in the spawned process
        return self.layer(batch[:, None].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    # (no generator: a torch.Generator does not survive spawn's pickler, torch's loader's neither)
    loader = snaploader.DataLoader(list(range(8)), batch_size=2, shuffle=True, num_workers=1, persistent_workers=True)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, strategy="ddp_spawn", enable_progress_bar=False,
                         logger=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=sys.argv[1])
    trainer.fit(Module(), train_dataloaders=loader)
"""


def test_ddp_spawn_pickles_the_loader(tmp_path: Path) -> None:
    # strategy="ddp_spawn" pickles the fit's arguments, the loader among them, to the
    # process it starts (Lightning's own test_dataloader_persistent_workers_performance_warning).
    # A user's script, run in a process of its own as spawn needs.
    script = tmp_path / "train.py"
    script.write_text(_SPAWN_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = [line for line in run.stdout.splitlines() if line.startswith("trained on")]
    assert len(seen) == 4 and sorted(sum((json.loads(line[len("trained on"):]) for line in seen), [])) == list(range(8))


class _WithOptions(snaploader.DataLoader):
    """A subclass with an ``options`` property, as poptorch's DataLoader has, and
    properties named as snaploader's options."""

    def __init__(self, dataset: Any, *args: Any, tag: str = "mine", **kwargs: Any) -> None:
        self.tag = tag
        super().__init__(dataset, *args, **kwargs)

    @property
    def options(self) -> str:
        return f"options of {self.tag}"

    @property
    def replay(self) -> str:  # a name snaploader's options use
        return "not snaploader's"


def _stream(loader: Any, epochs: int = 2) -> list[list[int]]:
    return [batch.tolist() for _ in range(epochs) for batch in loader]


def test_a_subclass_may_define_options() -> None:
    loader = _WithOptions(list(range(12)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    assert loader.options == "options of mine"
    plain = snaploader.DataLoader(list(range(12)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    assert _stream(loader) == _stream(plain)
    resumed = _WithOptions(list(range(12)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))
    resumed.load_state_dict(loader.state_dict())
    assert _stream(resumed, 1) == _stream(plain, 1)


def test_lightning_reinstantiates_a_subclass_with_options() -> None:
    # Lightning records the constructor's arguments (_replace_dunder_methods) and builds
    # the loader again with its own sampler (_update_dataloader), as under DDP.
    dataset = list(range(12))
    with _replace_dunder_methods(torch_data.DataLoader, "dataset"):
        loader = _WithOptions(dataset, batch_size=4, tag="rebuilt", generator=torch.Generator().manual_seed(5))
    rebuilt = _update_dataloader(loader, torch_data.SequentialSampler(dataset))
    assert type(rebuilt) is _WithOptions and rebuilt.options == "options of rebuilt"
    assert _stream(rebuilt, 1) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert "__init__" not in vars(_WithOptions) or not hasattr(_WithOptions.__init__, "__wrapped__")
    module = _Recorder()
    _fit(module, _WithOptions(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5)), max_epochs=1)
    assert len(module.seen) == 3


@pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)], ids=["0w", "2w", "2w-persistent"])
def test_an_uninterrupted_fit_gives_torchs_stream(num_workers: int, persistent: bool) -> None:
    # 12 items in batches of 4: Lightning ends each epoch after len(loader) batches
    # without the next() that would run the sampler dry; torch's num_workers=0 then
    # never draws the sampler's end (RandomSampler's empty tail permutation), and the
    # next epoch's order depends on it. snaploader draws as torch does.
    def stream(cls: type[torch_data.DataLoader[Any]]) -> list[list[int]]:
        module = _Recorder()
        _fit(module, cls(list(range(12)), batch_size=4, shuffle=True, num_workers=num_workers,
                         persistent_workers=persistent, generator=torch.Generator().manual_seed(5)))
        return module.seen

    expected = stream(torch_data.DataLoader)
    assert len(expected) == 9
    assert stream(snaploader.DataLoader) == expected
