"""The restore plan (``snaploader._format.restore``): every checkpoint error is raised
by ``load_state_dict()``, before the loader changes, never later at ``iter()``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import IterableDataset
from torch.utils.data.datapipes.iter import IterableWrapper

import snaploader

from ._datasets import Augmented
from ._support import assert_same_stream, generator, take, through_bytes

def _loader(workers: int) -> snaploader.DataLoader:
    return snaploader.DataLoader(Augmented(24), batch_size=4, shuffle=True, num_workers=workers, generator=generator(5))

def _mid_epoch(workers: int) -> dict[str, Any]:
    loader = _loader(workers)
    it = iter(loader)
    take(it, 2)
    state = through_bytes(loader.state_dict())
    del it
    return state

class _Counting(IterableDataset[int]):
    """An iterable of the same items as ``IterableWrapper(range(20))``, not a DataPipe."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(20))

@pytest.mark.parametrize("workers", [0, 2])
def test_a_datapipes_checkpoint_in_a_loader_of_another_iterable_is_refused_at_load(workers: int) -> None:
    # An IterDataPipe's epoch draws a shared seed before its base seed; another
    # iterable's does not, so its fingerprint alike, it cannot draw the epoch again.
    pipe = snaploader.DataLoader(IterableWrapper(range(20)), batch_size=2, num_workers=workers, generator=generator(1))
    it = iter(pipe)
    take(it, 2)
    state = through_bytes(pipe.state_dict())
    del it
    loader = snaploader.DataLoader(_Counting(), batch_size=2, num_workers=workers, generator=generator(1))
    with pytest.raises(snaploader.CheckpointFormatError, match=r"state\['shared_seed'\] says the checkpoint was taken with an IterDataPipe"):
        loader.load_state_dict(state)
    # The refused load left the loader as it was: it starts afresh.
    fresh = snaploader.DataLoader(_Counting(), batch_size=2, num_workers=workers, generator=generator(1))
    assert_same_stream(list(loader), list(fresh), "after a refused load")

@pytest.mark.parametrize("workers", [0, 2])
def test_a_refused_skip_leaves_the_loader_as_it_was(workers: int) -> None:
    state = _mid_epoch(workers)
    loader = _loader(workers)
    before = loader.state_dict()
    with pytest.raises(ValueError, match="goes past the epoch's end"):
        loader.load_state_dict(state, skip=100)
    assert loader.state_dict() == before
    loader.load_state_dict(state)
    resumed = _loader(workers)
    resumed.load_state_dict(state)
    assert_same_stream(list(loader), list(resumed), "loaded after a refused skip")
