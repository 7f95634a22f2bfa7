"""``seed_per_sample=True`` (docs/elastic.md, "Per-sample seeds"): a sample's random draws
are a function of (seed, epoch, index) alone, whatever the topology that reads it."""

from __future__ import annotations

import os
import random
import signal
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import snaploader
from snaploader import DataLoader
from snaploader._rng.per_sample import epoch_seed

from . import _iterable_datasets as ids
from ._datasets import Augmented
from ._support import assert_same_stream, generator, mp_helpers, take, through_bytes  # noqa: F401  (mp_helpers: a fixture)

N = 30
SEED = 7


class Held(Augmented):
    """Augmented's global draws, plus draws from generator objects the dataset holds
    (a NumPy Generator, a random.Random and a torch.Generator), all seeded alike."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.numpy_rng = np.random.default_rng(0)
        self.python_rng = random.Random(0)
        self.torch_rng = torch.Generator().manual_seed(0)

    def __getitem__(self, i: int) -> torch.Tensor:
        held = [
            float(self.numpy_rng.random()),
            self.python_rng.random(),
            float(torch.rand((), generator=self.torch_rng).item()),
        ]
        return torch.cat([super().__getitem__(i), torch.tensor(held, dtype=torch.float64)])


class Batched(Held):
    """The same samples read through ``__getitems__``."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


