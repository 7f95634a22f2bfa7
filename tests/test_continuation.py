"""distributed/continuation.py: after a re-partitioning ``reshard``, the next epoch is
the old run's next epoch (its base seed, its per-sample seeds), not a new loader's
epoch 0 (issue 32, item 1; docs/elastic.md, "The epochs after")."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import snaploader
from snaploader.distributed import reshard
from snaploader.distributed.continuation import Continuation
from snaploader.distributed.rules import Source

from ._datasets import Augmented
from ._support import take, through_bytes

N = 40
OLD = 4
CUT = 2
_TOPOLOGIES = [(0, False), (2, False), (2, True)]


def _factory(batch_size: int, workers: int, persistent: bool, per_sample: bool) -> Callable[[Any], snaploader.DataLoader[Any]]:
    dataset = Augmented(N)

    def make_loader(sampler: Any) -> snaploader.DataLoader[Any]:
        return snaploader.DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
            persistent_workers=persistent, generator=torch.Generator().manual_seed(1),
            seed_per_sample=per_sample,
        )

    return make_loader


def _samples(batches: Any) -> dict[int, torch.Tensor]:
    return {int(row[0]): row for batch in batches for row in batch}


def _old_run(make: Callable[[Any], Any]) -> tuple[list[dict[str, Any]], dict[int, torch.Tensor], list[int]]:
    """Each old rank's state after CUT steps of epoch 1 (epoch 0 read whole); the
    samples of the epoch after (sampler epoch 2), and each rank's base seed for it."""
    states, following, seeds = [], {}, []
    for rank in range(OLD):
        sampler = DistributedSampler(Augmented(N), num_replicas=OLD, rank=rank, shuffle=True, seed=5)
        loader = make(sampler)
        list(loader)
        sampler.set_epoch(1)
        iterator = iter(loader)
        take(iterator, CUT)
        states.append(through_bytes(loader.state_dict()))
        list(iterator)
        sampler.set_epoch(2)
        iterator = iter(loader)
        seeds.append(loader.state_dict()["base_seed"])
        following.update(_samples(list(iterator)))
    return states, following, seeds


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 2-core worker-count warning
        return fn()


@pytest.mark.parametrize(("new", "batch_size"), [(3, 2), (4, 3)])
@pytest.mark.parametrize(("workers", "persistent"), _TOPOLOGIES)
@pytest.mark.parametrize("per_sample", [False, True])
def test_the_epoch_after_a_repartition_is_the_old_run_s_next_epoch(
    new: int, batch_size: int, workers: int, persistent: bool, per_sample: bool
) -> None:
    old_make = _factory(2, workers, persistent, per_sample)
    states, following, old_seeds = _quiet(lambda: _old_run(old_make))
    make = _factory(batch_size, workers, persistent, per_sample)
    got: dict[int, torch.Tensor] = {}
    for rank in range(new):
        loader = reshard(states, make, rank=rank, world_size=new, allow_mismatch=("batch_size",))
        assert loader.mode == "repartition"
        rest = iter(loader)  # the rest of epoch 1, from the old run's generator state then
        (inner,) = loader.loaders
        assert inner.num_workers == workers and inner.persistent_workers is persistent
        assert inner.batch_size == batch_size and inner.seed_per_sample is per_sample
        if not persistent:  # the old run's base seed for epoch 1 (persistent workers kept epoch 0's)
            assert inner.state_dict()["base_seed"] == states[rank % OLD]["base_seed"]
        _quiet(lambda: list(rest))
        loader.set_epoch(2)
        iterator = iter(loader)
        (inner,) = loader.loaders
        state = inner.state_dict()
        assert state["epoch"] == 2, "the next epoch is the old run's epoch 2"
        assert state["base_seed"] != states[rank % OLD]["base_seed"], "epoch 1's base seed again"
        if not persistent:  # persistent workers draw no base seed after the first epoch
            assert state["base_seed"] == old_seeds[rank % OLD], "another base seed than the old run's next epoch"
        got.update(_samples(_quiet(lambda: list(iterator))))
    assert sorted(got) == list(range(N))
    if per_sample:
        for index, row in following.items():
            assert torch.equal(got[index][1:], row[1:]), f"sample {index} of the next epoch differs from the old run's"


