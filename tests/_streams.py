"""Exact comparison of batch streams and checkpoints taken at a cut: the helpers the
tests share with the stress scripts, so they need nothing but torch (no pytest: the
stress scripts run in a `.[cpu]` install)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """Bit-for-bit equality of two (nested) batches: tensors by torch.equal with the
    same dtype and shape, containers element by element, everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {b!r:.200}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_stream(got: list[Any], expected: list[Any], what: str = "stream") -> None:
    assert len(got) == len(expected), f"{what}: {len(got)} batches, expected {len(expected)}"
    for k, (x, y) in enumerate(zip(got, expected)):
        assert_same(x, y, f"{what} batch {k}")


def epochs(loader: Iterable[Any], count: int, before_epoch: Callable[[int], None] | None = None) -> list[list[Any]]:
    """``count`` full epochs of ``loader``, one list of batches per epoch."""
    out = []
    for epoch in range(count):
        if before_epoch is not None:
            before_epoch(epoch)
        out.append(list(loader))
    return out


def take(iterator: Iterator[Any], k: int) -> list[Any]:
    out = []
    for _ in range(k):
        out.append(next(iterator))
    return out


def through_bytes(state: Any) -> Any:
    """``state`` after torch.save and torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def cut_state(loader: Any, epochs_before: int, cut: int) -> dict[str, Any]:
    """``loader``'s state after ``epochs_before`` whole epochs and ``cut`` batches of the
    next, through torch.save/torch.load(weights_only=True); its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs_before):
            list(loader)
        iterator = iter(loader)
        for _ in range(cut):
            next(iterator)
        state = through_bytes(loader.state_dict())
        del iterator
    return state


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
