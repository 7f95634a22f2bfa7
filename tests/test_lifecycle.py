"""A loader outside its epochs (snaploader/_lifecycle.py): it pickles (plain pickle and
cloudpickle) without its iterators and workers, and the copy's stream goes on where the
original's next ``iter()`` would; ``shutdown_workers()`` ends every worker, and so does
the ``_iterator = None`` that frameworks use on torch's loader. Lightning's side of both
is in tests/test_lightning_dropin.py."""

from __future__ import annotations

import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle
import pytest
import torch

import snaploader

_DUMPS: dict[str, Callable[[Any], bytes]] = {"pickle": pickle.dumps, "cloudpickle": cloudpickle.dumps}


def _loader(num_workers: int, persistent: bool = False) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        list(range(24)), batch_size=2, shuffle=True, num_workers=num_workers,
        persistent_workers=persistent, generator=torch.Generator().manual_seed(1),
    )


def _batches(iterable: Any) -> list[list[int]]:
    return [batch.tolist() for batch in iterable]


def _copy(loader: snaploader.DataLoader, how: str) -> snaploader.DataLoader:
    copy = pickle.loads(_DUMPS[how](loader))
    assert type(copy) is snaploader.DataLoader
    return copy


_CASES = pytest.mark.parametrize("num_workers, persistent", [(0, False), (2, False), (2, True)], ids=["0w", "2w", "2w-persistent"])
_HOW = pytest.mark.parametrize("how", sorted(_DUMPS))


@_CASES
@_HOW
def test_a_new_loader_pickles_and_yields_the_same_epochs(num_workers: int, persistent: bool, how: str) -> None:
    original = _loader(num_workers, persistent)
    copy = _copy(original, how)
    expected = [_batches(original), _batches(original)]
    assert [_batches(copy), _batches(copy)] == expected
    original.shutdown_workers()
    copy.shutdown_workers()


@_CASES
@_HOW
def test_a_loaded_state_not_yet_used_goes_with_the_copy(num_workers: int, persistent: bool, how: str) -> None:
    reference = _loader(num_workers, persistent)
    whole = _batches(reference) + _batches(reference)
    taken = _loader(num_workers, persistent)
    iterator = iter(taken)
    for _ in range(5):
        next(iterator)
    state = taken.state_dict()
    del iterator
    resumed = _loader(num_workers, persistent)
    resumed.load_state_dict(state)
    copy = _copy(resumed, how)
    assert copy.state_dict() == resumed.state_dict() == state
    assert copy.batches_remaining() == 7
    assert _batches(copy) + _batches(copy) == whole[5:]
    for loader in (reference, taken, resumed, copy):
        loader.shutdown_workers()


@_CASES
@_HOW
def test_a_loader_pickled_mid_epoch_goes_on_as_the_original(num_workers: int, persistent: bool, how: str) -> None:
    # The copy has no iterator: its next iter() is the one the original's would be (the
    # next epoch, with persistent workers' carried states), as with torch's loader.
    original = _loader(num_workers, persistent)
    iterator = iter(original)
    for _ in range(3):
        next(iterator)
    copy = _copy(original, how)
    assert copy.state_dict() == original.state_dict()
    assert next(iterator) is not None  # the original's iterator is untouched
    assert _batches(copy) + _batches(copy) == _batches(original) + _batches(original)
    original.shutdown_workers()
    copy.shutdown_workers()


@_CASES
@_HOW
def test_an_iterator_does_not_pickle_as_torch_s_does_not(num_workers: int, persistent: bool, how: str) -> None:
    # Lightning's CombinedLoader test asks for torch's NotImplementedError, and pickling
    # a frame that holds an iterator must fail, not copy live workers; the loader pickles.
    reference = _batches(_loader(num_workers, persistent))
    loader = _loader(num_workers, persistent)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(NotImplementedError, match="cannot be pickled"):
        _DUMPS[how](iterator)
    assert _batches(iterator) == reference[1:]  # the failed attempt changed nothing
    loader.shutdown_workers()


def _workers() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("snaploader-worker")]


@pytest.mark.parametrize("how", ["shutdown_workers", "_iterator"])
def test_shutdown_ends_persistent_workers_and_the_stream_goes_on(how: str) -> None:
    # Ending the workers abandons the epoch under way, as dropping its iterator does.
    reference = _loader(2, persistent=True)
    first = _batches(reference)
    abandoned = iter(reference)
    next(abandoned)
    expected = first + _batches(reference)
    reference.shutdown_workers()
    loader = _loader(2, persistent=True)
    assert _batches(loader) == first
    iterator = iter(loader)
    next(iterator)
    assert _workers()
    if how == "shutdown_workers":
        loader.shutdown_workers()
    else:
        assert loader._iterator is iterator  # torch's name for the persistent iterator
        loader._iterator = None  # what Lightning's teardown does
    assert not _workers()
    with pytest.raises(RuntimeError, match="shutdown_workers"):
        next(iterator)
    assert first + _batches(loader) == expected
    loader.shutdown_workers()
    assert not _workers()


def test_shutdown_of_a_loader_without_workers_does_nothing() -> None:
    loader = _loader(0)
    loader.shutdown_workers()
    assert len(_batches(loader)) == 12