@pytest.mark.parametrize(("workers", "persistent"), _TOPOLOGIES)
def test_a_checkpoint_between_the_rest_and_the_next_epoch_keeps_the_continuation(workers: int, persistent: bool) -> None:
    old_make = _factory(2, workers, persistent, True)
    states, following, old_seeds = _quiet(lambda: _old_run(old_make))
    make = _factory(2, workers, persistent, True)
    saved = []
    for rank in range(3):
        loader = reshard(states, make, rank=rank, world_size=3)
        _quiet(lambda: list(loader))
        saved.append(through_bytes(loader.state_dict()))
    got: dict[int, torch.Tensor] = {}
    for rank in range(3):
        loader = reshard(saved, make, rank=rank, world_size=3)
        loader.set_epoch(2)
        iterator = iter(loader)
        if not persistent:
            assert loader.loaders[0].state_dict()["base_seed"] == old_seeds[rank]
        got.update(_samples(_quiet(lambda: list(iterator))))
    for index, row in following.items():
        assert torch.equal(got[index][1:], row[1:]), f"sample {index} differs"


def test_between_epochs_the_new_world_continues_the_generator() -> None:
    # The old ranks' checkpoints taken after their epoch 0 ended: no rest to read, the
    # next epoch at once, from the old run's generator state and epoch counter.
    make = _factory(2, 0, False, True)
    states, seeds, following = [], [], {}
    for rank in range(OLD):
        sampler = DistributedSampler(Augmented(N), num_replicas=OLD, rank=rank, shuffle=True, seed=5)
        loader = make(sampler)
        list(loader)
        sampler.set_epoch(1)
        list(loader)
        states.append(through_bytes(loader.state_dict()))
        sampler.set_epoch(2)
        iterator = iter(loader)
        seeds.append(loader.state_dict()["base_seed"])
        following.update(_samples(list(iterator)))
    got: dict[int, torch.Tensor] = {}
    for rank in range(3):
        loader = reshard(states, make, rank=rank, world_size=3)
        assert loader.epoch == 2
        loader.set_epoch(2)
        iterator = iter(loader)
        state = loader.loaders[0].state_dict()
        assert (state["epoch"], state["base_seed"]) == (2, seeds[rank])
        got.update(_samples(list(iterator)))
    for index, row in following.items():
        assert torch.equal(got[index][1:], row[1:]), f"sample {index} differs"


def test_the_continuation_is_checked_when_read_back() -> None:
    make = _factory(2, 0, False, True)
    states, _, _ = _old_run(make)
    loader = reshard(states, make, rank=0, world_size=3)
    state = loader.state_dict()
    source = state["rest"]["source"]
    assert Source.from_plain(source, "source").after == Continuation.of([snaploader._format.parse.parse(s) for s in states])
    bad: list[tuple[Any, str]] = [
        ({**source["after"], "epoch": "1"}, r"\['after'\]\['epoch'\] should be an int"),
        ({**source["after"], "sample_root": -1}, r"\['after'\]\['sample_root'\] should be None or an int"),
        ({**source["after"], "rngs": ["AAAA"]}, r"\['after'\]\['rngs'\]\[0\] is not a generator state"),
        ({**source["after"], "rngs": [source["after"]["rngs"][0]] * 2}, r"\['after'\]\['rngs'\] should be a list of 0, 1 or 4"),
        ({**source["after"], "starts": "x"}, r"\['after'\]\['starts'\] should be a list"),
        ({"epoch": 0}, r"\['after'\] should be a dict"),
    ]
    for after, error in bad:
        with pytest.raises(snaploader.CheckpointFormatError, match=error):
            Source.from_plain({**source, "after": after}, "source")
    older = {key: value for key, value in source.items() if key != "after"}
    assert Source.from_plain(older, "source").after is None