def _by_index(batches: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for batch in batches:
        for row in batch:
            index = int(row[0])
            assert index not in out, f"sample {index} yielded twice"
            out[index] = row
    return out


def _loader(dataset: Dataset[Any] | None = None, **kwargs: Any) -> DataLoader:
    kwargs.setdefault("batch_size", 4)
    return DataLoader(
        Held(N) if dataset is None else dataset, shuffle=True, generator=generator(SEED),
        seed_per_sample=True, **kwargs,
    )


def _assert_same_samples(got: dict[int, torch.Tensor], expected: dict[int, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected), "other samples"
    for index in expected:
        assert torch.equal(got[index], expected[index]), f"sample {index} differs:\n{got[index]}\n{expected[index]}"


@pytest.fixture(scope="module")
def reference() -> dict[int, torch.Tensor]:
    return _by_index(list(_loader(num_workers=0)))


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize(
    ("workers", "batch_size", "in_order", "kill"),
    [(1, 6, True, False), (3, 4, False, False), (3, 6, True, True), (0, 6, True, False)],
)
def test_each_sample_is_the_same_whatever_the_topology(
    reference: dict[int, torch.Tensor], mp_helpers: None, context: str, workers: int, batch_size: int,
    in_order: bool, kill: bool,
) -> None:
    if workers == 0 and context == "spawn":
        pytest.skip("num_workers=0 starts no process")
    extra = {} if workers == 0 else {"multiprocessing_context": context, "in_order": in_order}
    loader = _loader(num_workers=workers, batch_size=batch_size, **extra)
    assert loader.num_workers == workers and loader.batch_size == batch_size
    iterator = iter(loader)
    got = take(iterator, 1)
    if kill:
        os.kill(iterator.worker_pids[1], signal.SIGKILL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a respawn's warning, the 2-core worker-count warning
        got += list(iterator)
    _assert_same_samples(_by_index(got), reference)


def test_getitems_gets_the_samples_getitem_gets(reference: dict[int, torch.Tensor]) -> None:
    _assert_same_samples(_by_index(list(_loader(Batched(N), batch_size=5, num_workers=2))), reference)


def test_the_stream_is_not_the_one_without_the_option(reference: dict[int, torch.Tensor]) -> None:
    # Same order (the sampler draws as before), other draws: it cannot be torch's stream.
    plain = DataLoader(Held(N), batch_size=4, shuffle=True, generator=generator(SEED))
    without = _by_index(list(plain))
    assert sorted(without) == sorted(reference)
    assert not any(torch.equal(without[i][1:], reference[i][1:]) for i in reference)


def test_epochs_and_seeds_give_other_draws(reference: dict[int, torch.Tensor]) -> None:
    loader = _loader(num_workers=0)
    first, second = _by_index(list(loader)), _by_index(list(loader))
    _assert_same_samples(first, reference)
    assert not any(torch.equal(first[i][1:], second[i][1:]) for i in first)
    other = DataLoader(Held(N), batch_size=4, shuffle=True, generator=generator(SEED + 1), seed_per_sample=True)
    assert not any(torch.equal(row[1:], reference[int(row[0])][1:]) for batch in other for row in batch)


def _collate_with_draw(samples: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack(samples)
    return torch.cat([stacked, torch.rand(len(samples), 1, dtype=torch.float64)], dim=1)


def test_collate_fn_draws_depend_on_the_batch_only() -> None:
    # Seeded by (seed, epoch, batch index): the same for any workers or in_order, at
    # one batch size.
    def run(workers: int, **kwargs: Any) -> list[torch.Tensor]:
        loader = _loader(num_workers=workers, collate_fn=_collate_with_draw, **kwargs)
        return sorted(loader, key=lambda batch: int(batch[0, 0]))

    expected = run(0)
    assert_same_stream(run(2, in_order=False), expected)
    assert_same_stream(run(3), expected)


def test_a_resume_into_other_workers_keeps_every_sample(reference: dict[int, torch.Tensor]) -> None:
    saved = _loader(num_workers=2)
    iterator = iter(saved)
    before = take(iterator, 3)
    state = through_bytes(saved.state_dict())
    del iterator
    resumed = _loader(num_workers=1, logical_workers=3)
    resumed.load_state_dict(state)
    _assert_same_samples(_by_index(before + list(resumed)), reference)


def test_the_option_is_in_the_fingerprint() -> None:
    saved = _loader(num_workers=0)
    next(iter(saved))
    state = saved.state_dict()
    assert state["fingerprint"]["seed_per_sample"] is True
    plain = DataLoader(Held(N), batch_size=4, shuffle=True, generator=generator(SEED))
    with pytest.raises(snaploader.CheckpointMismatchError, match="seed_per_sample: True in checkpoint / False"):
        plain.load_state_dict(state)
    next(iter(plain))
    with pytest.raises(snaploader.CheckpointMismatchError, match="allow_mismatch=\\('seed_per_sample',\\)"):
        _loader(num_workers=0).load_state_dict(plain.state_dict())


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="seed_per_sample should be True or False"):
        DataLoader(Held(4), seed_per_sample=1)  # type: ignore[arg-type]


def test_an_iterable_resumes_exactly_with_the_option() -> None:
    # Items are seeded by (seed, epoch, logical worker, position): a replayed resume
    # (no state protocol) draws them again alike.
    def make(workers: int) -> DataLoader:
        return DataLoader(ids.PlainStream(n=21), batch_size=2, num_workers=workers, logical_workers=2,
                          generator=generator(SEED), replay="allow", seed_per_sample=True)

    expected = list(make(2))
    saved = make(2)
    iterator = iter(saved)
    before = take(iterator, 4)
    state = through_bytes(saved.state_dict())
    del iterator
    resumed = make(0)
    resumed.load_state_dict(state)
    assert_same_stream(before + list(resumed), expected)


def _epochs_by_index(loader: DataLoader, count: int) -> list[dict[int, torch.Tensor]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 2-core worker-count warning
        return [_by_index(list(loader)) for _ in range(count)]


@pytest.mark.parametrize(("workers", "persistent"), [(2, False), (2, True), (3, True)])
def test_every_epoch_draws_alike_whatever_persistent_workers(workers: int, persistent: bool) -> None:
    # Per-sample values are a function of (seed, epoch, index): persistent workers (one
    # base seed for the run) draw what a fresh iterator each epoch draws (issue 32, item 9).
    expected = _epochs_by_index(_loader(num_workers=0), 3)
    loader = _loader(num_workers=workers, persistent_workers=persistent)
    assert loader.num_workers == workers and loader.persistent_workers is persistent
    got = _epochs_by_index(loader, 3)
    for epoch, (mine, theirs) in enumerate(zip(got, expected)):
        assert sorted(mine) == sorted(theirs), f"epoch {epoch}: other samples"
        for index in theirs:
            assert torch.equal(mine[index][1:], theirs[index][1:]), f"epoch {epoch}, sample {index} differs"
    assert not any(torch.equal(got[0][i][1:], got[1][i][1:]) for i in got[0]), "epoch 1 repeats epoch 0"


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_resume_in_a_later_epoch_keeps_the_run_s_samples(workers: int, persistent: bool) -> None:
    # The root of the run's per-sample seeds travels in the checkpoint: a resume in
    # epoch 2 (and the epoch after it) draws every sample as the uninterrupted run.
    def make() -> DataLoader:
        return _loader(num_workers=workers, persistent_workers=persistent)

    expected = _epochs_by_index(make(), 4)
    saved = make()
    assert saved.num_workers == workers and saved.persistent_workers is persistent
    _epochs_by_index(saved, 2)
    iterator = iter(saved)
    before = take(iterator, 2)
    state = through_bytes(saved.state_dict())
    del iterator
    assert state["sample_root"] == _root_of(make())
    resumed = make()
    resumed.load_state_dict(state)
    got = _epochs_by_index(resumed, 2)
    got[0].update(_by_index(before))
    for epoch, mine in zip((2, 3), got):
        for index, row in expected[epoch].items():
            assert torch.equal(mine[index][1:], row[1:]), f"epoch {epoch}, sample {index} differs"


def _root_of(loader: DataLoader) -> int:
    iterator = iter(loader)
    next(iterator)
    root = loader.state_dict()["base_seed"]
    del iterator
    return int(root)


def test_a_checkpoint_without_a_root_resumes_its_epoch_with_that_epoch_s_seed() -> None:
    # Written before the root was recorded: the epoch's base seed is its root, the
    # seed that epoch drew its samples with then.
    saved = _loader(num_workers=0)
    list(saved)
    iterator = iter(saved)
    take(iterator, 2)
    state = saved.state_dict()
    del iterator
    assert state["sample_root"] != state["base_seed"]
    legacy = dict(state)
    del legacy["sample_root"]
    resumed = _loader(num_workers=0)
    resumed.load_state_dict(snaploader._format.checkpoint.resign(legacy))
    got = _by_index(list(resumed))
    old_rule = _loader(num_workers=0)
    old_rule._draw_with_sample_seed(sample_seed=epoch_seed(state["base_seed"], 1))
    expected = _by_index(list(old_rule))
    for index, row in got.items():
        assert torch.equal(row[1:], expected[index][1:]), f"sample {index} differs"
