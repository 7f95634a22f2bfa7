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
  from its generator state is refused, naming the key.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper

import snaploader
from snaploader import CheckpointFormatError
from snaploader._format.checkpoint import resign

from ._support import assert_same_stream, through_bytes

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

SEED, OTHER_SEED = 3, 77
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
