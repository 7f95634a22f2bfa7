"""IterDataPipe datasets: torch's stream, and exact resume.

What a user relies on:

- with an ``IterDataPipe`` (``IterableWrapper(...).shuffle().sharding_filter()``, the
  same without ``shuffle``, and a pipe without ``sharding_filter``), snaploader yields
  what torch's DataLoader yields for the same generator seed, at ``num_workers`` 0 and
  2, two epochs, persistent workers or not: torch draws a shared seed for the pipe's
  random parts (before the workers' base seed) and shards the pipe over the workers;
- the loader's generator ends each epoch where torch's does (the shared-seed draw is
  one of its draws), so the next epoch, and a sampler drawing from it, still match;
- ``state_dict()`` after any batch, through torch.save/torch.load(weights_only=True),
  into a new loader whose generator is seeded differently, resumes the stream bit for
  bit, into the next epoch too;
- a checkpoint whose shared seed was edited so that its base seed no longer follows
  from its generator state is refused, naming the key;
- (integration) on two gloo ranks seeded differently: sharded by rank and worker, rank
  0's shared seed on both, torch's stream, and an exact resume.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper

import snaploader
from snaploader import CheckpointFormatError
from snaploader._format.checkpoint import resign

from ._support import assert_same_stream, free_port, through_bytes, wait_all

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

ROOT = Path(__file__).resolve().parent.parent
SEED, OTHER_SEED = 3, 77
_CHILD_TIMEOUT_S = 120
EPOCHS = 2
PIPES = ["shuffled", "sharded", "unsharded"]


def make_pipe(kind: str) -> Any:
    pipe = IterableWrapper(range(20))
    if kind == "shuffled":
        return pipe.shuffle().sharding_filter()
    if kind == "sharded":
        return pipe.sharding_filter()
    return pipe.shuffle()  # no sharding_filter: every worker yields every sample, in torch too


def make(cls: Any, kind: str, workers: int, seed: int, persistent: bool = False) -> Any:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return cls(make_pipe(kind), batch_size=3, num_workers=workers, generator=generator,
               persistent_workers=persistent and workers > 0)


def run(loader: Any, epochs: int = EPOCHS) -> list[Any]:
    out = []
    for _ in range(epochs):
        out.extend(list(loader))
    out.append(loader.generator.get_state())  # where the generator ended
    return out


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", PIPES)
def test_same_stream_as_torch(kind: str, workers: int, persistent: bool) -> None:
    expected = run(make(torch.utils.data.DataLoader, kind, workers, SEED, persistent))
    got = run(make(snaploader.DataLoader, kind, workers, SEED, persistent))
    assert_same_stream(got, expected, f"{kind} pipe, num_workers={workers}")
    if kind != "unsharded":
        # each sample once per epoch, whatever the worker count
        per_epoch = (len(expected) - 1) // EPOCHS
        samples = sorted(int(x) for batch in expected[:per_epoch] for x in batch)
        assert samples == list(range(20))


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["shuffled", "unsharded"])
def test_resume_is_exact(kind: str, workers: int, persistent: bool) -> None:
    whole = run(make(snaploader.DataLoader, kind, workers, SEED, persistent))
    per_epoch = (len(whole) - 1) // EPOCHS
    for cut in range(0, per_epoch + 1, 2):
        loader = make(snaploader.DataLoader, kind, workers, SEED, persistent)
        first = list(loader)  # epoch 0 whole: the cut falls in epoch 1
        it = iter(loader)
        first += [next(it) for _ in range(cut)]
        state = through_bytes(loader.state_dict())
        del it, loader
        resumed = make(snaploader.DataLoader, kind, workers, OTHER_SEED, persistent)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a replay of the pipe is announced
            resumed.load_state_dict(state)
            rest = list(resumed)
        rest.append(resumed.generator.get_state())
        assert_same_stream(first + rest, whole, f"{kind} pipe, num_workers={workers}, cut after {cut}")


@pytest.mark.parametrize("resume_workers", [0, 1])
def test_resume_with_another_num_workers_is_exact(resume_workers: int) -> None:
    whole = run(make(snaploader.DataLoader, "shuffled", 2, SEED))
    loader = make(snaploader.DataLoader, "shuffled", 2, SEED)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = through_bytes(loader.state_dict())
    del it, loader
    resumed = make(snaploader.DataLoader, "shuffled", resume_workers, OTHER_SEED)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rest = list(resumed)  # the checkpoint's epoch, on its 2 logical workers
    assert_same_stream(first + rest, whole[: len(whole) // 2], f"resumed at num_workers={resume_workers}")


def test_edited_shared_seed_is_refused() -> None:
    loader = make(snaploader.DataLoader, "shuffled", 2, SEED)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    state["shared_seed"] = None  # as if no shared seed had been drawn before the base seed
    state["digest"] = resign(state)["digest"]
    with pytest.raises(CheckpointFormatError, match="base_seed"):
        make(snaploader.DataLoader, "shuffled", 2, SEED).load_state_dict(state)


@pytest.mark.integration
def test_two_gloo_ranks_shard_and_share_rank_0s_seed(tmp_path: Path) -> None:
    """Under torch.distributed: sharded by rank and worker, rank 0's shared seed on both
    ranks (their generators are seeded differently), the same stream as torch's, and an
    exact resume from a checkpoint that carries rank 0's seed."""
    port = free_port()
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._datapipe_child", str(rank), str(port), str(tmp_path)],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    logs = wait_all(children, _CHILD_TIMEOUT_S)
    for rank, (child, log) in enumerate(zip(children, logs)):
        assert child.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for workers in (0, 2):
        samples = []
        for rank, result in enumerate(ranks):
            streams = result[workers]
            what = f"rank {rank}, num_workers={workers}"
            assert_same_stream(streams["snaploader"], streams["torch"], what)
            assert_same_stream(streams["resumed"], streams["torch"], f"{what}, resumed")
            samples += [int(x) for batch in streams["torch"][: len(streams["torch"]) // 2] for x in batch]
        assert sorted(samples) == list(range(24)), f"num_workers={workers}: the ranks' shards"
