"""Drop-in equivalence: with the same arguments and seed, snaploader yields exactly
what torch.utils.data.DataLoader yields, and num_workers=0 is worker 0 of a
one-worker loader whose RNG never touches the training loop's."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import snaploader
from snaploader._epoch.iterator import SnapIterator

from ._datasets import Augmented, Range, WorkerInfoProbe, draws_in_init, sum_collate
from ._support import assert_same_stream, generator

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

Factory = Callable[[], dict[str, Any]]
# Each example starts worker processes; shrinking a failure would start hundreds.
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def _worker_pids(iterator: Any) -> frozenset[int]:
    if isinstance(iterator, SnapIterator):
        return frozenset(iterator.worker_pids)
    return frozenset(w.pid for w in getattr(iterator, "_workers", []))  # torch's


def _run(
    cls: type[torch.utils.data.DataLoader],
    make: Factory,
    epochs: int = 2,
    global_seed: int | None = None,
    before_epoch: Callable[[Any, int], None] | None = None,
) -> tuple[list[list[Any]], torch.utils.data.DataLoader, list[frozenset[int]], Any]:
    """``epochs`` epochs of a loader of class ``cls`` built from ``make()``. Returns the
    batches, the loader, the worker pids seen in each epoch and the global torch RNG
    state at the end (when ``global_seed`` seeds it before the loader is built)."""
    if global_seed is not None:
        torch.manual_seed(global_seed)
    kwargs = make()
    dataset = kwargs.pop("dataset")
    loader = cls(dataset, **kwargs)
    out, pids = [], []
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(loader, epoch)
        iterator = iter(loader)
        pids.append(_worker_pids(iterator))
        out.append(list(iterator))
        del iterator
    return out, loader, pids, torch.get_rng_state() if global_seed is not None else None


def _compare(make: Factory, epochs: int = 2, global_seed: int | None = None,
             before_epoch: Callable[[Any, int], None] | None = None) -> snaploader.DataLoader:
    theirs, _, _, their_rng = _run(torch.utils.data.DataLoader, make, epochs, global_seed, before_epoch)
    ours, loader, pids, our_rng = _run(snaploader.DataLoader, make, epochs, global_seed, before_epoch)
    assert sum(map(len, theirs)) > 0
    for epoch in range(epochs):
        assert_same_stream(ours[epoch], theirs[epoch], f"epoch {epoch}")
    if global_seed is not None:  # the training loop's RNG sees the same draws
        assert torch.equal(our_rng, their_rng)
    assert isinstance(loader, snaploader.DataLoader)
    if loader.num_workers > 0:  # persistent_workers reached the loader's pool
        assert all(len(p) == loader.num_workers for p in pids), pids
        if loader.persistent_workers:
            assert len(set(pids)) == 1, pids
        else:
            assert not set.intersection(*map(set, pids)), pids
    return loader


pytestmark = [pytestmark, pytest.mark.usefixtures("keep_global_rngs")]  # both marks, not the last one only


_configs = st.fixed_dictionaries(
    {
        "n": st.integers(20, 60),
        "batch_size": st.integers(1, 6),
        "num_workers": st.integers(1, 3),
        "persistent_workers": st.booleans(),
        "drop_last": st.booleans(),
        "prefetch_factor": st.sampled_from([None, 1, 2, 3, 4]),
        "shuffle": st.booleans(),
        "seed": st.integers(0, 2**40),
        "given_generator": st.booleans(),
        "init": st.booleans(),
    }
)


@settings(max_examples=15, deadline=None, phases=_NO_SHRINK)
@given(config=_configs)
def test_matches_torch(config: dict[str, Any]) -> None:
    seed = config["seed"]

    def make() -> dict[str, Any]:
        return dict(
            dataset=Augmented(config["n"]),
            batch_size=config["batch_size"],
            shuffle=config["shuffle"],
            num_workers=config["num_workers"],
            drop_last=config["drop_last"],
            persistent_workers=config["persistent_workers"],
            prefetch_factor=config["prefetch_factor"],
            worker_init_fn=draws_in_init if config["init"] else None,
            generator=generator(seed) if config["given_generator"] else None,
        )

    loader = _compare(make, global_seed=None if config["given_generator"] else seed % 2**32)
    assert loader.num_workers == config["num_workers"]
    assert loader.persistent_workers == config["persistent_workers"]
    assert loader.drop_last == config["drop_last"]
    assert loader.batch_size == config["batch_size"]
    assert isinstance(loader.sampler, RandomSampler if config["shuffle"] else SequentialSampler)
    prefetch = config["prefetch_factor"] or 2
    assert loader.prefetch_factor == prefetch
    # the prefetch depth reaches the iterator: after the first batch, the loader keeps
    # prefetch_factor batches in flight per worker, as torch does
    iterator = iter(loader)
    next(iterator)
    batches = len(loader)
    assert iterator.settings.prefetch == prefetch
    assert iterator.dispatched == min(batches, 1 + prefetch * config["num_workers"])
    del iterator


def _sampler_cases() -> dict[str, Callable[[int], dict[str, Any]]]:
    n = 30

    def weights() -> list[float]:
        return [float(i % 5 + 1) for i in range(n)]

    return {
        "sequential": lambda s: dict(sampler=SequentialSampler(range(n))),
        "random": lambda s: dict(sampler=RandomSampler(range(n), generator=generator(s))),
        "random_own_seed_from_loader_rng": lambda s: dict(sampler=RandomSampler(range(n))),
        "random_num_samples": lambda s: dict(sampler=RandomSampler(range(n), num_samples=2 * n + 1, generator=generator(s))),
        "random_replacement": lambda s: dict(sampler=RandomSampler(range(n), replacement=True, num_samples=n - 3, generator=generator(s))),
        "subset_random": lambda s: dict(sampler=SubsetRandomSampler(list(range(1, n, 3)), generator=generator(s))),
        "weighted": lambda s: dict(sampler=WeightedRandomSampler(weights(), n + 4, generator=generator(s))),
        "weighted_no_replacement": lambda s: dict(sampler=WeightedRandomSampler(weights(), n // 2, replacement=False, generator=generator(s))),
        "batch_sampler": lambda s: dict(batch_size=1, batch_sampler=BatchSampler(RandomSampler(range(n), generator=generator(s)), 4, drop_last=True)),
        "distributed": lambda s: dict(sampler=DistributedSampler(Range(n), num_replicas=3, rank=2, shuffle=True, seed=s, drop_last=False)),
        "distributed_drop_last": lambda s: dict(sampler=DistributedSampler(Range(n + 1), num_replicas=4, rank=1, shuffle=True, seed=s, drop_last=True)),
    }


# Samplers without a generator of their own draw from the loader's RNG: those are run
# both with a generator and with generator=None under the same global seed.
_SAMPLER_RUNS = [(case, True) for case in _sampler_cases()] + [
    (case, False) for case in ("random_own_seed_from_loader_rng", "batch_sampler", "distributed")
]


@pytest.mark.parametrize(("case", "given_generator"), _SAMPLER_RUNS)
def test_every_sampler_matches_torch(case: str, given_generator: bool) -> None:
    seed = 11

    def make() -> dict[str, Any]:
        # persistent workers: half the process starts of two epochs
        kwargs: dict[str, Any] = dict(dataset=Augmented(31), batch_size=3, num_workers=2,
                                      persistent_workers=True,
                                      generator=generator(seed) if given_generator else None)
        kwargs.update(_sampler_cases()[case](seed))
        return kwargs

    def set_epoch(loader: Any, epoch: int) -> None:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)

    # the global seed too: a sampler without a generator draws its own seed from it
    loader = _compare(make, global_seed=seed, before_epoch=set_epoch)
    expected_sampler = make().get("sampler")
    if expected_sampler is not None:
        assert type(loader.sampler) is type(expected_sampler)
    else:
        assert isinstance(loader.batch_sampler, BatchSampler) and loader.batch_sampler.batch_size == 4
    if case.startswith("distributed"):
        assert loader.sampler.epoch == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_custom_collate_and_unbatched_match_torch(num_workers: int) -> None:
    def collated() -> dict[str, Any]:
        return dict(dataset=Augmented(23), batch_size=4, shuffle=True, num_workers=num_workers,
                    collate_fn=sum_collate, generator=generator(5))

    loader = _compare(collated)
    assert loader.collate_fn is not torch.utils.data.default_collate

    def unbatched() -> dict[str, Any]:
        return dict(dataset=Augmented(23), batch_size=None, shuffle=True, num_workers=num_workers,
                    worker_init_fn=draws_in_init, generator=generator(6))

    loader = _compare(unbatched)
    assert loader.batch_size is None and not loader._auto_collation


def test_worker_info_answers_in_workers_as_torch() -> None:
    def make() -> dict[str, Any]:
        return dict(dataset=WorkerInfoProbe(25), batch_size=2, num_workers=3, generator=generator(8))

    theirs = _run(torch.utils.data.DataLoader, make, epochs=1)[0][0]
    ours = _run(snaploader.DataLoader, make, epochs=1)[0][0]
    assert_same_stream(ours, theirs)
    for k, batch in enumerate(ours):
        for row in batch.tolist():
            _, torch_id, our_id, num_workers, _, same_dataset = row
            assert torch_id == our_id == k % 3 and num_workers == 3 and same_dataset == 1
    assert snaploader.get_worker_info() is None  # and nothing leaks into the main process


# -- num_workers=0 ---------------------------------------------------------------------


@settings(max_examples=10, deadline=None, phases=_NO_SHRINK)
@given(
    seed=st.integers(0, 2**32 - 1),
    shuffle=st.booleans(),
    batch_size=st.sampled_from([None, 1, 3, 5]),
    init=st.booleans(),
    given_generator=st.booleans(),
)
def test_num_workers_0_is_worker_0_of_one(seed: int, shuffle: bool, batch_size: int | None,
                                          init: bool, given_generator: bool) -> None:
    # torch's contract at num_workers=0 (no worker info, no worker_init_fn), with the
    # data's RNG states seeded like worker 0's: for a dataset that does not ask
    # get_worker_info(), the stream is num_workers=1's without its worker_init_fn.
    def make(num_workers: int, with_init: bool) -> Factory:
        return lambda: dict(dataset=Augmented(21), batch_size=batch_size, shuffle=shuffle,
                            num_workers=num_workers, worker_init_fn=draws_in_init if with_init else None,
                            generator=generator(seed) if given_generator else None)

    global_seed = None if given_generator else seed
    zero, loader, _, zero_rng = _run(snaploader.DataLoader, make(0, init), 2, global_seed)
    one, _, _, one_rng = _run(snaploader.DataLoader, make(1, False), 2, global_seed)
    assert loader.num_workers == 0 and loader.batch_size == batch_size
    for epoch in range(2):
        assert_same_stream(zero[epoch], one[epoch], f"epoch {epoch}")
    if global_seed is not None:
        assert torch.equal(zero_rng, one_rng)
    info = WorkerInfoProbe(5)
    probe = next(iter(snaploader.DataLoader(info, batch_size=5, num_workers=0)))
    assert probe[:, 1:].tolist() == [[-1] * 5] * 5  # no worker info, from either API


def _loop_draws() -> list[Any]:
    return [torch.rand(2).tolist(), float(np.random.standard_normal()), random.gauss(0.0, 1.0),
            random.random(), float(np.random.random_sample())]


@pytest.mark.parametrize("given_generator", [True, False], ids=["generator", "global"])
def test_num_workers_0_and_the_training_loop_rng_do_not_disturb_each_other(given_generator: bool) -> None:
    def run(num_workers: int | None) -> tuple[list[Any], list[Any]]:
        random.seed(1)
        np.random.seed(1)
        torch.manual_seed(1)
        draws: list[Any] = []
        batches: list[Any] = []
        if num_workers is None:  # the loop without any loader
            for _ in range(2 * 7):
                draws.append(_loop_draws())
            return batches, draws
        loader = snaploader.DataLoader(
            Augmented(20), batch_size=3, shuffle=True, num_workers=num_workers,
            # no worker_init_fn: num_workers=0 runs none, as torch's does
            generator=generator(4) if given_generator else None,
        )
        for _ in range(2):
            for batch in loader:
                batches.append(batch)
                draws.append(_loop_draws())  # the training loop's own draws (dropout, ...)
        return batches, draws

    zero_batches, zero_draws = run(0)
    one_batches, one_draws = run(1)
    assert len(zero_batches) == 14
    # the stream is the one a worker process produces, whatever the loop draws
    assert_same_stream(zero_batches, one_batches)
    # the loop draws what it draws with the dataset running in a worker process
    assert zero_draws == one_draws
    if given_generator:  # ... and what it draws without a loader at all
        assert zero_draws == run(None)[1]


def test_num_workers_0_batches_stay_out_of_shared_memory() -> None:
    # As with torch: in the main process a batch is ordinary memory, not an fd and
    # /dev/shm space per live batch (that runs out of fds for a loop keeping batches).
    for batch_size in (3, None):
        theirs = next(iter(torch.utils.data.DataLoader(Augmented(6), batch_size=batch_size)))
        ours = next(iter(snaploader.DataLoader(Augmented(6), batch_size=batch_size)))
        assert not theirs.is_shared() and not ours.is_shared()
    # and so do logical workers hosted in the main process, while their dataset sees
    # itself as worker 0 of 1 (num_workers=0 itself gives no worker info, as torch)
    hosted = snaploader.DataLoader(Augmented(6), batch_size=3, num_workers=0, logical_workers=1)
    assert not next(iter(hosted)).is_shared()
    probe = next(iter(snaploader.DataLoader(WorkerInfoProbe(2), batch_size=2, logical_workers=1)))
    assert probe[:, 1:4].tolist() == [[0, 0, 1]] * 2


# -- batches that are not plain tensors -------------------------------------------------


def _nested_collate(items: list[int]) -> dict[str, torch.Tensor]:
    # Ragged rows (row i has i % 3 + 1 values), as a model with variable lengths takes
    # them; plus a complex conjugate view and a negative-bit view, which are not their
    # raw bytes either.
    rows = [torch.arange(i % 3 + 1, dtype=torch.float32) + i for i in items]
    values = torch.tensor([complex(i, -i) for i in items])
    return {"nested": torch.nested.nested_tensor(rows), "conj": values.conj(), "neg": values.conj().imag}


def _as_plain(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "nested": list(batch["nested"].unbind()),
        "conj": batch["conj"].resolve_conj(),
        "neg": batch["neg"].resolve_neg(),
    }


def test_nested_tensor_batches_travel_as_torchs_do() -> None:
    kwargs: dict[str, Any] = dict(batch_size=4, num_workers=2, collate_fn=_nested_collate)
    got = list(snaploader.DataLoader(Range(10), **kwargs))
    expected = list(torch.utils.data.DataLoader(Range(10), **kwargs))
    assert all(batch["nested"].is_nested for batch in got)
    assert_same_stream([_as_plain(b) for b in got], [_as_plain(b) for b in expected])
