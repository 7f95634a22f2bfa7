"""``ShardStream``: an iterable dataset over tar shards in the webdataset layout, whose
state is where it stands, so that a resume reads the shuffle buffer and one seek's
worth, not the epoch (docs/shards.md).

The epoch's order is a function of the epoch's base seed (torch's: every worker's seed
less its id, drawn by the loader from its generator once an epoch, the same in every
worker) and the shard list:

- the shards are permuted by a generator seeded with the base seed (``shuffle_shards``),
  then split as webdataset splits them: ranks first (``order[rank::world_size]``), then
  workers (``[worker::num_workers]``);
- each worker reads its shards in turn, sample by sample (``shards/tar.py``), into a
  shuffle buffer of ``shuffle_buffer`` samples, and yields a sample drawn from it by a
  counter-based generator of its own (its state is the count of draws);
- ``map`` runs on each yielded sample, in the worker; its draws from the global RNGs
  and from generator objects are snaploader's to capture, as for any dataset.

A worker's state (``ShardIterator.state_dict()``, plain data) holds the shard list's
fingerprint, the base seed and the split, the cursor in its list of work (``item``),
the offset of the next sample in the open shard (``offset``, with ``left`` samples to
read there, -1 for all), the buffered samples as ``[shard, offset]`` references and the
count of draws. A resume re-reads each buffered sample by one seek, and goes on reading
the open shard from ``offset``. The work is normally the worker's share of the epoch's
shards, derived from the seed and split; after a world-size change it is an explicit
list (``plan``, ``shards/resplit.py``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, Any, Final

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from .._errors import CheckpointMismatchError
from .files import Opener, default_open, open_shard
from .state import Split, Work, read_state
from .tar import samples

__all__ = ["ShardIterator", "ShardStream", "Work"]


_MASK64: Final = (1 << 64) - 1
_GOLDEN: Final = 0x9E3779B97F4A7C15
_ORDER_TAG: Final = 0x5348415244  # keeps the shard permutation's seed apart from others


def shards_fingerprint(urls: Sequence[str], shuffle: bool) -> str:
    """The shard list as a checkpoint names it: the count, a digest of the URLs in order,
    and whether the epochs shuffle them (either change moves every share)."""
    digest = hashlib.sha256("\n".join(urls).encode("utf-8", "surrogateescape")).hexdigest()
    return f"{len(urls)} shards, sha256 {digest[:16]}, {'shuffled' if shuffle else 'in order'}"


def epoch_seed() -> int:
    """The epoch's base seed as this worker sees it: torch's worker seed less the worker's
    id (the same in every worker of the epoch), or at ``num_workers=0`` the seed snaploader
    gave the main-process slot (worker 0's, so the same number)."""
    info = get_worker_info()
    if info is not None:
        return int(info.seed) - int(info.id)
    return int(torch.initial_seed())


def shard_order(count: int, seed: int, shuffle: bool) -> list[int]:
    """The epoch's order of the shards."""
    if not shuffle:
        return list(range(count))
    generator = np.random.default_rng([seed & _MASK64, seed >> 64, _ORDER_TAG])
    return [int(i) for i in generator.permutation(count)]


def deal(work: Sequence[Any], split: Split) -> list[Any]:
    """A worker's share of ``work``, as webdataset splits shards: by rank, then by worker."""
    rank, world, worker, workers = split
    return list(work[rank::world][worker::workers])


def epoch_plan(count: int, seed: int, shuffle: bool, split: Split) -> list[Work]:
    """A worker's work in an ordinary epoch: its whole shards, in the epoch's order."""
    return [(shard, 0, -1) for shard in deal(shard_order(count, seed, shuffle), split)]


def _splitmix(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _buffer_key(seed: int, split: Split) -> int:
    text = f"{seed}:{':'.join(map(str, split))}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


class ShardStream(IterableDataset[Any]):
    """Samples ``{"__key__", "__url__", ext: bytes}`` (or what ``map`` makes of them) of
    the tar shards ``urls``, shuffled per epoch and resumable in O(shuffle buffer).

    ``open(url)`` returns a seekable binary file (default: the built-in ``open`` for
    paths, ``fsspec.open`` for URLs). ``rank`` and ``world_size`` split the shards between
    ranks; by default torch.distributed's when it is initialized, else the ``RANK`` and
    ``WORLD_SIZE`` environment variables torchrun sets, else one rank."""

    def __init__(
        self,
        urls: Iterable[str | os.PathLike[str]],
        *,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        map: Callable[[dict[str, Any]], Any] | None = None,
        open: Opener | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if isinstance(urls, (str, bytes, os.PathLike)):
            raise TypeError("ShardStream takes a list of shard paths or URLs, not one string")
        self.urls = tuple(os.fspath(url) for url in urls)
        if not self.urls:
            raise ValueError("ShardStream needs at least one shard")
        if not isinstance(shuffle_buffer, int) or isinstance(shuffle_buffer, bool) or shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer should be an int >= 0 (samples), got {shuffle_buffer!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("give ShardStream both rank and world_size, or neither")
        if world_size is not None and not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
            raise ValueError(f"rank should be in [0, world_size), got rank={rank!r}, world_size={world_size!r}")
        self.shuffle_shards = bool(shuffle_shards)
        self.shuffle_buffer = shuffle_buffer
        self.map = map
        self.open: Opener = open if open is not None else default_open
        self.rank, self.world_size = rank, world_size
        self.fingerprint = shards_fingerprint(self.urls, self.shuffle_shards)
        # The rest of an epoch interrupted on another world size, dealt anew
        # (shards/resplit.py); None in an ordinary epoch.
        self.remainder: tuple[Work, ...] | None = None
        # The main process's world, read when the stream is pickled for a spawned
        # worker, where torch.distributed is not initialized (a forked one inherits it).
        self._world: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.world_size is None:
            state["_world"] = self.world()
        return state

    def world(self) -> tuple[int, int]:
        """(rank, world size) this stream splits its shards by."""
        if self.world_size is not None and self.rank is not None:
            return self.rank, self.world_size
        if self._world is not None:
            return self._world
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return 0, 1

    def split(self) -> Split:
        rank, world = self.world()
        info = get_worker_info()
        if info is None:
            return rank, world, 0, 1
        return rank, world, int(info.id), int(info.num_workers)

    def __iter__(self) -> ShardIterator:
        # The rest of an old epoch is read by this pass only: a persistent worker's copy
        # of the stream starts its next epoch afresh (the main process's copy is cleared
        # by ResplitLoader at the end of that epoch).
        remainder, self.remainder = self.remainder, None
        return ShardIterator(self, epoch_seed(), self.split(), remainder)

    def check_state(self, state: Any, owner: str) -> None:
        """snaploader's load-time check of a worker's state (``_state/records.py``'s
        ``check_own_states``): a state taken over other shards, or on another world
        size, is refused at ``load_state_dict()``, before any worker starts."""
        if owner == "iterator":
            read_state(state, self, (*self.world(), 0, 1))

    def __repr__(self) -> str:
        return f"ShardStream({self.fingerprint}, shuffle_buffer={self.shuffle_buffer})"


class ShardIterator:
    """One worker's pass over its share of an epoch, with its state (module docstring)."""

    def __init__(self, stream: ShardStream, seed: int, split: Split, remainder: tuple[Work, ...] | None = None) -> None:
        self.stream = stream
        self.seed, self.split = seed, split
        self.plan: list[Work] = deal(remainder, split) if remainder is not None else self._epoch_plan()
        self.explicit = remainder is not None
        self.item, self.offset, self.left = 0, -1, 0  # offset -1: the item is not started
        self.buffer: list[tuple[tuple[int, int], Any]] = []
        self.unread: list[tuple[int, int]] = []  # buffered references a resume has yet to read
        self.draws = 0
        self._key = _buffer_key(seed, split)
        self._file: IO[bytes] | None = None
        self._reader: Iterator[tuple[int, int, dict[str, Any]]] | None = None

    def _epoch_plan(self) -> list[Work]:
        s = self.stream
        return epoch_plan(len(s.urls), self.seed, s.shuffle_shards, self.split)

    def __iter__(self) -> ShardIterator:
        return self

    def __next__(self) -> Any:
        if self.unread:
            self._read_buffered()
        size = max(1, self.stream.shuffle_buffer)
        while len(self.buffer) < size:
            got = self._read_one()
            if got is None:
                break
            self.buffer.append(got)
        if not self.buffer:
            self.close()
            raise StopIteration
        if len(self.buffer) > 1:
            k = self._draw(len(self.buffer))
            self.buffer[k], self.buffer[-1] = self.buffer[-1], self.buffer[k]
        sample = self.buffer.pop()[1]
        mapped = self.stream.map
        return mapped(sample) if mapped is not None else sample

    def _draw(self, n: int) -> int:
        self.draws += 1
        return (_splitmix((self._key + self.draws * _GOLDEN) & _MASK64) * n) >> 64

    def _read_one(self) -> tuple[tuple[int, int], dict[str, Any]] | None:
        while self.item < len(self.plan):
            shard, first, count = self.plan[self.item]
            if self.offset < 0:
                self.offset, self.left = first, count
            if self.left != 0:
                if self._reader is None:
                    url = self.stream.urls[shard]
                    self._file = open_shard(self.stream.open, url)
                    self._reader = samples(self._file, url, self.offset, self.left)
                got = next(self._reader, None)
                if got is not None:
                    start, self.offset, sample = got
                    self.left -= self.left > 0
                    return (shard, start), sample
            self.close()
            self.item, self.offset, self.left = self.item + 1, -1, 0
        return None

    def _read_buffered(self) -> None:
        """The samples a checkpoint's buffer referenced, each read by one seek (one open per shard)."""
        by_shard: dict[int, list[int]] = {}
        for shard, offset in self.unread:
            by_shard.setdefault(shard, []).append(offset)
        read: dict[tuple[int, int], dict[str, Any]] = {}
        for shard, offsets in by_shard.items():
            url = self.stream.urls[shard]
            file = open_shard(self.stream.open, url)
            try:
                for offset in offsets:
                    found = next(samples(file, url, offset, 1), None)
                    if found is None or found[0] != offset:
                        raise CheckpointMismatchError(
                            f"the checkpoint's shuffle buffer refers to a sample at byte {offset} "
                            f"of shard {url}, and none starts there: the shard changed since the "
                            "checkpoint was taken; resume with the shards it was taken with"
                        )
                    read[shard, offset] = found[2]
            finally:
                file.close()
        self.buffer = [(ref, read[ref]) for ref in self.unread]
        self.unread = []

    def close(self) -> None:
        self._reader = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __del__(self) -> None:
        self.close()

    # -- the state protocol -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        refs = self.unread or [ref for ref, _ in self.buffer]
        return {
            "shards": self.stream.fingerprint,
            "seed": self.seed,
            "split": list(self.split),
            "plan": [list(w) for w in self.plan] if self.explicit else None,
            "item": self.item,
            "offset": self.offset,
            "left": self.left,
            "buffer": [list(ref) for ref in refs],
            "draws": self.draws,
        }

    def load_state_dict(self, state: Any) -> None:
        parsed = read_state(state, self.stream, self.split)
        self.close()
        self.seed, self.split = parsed.seed, parsed.split
        self.explicit = parsed.plan is not None
        self.plan = list(parsed.plan) if parsed.plan is not None else self._epoch_plan()
        self.item, self.offset, self.left, self.draws = parsed.item, parsed.offset, parsed.left, parsed.draws
        self.unread, self.buffer = list(parsed.buffer), []
        self._key = _buffer_key(self.seed, self.split)
