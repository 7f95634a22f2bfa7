"""Iterable datasets for ``test_iterable.py``.

They live in an importable module so that workers started by ``spawn`` and
``forkserver`` (and the fresh child process of ``_iterable_child.py``) can unpickle
them by reference.

Every sample draws from the three global RNGs (Python ``random``, NumPy's legacy
global generator and torch's), so a worker that did not restore its RNG state on
resume changes the stream. Sharding goes through ``get_worker_info()`` as with torch:
either ``range(worker, n, num_workers)`` (``n`` given: equal shards when ``n`` is a
multiple of the worker count) or ``sizes[worker]`` items for worker ``worker``
(unequal shards).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


def shard(n: int | None, sizes: tuple[int, ...] | None) -> list[int]:
    """The sample ids of the calling worker (the whole range in the main process)."""
    info = get_worker_info()
    worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
    if sizes is not None:
        return [1000 * worker + j for j in range(sizes[worker])]
    assert n is not None
    return list(range(worker, n, workers))


def sample(i: int, offset: float = 0.0) -> torch.Tensor:
    """Sample ``i`` with augmentations from all three global RNGs."""
    return torch.tensor(
        [float(i), offset, random.random(), float(np.random.rand()), float(torch.rand(()))],
        dtype=torch.float64,
    )


class PlainStream(IterableDataset[torch.Tensor]):
    """A generator function, no state protocol: resume replays from the epoch start."""

    def __init__(self, n: int | None = None, sizes: tuple[int, ...] | None = None) -> None:
        self.n = n
        self.sizes = sizes

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in shard(self.n, self.sizes):
            yield sample(i)


class PidStream(IterableDataset[torch.Tensor]):
    """Sample ``i`` is ``[i, pid of the process that made it]``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in shard(self.n, None):
            yield torch.tensor([i, os.getpid()])


class MisreportedLength(PlainStream):
    """:class:`PlainStream` whose ``__len__`` says ``reported`` samples."""

    def __init__(self, n: int, reported: int) -> None:
        super().__init__(n)
        self.reported = reported

    def __len__(self) -> int:
        return self.reported


class SlowWorkerStream(IterableDataset[torch.Tensor]):
    """:class:`PlainStream` with unequal shards in which worker ``slow`` sleeps
    ``delay_s`` before every sample: the order of the stream must not notice."""

    def __init__(self, sizes: tuple[int, ...], slow: int, delay_s: float) -> None:
        self.sizes = sizes
        self.slow = slow
        self.delay_s = delay_s

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        slow = info is not None and info.id == self.slow
        for i in shard(None, self.sizes):
            if slow:
                time.sleep(self.delay_s)
            yield sample(i)


