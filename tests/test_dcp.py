"""torch.distributed.checkpoint: ``snaploader.dcp_state(loader)`` saves and restores
each rank's own loader state, into fresh loaders (docs/dcp.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import TensorDataset

import snaploader

from ._support import assert_same_stream, free_port, take, wait_all

_ROOT = Path(__file__).resolve().parents[1]
_CHILD_TIMEOUT_S = 240


def _loader() -> snaploader.DataLoader:
    data = TensorDataset(torch.arange(60.0))
    return snaploader.DataLoader(data, batch_size=4, shuffle=True, num_workers=1, generator=torch.Generator().manual_seed(3))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fresh_loader_loads_a_mid_epoch_dcp_checkpoint(tmp_path: Path) -> None:
    # A fresh loader's own checkpoint has another shape than a used one's; DCP plans
    # the load from the target's keys, so this only works through one opaque leaf.
    used = _loader()
    iterator = iter(used)
    take(iterator, 4)
    dcp.save({"loader": snaploader.dcp_state(used)}, checkpoint_id=str(tmp_path))
    expected = [list(iterator), list(used)]
    fresh = _loader()
    dcp.load({"loader": snaploader.dcp_state(fresh)}, checkpoint_id=str(tmp_path))
    assert_same_stream(list(fresh), expected[0], "rest of epoch 0")
    assert_same_stream(list(fresh), expected[1], "epoch 1")


def test_the_plain_state_dict_is_unchanged() -> None:
    loader = _loader()
    state = snaploader.dcp_state(loader).state_dict()
    assert list(state) == ["rank0_of_1"]
    assert json.loads(state["rank0_of_1"]) == loader.state_dict()


def test_bad_inputs_say_what_to_do() -> None:
    data = TensorDataset(torch.arange(8.0))
    with pytest.raises(TypeError, match="takes a snaploader.DataLoader.*torch.utils.data.dataloader.DataLoader"):
        snaploader.dcp_state(torch.utils.data.DataLoader(data))  # type: ignore[arg-type]
    state = snaploader.dcp_state(_loader())
    with pytest.raises(snaploader.CheckpointFormatError, match=r"no state for rank0_of_1 \(it holds \['rank1_of_2'\]\).*world size"):
        state.load_state_dict({"rank1_of_2": "{}"})
    with pytest.raises(snaploader.CheckpointFormatError, match="should be the loader state as a JSON string"):
        state.load_state_dict({"rank0_of_1": {"format": "snaploader"}})
    with pytest.raises(snaploader.CheckpointFormatError, match="not valid JSON"):
        state.load_state_dict({"rank0_of_1": "{"})


def _ranks(phase: str, ckpt: Path, out: Path, world: int = 2) -> list[Any]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(_ROOT), OMP_NUM_THREADS="1")
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._dcp_child", phase, str(rank), str(world), str(port), str(ckpt), str(out / f"{phase}{rank}.pt")],
            cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(world)
    ]
    logs = wait_all(children, _CHILD_TIMEOUT_S)
    for rank, (child, log) in enumerate(zip(children, logs)):
        assert child.returncode == 0, f"rank {rank} of the {phase} run failed:\n{log[-4000:]}"
    return [torch.load(out / f"{phase}{rank}.pt", weights_only=True) for rank in range(world)]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("saving", "ways"),
    [("save", ("dcp.save",)), ("async_save", ("dcp.async_save", "a thread's torch.save"))],
)
def test_each_rank_resumes_its_own_stream_in_fresh_processes(
    tmp_path: Path, saving: str, ways: tuple[str, ...]
) -> None:
    # async_save: dcp.async_save and a thread's torch.save of state_dict() are waited
    # for only after another epoch and a half; what they wrote is the state of the
    # moment they began (docs/dcp.md, "Saving while training goes on").
    saved = _ranks(saving, tmp_path / "ckpt", tmp_path)
    resumed = _ranks(saving.replace("save", "load"), tmp_path / "ckpt", tmp_path)
    for rank in range(2):
        # The ranks stopped at different batches: rank 1 resumed from rank 0's state
        # (what DCP keeps of equal keys) would be two batches off.
        assert len(saved[rank][0]) == 8 - (3 + 2 * rank)
        assert len(resumed[rank]) == len(ways)
        for how, stream in zip(ways, resumed[rank]):
            for epoch in range(2):
                assert_same_stream(stream[epoch], saved[rank][epoch], f"rank {rank}, {how}, epoch {epoch}")
    assert not torch.equal(saved[0][1][0], saved[1][1][0]), "the ranks should read different shards"
