"""Worker-side encoding of results (see NOTE [ small tensors by value ])."""

from __future__ import annotations

import pytest
import torch

from snaploader._workers.messages import Kind, Result, dumps_result, loads_result
from snaploader._state.records import Snapshot

CASES = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.arange(12, dtype=torch.int64).reshape(4, 3).t(),  # not contiguous
    torch.tensor(3.5, dtype=torch.float64),  # 0-dim
    torch.empty(0, 5, dtype=torch.int16),  # no elements
    torch.tensor([True, False, True]),
    torch.randn(4, dtype=torch.bfloat16),
    torch.randn(3, dtype=torch.complex64),
    torch.arange(100, dtype=torch.uint8)[10:20],  # a view into a larger storage
]


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_small_tensors_round_trip_by_value(tensor: torch.Tensor) -> None:
    result = Result(7, Kind.BATCH, {"x": tensor, "y": [tensor, 1]}, Snapshot(b"\x00", 1))
    back = loads_result(dumps_result(result))
    for got in (back.payload["x"], back.payload["y"][0]):
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch.equal(got, tensor)
    assert back.payload["y"][1] == 1 and back.key == 7


def test_small_tensors_travel_without_file_descriptors() -> None:
    blob = dumps_result(Result(0, Kind.BATCH, torch.zeros(1000), Snapshot(b"\x00", 1)))
    assert b"rebuild_storage_fd" not in blob and b"tensor_from_bytes" in blob


@pytest.mark.parametrize("side", [8, 300])  # 3*8*8*4 B by value; 3*300*300*4 B ~ 1 MB by fd
def test_batches_of_both_sizes_match_torch(side: int) -> None:
    from torch.utils.data import TensorDataset

    import snaploader

    ds = TensorDataset(torch.randn(6, 3, side, side), torch.arange(6))

    def run(cls: type) -> list[list[torch.Tensor]]:
        loader = cls(ds, batch_size=2, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(3))
        return [list(batch) for batch in loader]

    ours, theirs = run(snaploader.DataLoader), run(torch.utils.data.DataLoader)
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
