"""Checkpoints written by earlier snaploader versions still resume, bit for bit.

``tests/checkpoints/format<V>.json`` holds, for each checkpoint format version V this
snaploader reads, a checkpoint written by the code that wrote version V (format 2: commit
873a6a2, the last before format 3; format 3: this branch's code when the fixture was
added) taken after 2 of the 6 batches of :func:`make`'s epoch with 2 workers, and the
4 batches the uninterrupted run yielded after it. A new format version gets its own
fixture, written by the code that introduces it, and no fixture is ever regenerated:
that is the promise docs/compatibility.md makes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import snaploader
from snaploader._format.checkpoint import READABLE_VERSIONS, VERSION

FIXTURES = Path(__file__).with_name("checkpoints")


class Noisy(Dataset[torch.Tensor]):
    """Item i: i and a draw from the worker's torch RNG."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()], dtype=torch.float64)


def make(num_workers: int) -> snaploader.DataLoader:
    return snaploader.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(5))


def fixture(version: int) -> dict[str, Any]:
    return json.loads((FIXTURES / f"format{version}.json").read_text())


def test_every_readable_version_has_a_fixture() -> None:
    assert VERSION in READABLE_VERSIONS
    found = sorted(int(path.stem.removeprefix("format")) for path in FIXTURES.glob("format*.json"))
    assert found == sorted(READABLE_VERSIONS), (
        "each checkpoint format version this snaploader reads needs a checkpoint written by "
        "the code that introduced it in tests/checkpoints/ (and one no longer read, none)"
    )


@pytest.mark.filterwarnings("error::snaploader.ResumeMismatchWarning")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_an_old_checkpoint_resumes_exactly(version: int, num_workers: int) -> None:
    saved = fixture(version)
    assert saved["state"]["version"] == version
    loader = make(num_workers)
    loader.load_state_dict(saved["state"])
    assert loader.batches_remaining() == len(saved["rest"]) == 4
    assert [batch.tolist() for batch in loader] == saved["rest"]


def test_a_version_not_read_is_refused_naming_the_versions_read() -> None:
    state = dict(fixture(VERSION)["state"])
    state["version"] = VERSION + 1
    with pytest.raises(snaploader.CheckpointFormatError, match=re.escape(f"reads versions {READABLE_VERSIONS}")):
        make(0).load_state_dict(state)