class _PositionIterator:
    """An iterator with torchdata's protocol: its position and the offset it drew from
    torch's global RNG when it was made (so ``iter()`` itself consumes randomness)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.pos = 0
        self.offset = float(torch.randint(0, 1000, ()))

    def __iter__(self) -> _PositionIterator:
        return self

    def __next__(self) -> torch.Tensor:
        if self.pos >= len(self.ids):
            raise StopIteration
        i = self.ids[self.pos]
        self.pos += 1
        return sample(i, self.offset)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])
        self.offset = float(state["offset"])


class IteratorStateStream(IterableDataset[torch.Tensor]):
    """``iter()`` returns an iterator with ``state_dict()``/``load_state_dict()``."""

    def __init__(self, n: int | None = None, sizes: tuple[int, ...] | None = None) -> None:
        self.n = n
        self.sizes = sizes

    def __iter__(self) -> _PositionIterator:
        return _PositionIterator(shard(self.n, self.sizes))


class DatasetStateStream(IterableDataset[torch.Tensor]):
    """The dataset itself has the protocol: a cursor into its shard that the generator
    advances; a pass that reaches the end resets it, so the next ``iter()`` (the next
    epoch) starts over, while a cursor restored mid-epoch continues where it was."""

    def __init__(self, n: int | None = None, sizes: tuple[int, ...] | None = None) -> None:
        self.n = n
        self.sizes = sizes
        self.pos = 0
        self.passes = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        ids = shard(self.n, self.sizes)
        while self.pos < len(ids):
            i = ids[self.pos]
            self.pos += 1
            yield sample(i, float(self.passes))
        self.pos = 0
        self.passes += 1

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "passes": self.passes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = int(state["pos"])
        self.passes = int(state["passes"])


class _OwnGeneratorIterator:
    """Shuffles its shard with its own ``np.random.Generator``, seeded from torch's
    global RNG when made, and draws noise from it per sample; the generator's
    ``bit_generator.state`` (a dict of ints, one of them 128 bits) is in the state."""

    def __init__(self, ids: list[int]) -> None:
        self.rng = np.random.default_rng(int(torch.randint(0, 2**62, ())))
        self.ids = [ids[j] for j in self.rng.permutation(len(ids))]
        self.pos = 0

    def __iter__(self) -> _OwnGeneratorIterator:
        return self

    def __next__(self) -> torch.Tensor:
        if self.pos >= len(self.ids):
            raise StopIteration
        i = self.ids[self.pos]
        self.pos += 1
        return sample(i, float(self.rng.random()))

    def state_dict(self) -> dict[str, Any]:
        return {"ids": list(self.ids), "pos": self.pos, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ids = list(state["ids"])
        self.pos = int(state["pos"])
        self.rng.bit_generator.state = state["rng"]


class OwnGeneratorStream(IterableDataset[torch.Tensor]):
    def __init__(self, n: int | None = None, sizes: tuple[int, ...] | None = None) -> None:
        self.n = n
        self.sizes = sizes

    def __iter__(self) -> _OwnGeneratorIterator:
        return _OwnGeneratorIterator(shard(self.n, self.sizes))


class _BadStateIterator(_PositionIterator):
    def __init__(self, ids: list[int], bad: str) -> None:
        super().__init__(ids)
        self.bad = bad

    def state_dict(self) -> dict[str, Any]:
        value: Any = np.arange(3) if self.bad == "ndarray" else np.random.default_rng(0)
        return {"pos": self.pos, "extra": {"inner": value}}


class BadStateStream(IterableDataset[torch.Tensor]):
    """Its iterator's ``state_dict()`` holds ``state["extra"]["inner"]``: a NumPy array
    (``bad="ndarray"``) or a ``np.random.Generator`` (``bad="generator"``)."""

    def __init__(self, n: int, bad: str) -> None:
        self.n = n
        self.bad = bad

    def __iter__(self) -> _BadStateIterator:
        return _BadStateIterator(shard(self.n, None), self.bad)


class _ShuffleBufferIterator:
    """A shuffle buffer over the worker's shard, with its own ``random.Random``; its
    state is the whole buffer (a tensor, or a list with ``as_tensor=False``), the
    source position and the RNG's state."""

    def __init__(self, ids: list[int], buffer_size: int, as_tensor: bool) -> None:
        info = get_worker_info()
        self.rng = random.Random(0 if info is None else info.seed)
        self.ids = ids
        self.as_tensor = as_tensor
        self.source = min(buffer_size, len(ids))
        self.buffer = ids[: self.source]

    def __iter__(self) -> _ShuffleBufferIterator:
        return self

    def __next__(self) -> torch.Tensor:
        if not self.buffer:
            raise StopIteration
        j = self.rng.randrange(len(self.buffer))
        item = self.buffer[j]
        if self.source < len(self.ids):
            self.buffer[j] = self.ids[self.source]
            self.source += 1
        else:
            self.buffer[j] = self.buffer[-1]
            self.buffer.pop()
        return sample(item)

    def state_dict(self) -> dict[str, Any]:
        buffer: Any = torch.tensor(self.buffer, dtype=torch.int64) if self.as_tensor else list(self.buffer)
        version, words, gauss = self.rng.getstate()
        return {"source": self.source, "buffer": buffer, "rng": [version, list(words), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source = int(state["source"])
        buffer = state["buffer"]
        self.buffer = buffer.tolist() if isinstance(buffer, torch.Tensor) else list(buffer)
        version, words, gauss = state["rng"]
        self.rng.setstate((version, tuple(words), gauss))


class ShuffleBufferStream(IterableDataset[torch.Tensor]):
    """Each worker's shard through a ``buffer_size`` shuffle buffer whose state holds
    a tensor (``as_tensor``): tensors in a state travel through shared memory."""

    def __init__(
        self, n: int | None = None, sizes: tuple[int, ...] | None = None,
        buffer_size: int = 4, as_tensor: bool = True,
    ) -> None:
        self.n = n
        self.sizes = sizes
        self.buffer_size = buffer_size
        self.as_tensor = as_tensor

    def __iter__(self) -> _ShuffleBufferIterator:
        return _ShuffleBufferIterator(shard(self.n, self.sizes), self.buffer_size, self.as_tensor)


class _PairIterator:
    """An iterator with its own state: its position in the dataset's current shard."""

    def __init__(self, dataset: PairStateStream) -> None:
        self.dataset, self.pos = dataset, 0

    def __iter__(self) -> _PairIterator:
        return self

    def __next__(self) -> torch.Tensor:
        items = self.dataset.shard()
        if self.pos >= len(items):
            self.dataset.passes += 1  # this pass is over: the next iter() reads the next shard
            raise StopIteration
        self.pos += 1
        return torch.tensor([float(items[self.pos - 1]), torch.rand(()).item()])

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class PairStateStream(IterableDataset[torch.Tensor]):
    """torchdata's pair: the dataset's state (which pass it is on, read by __iter__) and
    its iterator's (where the pass stands), loaded before and after iter(dataset)."""

    def __init__(self, n: int = 7) -> None:
        self.n, self.passes = n, 0

    def shard(self) -> list[int]:
        return [100 * self.passes + i for i in range(self.n)]

    def __iter__(self) -> _PairIterator:
        return _PairIterator(self)

    def state_dict(self) -> dict[str, int]:
        return {"passes": self.passes}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.passes = state["passes"]
