"""A snaploader DataLoader nested in an iterable dataset whose state protocol hands off
to it resumes exactly (issue 32, item 3): the dataset's load_state_dict() runs before
iter(dataset), its iterator's after (torchdata's order), and a load into a loader
whose iterator next() was never called on goes on with that iterator
(docs/design.md, NOTE [ a load before the first next() ])."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

from snaploader import DataLoader

from ._iterable_datasets import PairStateStream
from ._support import assert_same_stream, generator, take, through_bytes

_TOPOLOGIES = [(0, False), (2, False), (2, True)]


class Nested(IterableDataset[torch.Tensor]):
    """Items of an inner shuffled snaploader loader, drawn lazily; its state is the
    inner loader's. ``returns_self``: ``__iter__`` makes the inner iterator and returns
    the dataset (its own iterator, whose state is then loaded after ``iter()``); else a
    generator over it (the dataset's state, loaded before ``iter()``)."""

    def __init__(self, returns_self: bool) -> None:
        self.inner = DataLoader(list(range(30)), batch_size=2, shuffle=True, generator=generator(3))
        self.returns_self = returns_self
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> Any:
        self._it = iter(self.inner)
        return self if self.returns_self else (batch for batch in self._it)

    def __next__(self) -> Any:
        assert self._it is not None
        return next(self._it)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])


def _loader(returns_self: bool, workers: int, persistent: bool) -> DataLoader:
    return DataLoader(Nested(returns_self), batch_size=None, num_workers=workers, persistent_workers=persistent)


def _epochs(loader: DataLoader, count: int) -> list[list[Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the inner generator's same-state warning at 2 workers
        return [list(loader) for _ in range(count)]


@pytest.mark.parametrize("returns_self", [True, False])
@pytest.mark.parametrize(("workers", "persistent"), _TOPOLOGIES)
def test_a_nested_loader_resumes_its_epoch_and_the_next(returns_self: bool, workers: int, persistent: bool) -> None:
    expected = _epochs(_loader(returns_self, workers, persistent), 3)
    saved = _loader(returns_self, workers, persistent)
    assert saved.num_workers == workers and saved.persistent_workers is persistent
    _epochs(saved, 1)
    iterator = iter(saved)
    before = take(iterator, 5)
    state = through_bytes(saved.state_dict())
    del iterator
    resumed = _loader(returns_self, workers, persistent)
    resumed.load_state_dict(state)
    got = _epochs(resumed, 2)
    assert_same_stream(before + got[0], expected[1], "epoch 1")
    assert_same_stream(got[1], expected[2], "epoch 2")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_load_before_the_first_next_goes_on_in_that_iterator(workers: int) -> None:
    expected = list(DataLoader(list(range(12)), batch_size=2, shuffle=True, num_workers=workers, generator=generator(4)))
    saved = DataLoader(list(range(12)), batch_size=2, shuffle=True, num_workers=workers, generator=generator(4))
    iterator = iter(saved)
    take(iterator, 2)
    state = saved.state_dict()
    del iterator
    loader = DataLoader(list(range(12)), batch_size=2, shuffle=True, num_workers=workers, generator=generator(4))
    untouched, touched = iter(loader), None
    loader.load_state_dict(state)
    assert_same_stream(list(untouched), expected[2:])
    touched = iter(loader)
    next(touched)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match="invalidated by load_state_dict"):
        next(touched)
    assert_same_stream(list(loader), expected[2:])


@pytest.mark.parametrize(("workers", "persistent"), _TOPOLOGIES)
def test_a_dataset_and_its_iterator_both_with_a_state_resume_in_torchdata_s_order(workers: int, persistent: bool) -> None:
    def make() -> DataLoader:
        return DataLoader(PairStateStream(), batch_size=2, num_workers=workers, persistent_workers=persistent, generator=generator(2))

    expected = _epochs(make(), 3)
    saved = make()
    assert saved.num_workers == workers and saved.persistent_workers is persistent
    _epochs(saved, 1)
    iterator = iter(saved)
    before = take(iterator, 2)
    state = through_bytes(saved.state_dict())
    del iterator
    owners = {ledger["yielded"]["data_owner"] for ledger in state["workers"] if ledger["yielded"]}
    assert owners == {"both"}
    resumed = make()
    resumed.load_state_dict(state)
    got = _epochs(resumed, 2)
    assert_same_stream(before + got[0], expected[1], "epoch 1")
    assert_same_stream(got[1], expected[2], "epoch 2")
