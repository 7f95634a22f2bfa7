"""The resume self-check: a checkpoint written by an older release keeps digests of the
batches prefetched but not yet yielded, and a restore that regenerates them differently
says so, once. This release writes none (their presence depended on timing: NOTE
[ one state per position ] in _format/checkpoint.py), and still checks them."""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import snaploader
from snaploader._format.checkpoint import resign
from snaploader._workers.selfcheck import batch_digest

from ._datasets import Augmented
from ._support import generator, mp_helpers, through_bytes  # noqa: F401


class Shifted(Dataset[torch.Tensor]):
    """Item i is i + ``shift``: the same dataset as far as a fingerprint can tell, other
    data when ``shift`` changes (a file rewritten on disk)."""

    def __init__(self, shift: float) -> None:
        self.shift = shift

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i + self.shift, torch.rand(()).item()])


def _state_with_prefetched(dataset: Any, **kwargs: Any) -> dict[str, Any]:
    """A checkpoint after two batches as an older release wrote it once both workers'
    next batches had arrived: ``next_batches`` holds their digests (each worker's
    second batch, batches 2 and 3), taken here from the uninterrupted run."""
    loader = snaploader.DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2, generator=generator(0), **kwargs)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    state = through_bytes(loader.state_dict())
    assert state["next_batches"] == [None, None]  # this release writes none
    following = [next(iterator), next(iterator)]
    del iterator
    state["next_batches"] = [{"produced": 2, "digest": batch_digest(batch)} for batch in following]
    return resign(state)


def _resume(dataset: Any, state: dict[str, Any], **kwargs: Any) -> list[warnings.WarningMessage]:
    loader = snaploader.DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2, generator=generator(0), **kwargs)
    loader.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(loader)
    return [w for w in caught if issubclass(w.category, snaploader.ResumeMismatchWarning)]


def test_a_checkpoint_holds_no_prefetched_digest_whatever_has_arrived() -> None:
    # Two loaders at one position give one state, however far the workers got.
    def state_after_two(wait_s: float) -> dict[str, Any]:
        loader = snaploader.DataLoader(Shifted(0.0), batch_size=2, shuffle=True, num_workers=2, generator=generator(0))
        iterator = iter(loader)
        next(iterator)
        time.sleep(wait_s)  # the workers finish (or not) their prefetched batches
        next(iterator)
        state = loader.state_dict()
        del iterator
        return state

    quick, slow = state_after_two(0.0), state_after_two(0.5)
    assert quick["next_batches"] == [None, None]
    assert quick == slow


def test_an_exact_resume_does_not_warn() -> None:
    state = _state_with_prefetched(Augmented(24))
    assert _resume(Augmented(24), state) == []


def test_data_changed_since_the_checkpoint_warns_once_naming_the_batch() -> None:
    state = _state_with_prefetched(Shifted(0.0))
    # the first checked batch: map-style batch k is worker k mod 2's batch k // 2, both
    # counted from 0 as skip_to counts
    worker = next(w for w, entry in enumerate(state["next_batches"]) if entry is not None)
    caught = _resume(Shifted(0.5), state)
    assert len(caught) == 1
    message = str(caught[0].message)
    first, details = message.split("\n", 1)
    # the first line says what happened and what to do; the details come after
    assert first.startswith(f"resume self-check: batch {2 + worker} of epoch 0 differs"), message
    assert "run `snaploader verify`" in first and len(first) < 300
    assert f"worker {worker}'s batch 1 of the epoch (from 0)" in details, message
    assert "data changed on disk" in details


def test_the_check_can_be_switched_off() -> None:
    state = _state_with_prefetched(Shifted(0.0))
    assert _resume(Shifted(0.5), state, check_resume=False) == []
    with pytest.raises(ValueError, match="check_resume"):
        snaploader.DataLoader(Shifted(0.0), check_resume="yes")  # type: ignore[arg-type]


def test_digest_sees_values_dtypes_and_structure() -> None:
    base = {"x": torch.arange(1000.0), "y": [1, "a"]}
    assert batch_digest(base) == batch_digest({"x": torch.arange(1000.0), "y": [1, "a"]})
    changed_tail = torch.arange(1000.0)
    changed_tail[-1] = -1.0
    for other in (
        {"x": changed_tail, "y": [1, "a"]},
        {"x": torch.arange(1000.0).double(), "y": [1, "a"]},
        {"x": torch.arange(1000.0), "y": (1, "a")},
        {"x": torch.arange(1000.0), "y": [2, "a"]},
    ):
        assert batch_digest(other) != batch_digest(base)


def _torch_edges(value: torch.Tensor, edge: int = 64) -> bytes:
    """The edges as torch itself gives them: the reference for the NumPy fast path."""
    flat = value.detach().resolve_conj().resolve_neg().reshape(-1)
    if not flat.numel():
        return b""
    edges = flat if flat.numel() <= 2 * edge else torch.cat((flat[:edge], flat[-edge:]))
    return edges.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.rand(3, 40, 40),
        lambda: torch.rand(5),
        lambda: torch.rand(0, 3),
        lambda: torch.tensor(2.5),
        lambda: torch.arange(1000).reshape(10, 100).t(),  # not contiguous
        lambda: torch.rand(100, 3)[::2, 1:],
        lambda: torch.rand(300, dtype=torch.float64).to(torch.bfloat16),  # no NumPy dtype
        lambda: torch.randn(300, dtype=torch.cfloat).conj(),  # conjugate bit
        lambda: torch.rand(300)._neg_view(),  # negative bit
        lambda: torch.tensor([True, False] * 100),
        lambda: torch.rand(20, 20, requires_grad=True),
        lambda: torch.randint(0, 255, (1000,), dtype=torch.uint8),
    ],
)
def test_digest_edges_are_the_same_bytes_whichever_way_they_are_read(make: Any) -> None:
    # A checkpoint's digests must match the ones a restored worker computes, across
    # versions too: the NumPy path reads exactly the bytes torch's ops would give.
    from snaploader._workers.selfcheck import _edge_bytes

    value = make()
    assert _edge_bytes(value.detach()) == _torch_edges(value)
