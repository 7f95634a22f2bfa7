"""The loaders compared (torch's DataLoader, snaploader's, torchdata's
StatefulDataLoader when it imports), built alike for every measure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import snaploader


@dataclass
class Contender:
    name: str
    make: Callable[..., Any] | None
    version: str
    skipped: str | None = None  # why it is not measured


def find_contenders(wanted: Sequence[str]) -> dict[str, Contender]:
    found: dict[str, Contender] = {}
    for name in wanted:
        if name == "torch":
            found[name] = Contender(name, torch.utils.data.DataLoader, torch.__version__)
        elif name == "snaploader":
            found[name] = Contender(name, snaploader.DataLoader, snaploader.__version__)
        elif name == "torchdata":
            try:
                import torchdata
                from torchdata.stateful_dataloader import StatefulDataLoader
            except Exception as exc:  # not installed, or built for another torch
                found[name] = Contender(
                    name, None, "", skipped=f"not importable ({type(exc).__name__}: {exc})"
                )
            else:
                found[name] = Contender(
                    name, StatefulDataLoader, getattr(torchdata, "__version__", "?")
                )
        else:
            raise ValueError(f"unknown contender {name!r}")
    return found


def available(contenders: dict[str, Contender]) -> list[Contender]:
    return [c for c in contenders.values() if c.skipped is None]


def build_loader(
    contender: Contender, dataset: Any, batch_size: int, workers: int, seed: int, persistent: bool = False
) -> Any:
    assert contender.make is not None
    extra: dict[str, Any] = {}
    if contender.name == "torchdata":
        extra["snapshot_every_n_steps"] = 1  # its default, spelled out: what issue 24 compares
    return contender.make(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=persistent,
        **extra,
    )


def close_iterator(iterator: Any) -> None:
    """Stop an iterator's workers now (snaploader: close(); torch, torchdata:
    _shutdown_workers()), rather than whenever the garbage collector gets to it."""
    for name in ("close", "_shutdown_workers"):
        stop = getattr(iterator, name, None)
        if callable(stop):
            stop()
            return

