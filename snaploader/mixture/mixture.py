"""``Mixture``: a map-style dataset over named sources, each sample taken from one source
as the weights (or a schedule of them) choose. Its index is the concatenation of the
sources in the order given (``mixture[i]`` is a source's item, as ``ConcatDataset``'s);
which of them an epoch takes, and in what order, is its sampler's (``MixtureSampler``, below),
which ``snaploader.DataLoader`` installs by itself.
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Union

import torch.utils.data as torch_data

from .._errors import CheckpointMismatchError
from .blend import choose, pass_key, permuted, uniform
from .state import Cursor, Schedule, Weights, check_resume, checked_weights, read_state


class Mixture(torch_data.Dataset[Any]):
    """Samples from several named sources, the source of each chosen by ``weights``.

    ``sources``: a dict of name to map-style dataset (each non-empty, with ``len()``).
    ``weights``: a dict of name to weight (>= 0, not all zero; normalised), or a schedule,
    a function of the number of samples the mixture has drawn so far (across epochs and
    ranks) that returns such a dict. ``samples_per_epoch``: how many samples an epoch has
    (over all ranks). ``seed``: the mixture's own seed; None draws one from the loader's
    generator in its first epoch (as ``RandomSampler`` does), which every rank under
    ``torch.distributed`` would draw differently, so a distributed run gives one.
    ``with_source``: each item as ``(source name, item)`` instead of the item.

    Within a source, items come in a seeded order without repeats until the source is
    exhausted; its next pass takes a new order. See docs/mixtures.md for the blending
    rule and what a resume with other weights or sources keeps.
    """

    def __init__(
        self,
        sources: Mapping[str, torch_data.Dataset[Any]],
        weights: Union[Weights, Schedule],
        *,
        samples_per_epoch: int,
        seed: int | None = None,
        with_source: bool = False,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError(f"sources should be a non-empty dict of name to dataset, got {sources!r:.80}")
        lengths = {}
        for name, source in sources.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"source names should be non-empty str, got {name!r:.40}")
            if isinstance(source, torch_data.IterableDataset):
                raise TypeError(f"source {name!r} is an IterableDataset; a Mixture takes map-style datasets (with __getitem__ and __len__)")
            try:
                length = len(source)  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(f"source {name!r} ({type(source).__name__}) has no len(); a Mixture's sources need one") from None
            if length <= 0:
                raise ValueError(f"source {name!r} is empty; give each source at least one item, or leave it out")
            lengths[name] = length
        if isinstance(samples_per_epoch, bool) or not isinstance(samples_per_epoch, int) or samples_per_epoch <= 0:
            raise ValueError(f"samples_per_epoch should be an int > 0, got {samples_per_epoch!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
            raise ValueError(f"seed should be None or an int in [0, 2**64), got {seed!r}")
        self.sources = dict(sources)
        self.names = tuple(self.sources)
        self.lengths = lengths
        if callable(weights) and not isinstance(weights, Mapping):
            self.schedule: Schedule | None = weights
            self.weights: dict[str, float] | None = None
        else:
            self.schedule = None
            self.weights = checked_weights(weights, self.names, "weights")
        self.samples_per_epoch = samples_per_epoch
        self.seed = seed
        self.with_source = with_source
        self._starts = []
        total = 0
        for name in self.names:
            self._starts.append(total)
            total += lengths[name]
        self._total = total

    def weights_at(self, drawn: int) -> dict[str, float]:
        """The weights in force for the mixture's draw number ``drawn``."""
        if self.schedule is None:
            assert self.weights is not None
            return self.weights
        return checked_weights(self.schedule(drawn), self.names, f"the weights schedule's result for {drawn} samples drawn")

    def index_of(self, name: str, item: int) -> int:
        """The mixture index of source ``name``'s item ``item``."""
        return self._starts[self.names.index(name)] + item

    def source_of(self, index: int) -> tuple[str, int]:
        """Which source's item the mixture index ``index`` is: ``(name, item)``."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"a Mixture is indexed by int, got {type(index).__name__}")
        index = int(index)
        if not 0 <= index < self._total:
            raise IndexError(f"mixture index {index} out of range: its sources hold {self._total} items")
        at = bisect.bisect_right(self._starts, index) - 1
        return self.names[at], index - self._starts[at]

    def __getitem__(self, index: int) -> Any:
        name, item = self.source_of(index)
        value = self.sources[name][item]
        return (name, value) if self.with_source else value

    def __len__(self) -> int:
        return self.samples_per_epoch

    def sampler(
        self, *, rank: int | None = None, world_size: int | None = None, generator: Any = None
    ) -> MixtureSampler:
        """The sampler that draws this mixture's epochs (rank and world size default to
        torch.distributed's when it is initialised); ``snaploader.DataLoader`` makes one
        by itself when given neither ``sampler`` nor ``batch_sampler``."""
        return MixtureSampler(self, rank=rank, world_size=world_size, generator=generator)

    def __snaploader_sampler__(self, generator: Any) -> MixtureSampler:
        return self.sampler(generator=generator)


def _world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if live else 0) if rank is None else rank
        world_size = (dist.get_world_size() if live else 1) if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} should be an int, got {type(value).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} and world_size={world_size}: expected 0 <= rank < world_size")
    return rank, world_size


class MixtureSampler(torch_data.Sampler[int]):
    """Draws a :class:`Mixture`'s epochs: one stream of draws shared by every rank (draw
    ``g`` takes the source its uniform number picks, and that source's next item in its
    pass's order), dealt to the ranks in turn (rank ``r`` takes draws ``r``, ``r + W``, ...).
    An epoch is ``samples_per_epoch // world_size`` samples a rank; the next one goes on
    where it stopped. Its ``state_dict()`` is where the stream stands, O(sources)."""

    def __init__(self, mixture: Mixture, *, rank: int | None = None, world_size: int | None = None, generator: Any = None) -> None:
        if not isinstance(mixture, Mixture):
            raise TypeError(f"MixtureSampler draws a Mixture, got {type(mixture).__name__}")
        self.mixture = mixture
        self.rank, self.world_size = _world(rank, world_size)
        if mixture.seed is None and self.world_size > 1:
            raise ValueError(
                f"a Mixture read by {self.world_size} ranks needs Mixture(seed=...), the same on every "
                "rank: without one each rank would draw its own seed from its generator"
            )
        if mixture.samples_per_epoch < self.world_size:
            raise ValueError(f"samples_per_epoch={mixture.samples_per_epoch} is fewer than one sample per rank of {self.world_size}")
        self.generator = generator
        self._seed = mixture.seed
        self._drawn = 0
        self._epoch_left = 0
        self._resume = False
        self._cursors = {name: Cursor.new(length) for name, length in mixture.lengths.items()}
        self._names = tuple(sorted(mixture.names))

    def __len__(self) -> int:
        return self.mixture.samples_per_epoch // self.world_size

    def _draw_seed(self) -> int:
        import torch

        drawn = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        return drawn & ((1 << 63) - 1)

    def __iter__(self) -> Iterator[int]:
        # Started here rather than in the generator, so that state_dict() right after
        # iter() already describes the epoch.
        if self._seed is None:
            self._seed = self._draw_seed()
        if not (self._resume and self._epoch_left >= self.world_size):
            self._epoch_left = len(self) * self.world_size
            lengths = self.mixture.lengths
            for name, cursor in self._cursors.items():
                cursor.begin_epoch(lengths.get(name, cursor.length))
        self._resume = False
        return self._stream()

    def _stream(self) -> Iterator[int]:
        while self._epoch_left >= self.world_size:
            block = [self._draw() for _ in range(self.world_size)]
            self._epoch_left -= self.world_size
            yield block[self.rank]

    def _draw(self) -> int:
        assert self._seed is not None
        mixture, g = self.mixture, self._drawn
        name = choose(self._names, mixture.weights_at(g), uniform(self._seed, g))
        cursor = self._cursors[name]
        if cursor.offset >= cursor.pass_length:  # the pass is over: the next, over the source as it is now
            cursor.pass_, cursor.offset, cursor.pass_length = cursor.pass_ + 1, 0, cursor.length
        item = permuted(cursor.offset, cursor.pass_length, pass_key(self._seed, name, cursor.pass_))
        cursor.offset += 1
        cursor.epoch_drawn += 1
        self._drawn = g + 1
        return mixture.index_of(name, item)

    # -- the state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands (``mixture/state.py``'s docstring)."""
        return {
            "seed": self._seed,
            "drawn": self._drawn,
            "epoch_left": self._epoch_left,
            "world": [self.rank, self.world_size],
            "weights": dict(self.mixture.weights_at(self._drawn)),
            "scheduled": self.mixture.schedule is not None,
            "sources": {name: cursor.plain() for name, cursor in self._cursors.items()},
        }

    def _snaploader_for_rank(self, rank: int, world_size: int) -> MixtureSampler:
        """This mixture's sampler for another rank and world size (``reshard``'s)."""
        return MixtureSampler(self.mixture, rank=rank, world_size=world_size, generator=self.generator)

    def _snaploader_check_resume(self, state: Any, allow_mismatch: Iterable[str], prefix: bool) -> None:
        """Called by ``DataLoader.load_state_dict`` with the checkpoint's state of this
        sampler, before anything is loaded (``mixture/state.py``'s ``check_resume``).
        Another world size needs the batches behind the position to be the first ones
        (``prefix``): the ones after it that were yielded out of order are counted in
        the old world's batches, which another world does not have."""
        saved = read_state(state)
        mixture = self.mixture
        if saved.world[1] != self.world_size and not prefix:
            raise CheckpointMismatchError(
                f"the checkpoint was taken on {saved.world[1]} rank(s) mid-epoch with in_order=False; this "
                f"loader is one of {self.world_size}. Another world size resumes a checkpoint taken with "
                "in_order=True, or at an epoch's end"
            )
        check_resume(saved, mixture.seed, mixture.lengths, mixture.weights_at(saved.drawn),
                     mixture.schedule is not None, allow_mismatch)

    def _snaploader_item_offset(self, state: Any) -> int | None:
        """For the loader's load of a mid-epoch checkpoint (``_format/resize.py``'s
        ``another_world``): None when ``state`` was taken on this world size; otherwise
        this rank's items of the epoch that stand before its position, in this world,
        whose ranks share the rest of the epoch (``epoch_left // world_size`` draws a
        rank; the old world's batch count is not this one's)."""
        saved = read_state(state)
        if saved.world[1] == self.world_size:
            return None
        return len(self) - min(len(self), saved.epoch_left // self.world_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state``: the stream's position, every source's cursor (a source
        the checkpoint lacks starts its first pass; one this mixture lacks is kept, for
        when it comes back). The checks of a changed mixture are ``load_state_dict``'s
        of the loader, which knows ``allow_mismatch``."""
        saved = read_state(state)
        mixture = self.mixture
        if saved.seed is not None:
            self._seed = saved.seed
        self._drawn, self._epoch_left = saved.drawn, saved.epoch_left
        cursors = {name: Cursor(**vars(cursor)) for name, cursor in saved.sources.items()}
        for name, length in mixture.lengths.items():
            cursors.setdefault(name, Cursor.new(length))  # a source added: its first pass
        self._cursors = cursors
        self._resume = True

    def _snaploader_consumed(self, state: Any) -> dict[str, dict[str, Any]]:
        """The per-source ledger of ``state`` (``consumed_by_source``), for the loader's
        ``consumed()``, which passes the state of its position (this sampler's own runs
        ahead of the yielded batches)."""
        return consumed_by_source(state)


def consumed_by_source(state: Any) -> dict[str, dict[str, Any]]:
    """What the epoch under way drew from each source by the position of ``state`` (a
    ``MixtureSampler.state_dict()``), over every rank: ``samples``, and per pass it drew
    from, the source's item numbers in the order drawn (``passes``: {pass: [items]}),
    rebuilt from the cursors and the seed. Sources the epoch did not draw from are left out."""
    checked = read_state(state)
    out = {}
    for name, cursor in sorted(checked.sources.items()):
        if not cursor.epoch_drawn or checked.seed is None:
            continue
        passes: dict[int, list[int]] = {}
        pass_, offset, length, left = cursor.epoch_pass, cursor.epoch_offset, cursor.epoch_pass_length, cursor.epoch_drawn
        while left:
            if offset >= length:  # the pass is over: the next begins in this epoch, over its length
                pass_, offset, length = pass_ + 1, 0, cursor.length
            stop = min(length, offset + left)
            key = pass_key(checked.seed, name, pass_)
            passes[pass_] = [permuted(at, length, key) for at in range(offset, stop)]
            left -= stop - offset
            offset = stop
        out[name] = {"samples": cursor.epoch_drawn, "passes": passes}
    return out
