"""``loader.epoch``: the epoch under way, or the one the next ``iter()`` yields, so that
``for epoch in range(loader.epoch, epochs)`` resumes the right epoch from a checkpoint
taken at any moment (docs/api.md)."""

from __future__ import annotations

import pytest

import snaploader

from ._datasets import Range
from ._iterable_datasets import IteratorStateStream


def _loader(kind: str, workers: int, persistent: bool) -> snaploader.DataLoader[int]:
    dataset = Range(8) if kind == "map" else IteratorStateStream(8)
    return snaploader.DataLoader(dataset, batch_size=2, num_workers=workers, persistent_workers=persistent)


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_the_epoch_before_during_after_and_after_a_load(kind: str, workers: int, persistent: bool) -> None:
    loader = _loader(kind, workers, persistent)
    states = {"before": loader.state_dict()}
    assert loader.epoch == 0
    for _ in range(2):
        iterator = iter(loader)
        epoch = loader.epoch
        next(iterator)
        assert loader.epoch == epoch  # under way
        states[f"mid{epoch}"] = loader.state_dict()
        list(iterator)
        assert loader.epoch == epoch + 1  # ended: the next iter() yields the next one
        states[f"end{epoch}"] = loader.state_dict()
    expected = {"before": 0, "mid0": 0, "end0": 1, "mid1": 1, "end1": 2}
    for name, state in states.items():
        again = _loader(kind, workers, persistent)
        again.load_state_dict(state)
        assert again.epoch == expected[name], name
        # and the loop that starts there runs the epochs the uninterrupted one had left
        epochs = 0
        for _ in range(again.epoch, 3):
            list(again)
            epochs += 1
        assert epochs == 3 - expected[name] and again.epoch == 3, name


def test_the_epoch_is_read_only() -> None:
    with pytest.raises(AttributeError):
        _loader("map", 0, False).epoch = 3  # type: ignore[misc]
