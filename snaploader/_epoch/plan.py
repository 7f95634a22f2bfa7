"""Which indices make batch k of an epoch. Pure bookkeeping in the main process: no
processes, no datasets read, no RNG touched but the sampler's own draws.

:class:`IndexPlan` walks the index sampler lazily, batch by batch, as torch does.
Restoring to batch k skips k batches of *indices* (for torch's ``BatchSampler`` by
skipping k * batch_size sampler items at C speed; for torch's ``RandomSampler`` by
slicing its permutation, see ``NOTE [ skipping a RandomSampler ]``), or loads the
sampler's own ``state_dict()`` saved before batch k when the sampler implements the
protocol. Where the sampler's randomness comes from is ``_rng/capture.py``'s ``RngSource``'s business.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any, Final

import torch
from torch.utils.data import BatchSampler, RandomSampler

from .._state.protocol import stateful_part


def _consume(iterator: Iterator[Any], n: int) -> None:
    next(itertools.islice(iterator, n, n), None)


# NOTE [ skipping a RandomSampler ]
# Restoring late in a long shuffled epoch used to step RandomSampler's Python generator
# through every skipped item (900,000 of them at 90% of a 10**6-item epoch, ~30 ms).
# _random_items makes exactly the draws RandomSampler.__iter__ makes (torch 2.x: a seed
# from the global RNG when it has no generator, then one randperm(n) per n items and
# one for the num_samples % n tail; with replacement one randint of 32 per 32 items and
# one for the tail), each at the moment iterating would make it, and slices the drawn
# tensor instead of stepping through it. So the items and the generator's state at
# every point are those of the sampler's own iterator. Whole randint chunks skipped at
# once are drawn in one call when a probe shows that this draws the same numbers. The
# draws are not assumed to stay torch's: on first use a probe compares the fast path
# with the sampler's own iterator on small cases, and any difference disables it.
_RANDINT_CHUNK: Final = 32


@functools.lru_cache(maxsize=8)
def _randint_chunks_concatenate(high: int) -> bool:
    """True when one randint of 3 * 32 draws what three of 32 draw, leaving the
    generator in the same state."""
    one, many = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    joined = torch.randint(high=high, size=(3 * _RANDINT_CHUNK,), generator=one)
    parts = [torch.randint(high=high, size=(_RANDINT_CHUNK,), generator=many) for _ in range(3)]
    return torch.equal(joined, torch.cat(parts)) and torch.equal(one.get_state(), many.get_state())


def _random_items(sampler: RandomSampler, skip: int) -> Iterator[int]:
    """``iter(sampler)`` after ``skip`` items, its draws made as the sampler makes them
    (see NOTE [ skipping a RandomSampler ])."""
    n = len(sampler.data_source)
    if sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    total = sampler.num_samples
    chunk = _RANDINT_CHUNK if sampler.replacement else n
    full, tail = divmod(total, chunk)

    def draw(size: int) -> torch.Tensor:
        # ``size`` items of the stream: one chunk, the tail, or (with replacement) whole
        # chunks at once; a permutation is always of n, the tail cut from it
        if sampler.replacement:
            return torch.randint(high=n, size=(size,), dtype=torch.int64, generator=generator)
        return torch.randperm(n, generator=generator)[:size]

    skipped_chunks = min(skip // chunk, full)
    if sampler.replacement and skipped_chunks and _randint_chunks_concatenate(n):
        draw(skipped_chunks * chunk)
    else:
        for _ in range(skipped_chunks):
            draw(chunk)
    skip -= skipped_chunks * chunk
    for size in [chunk] * (full - skipped_chunks) + [tail]:
        drawn = draw(size)
        if skip < size:
            yield from drawn[skip:].tolist()
            skip = 0
        else:
            skip -= size


def _batches(items: Iterator[Any], batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    # Yields exactly what torch's BatchSampler yields over the same items.
    while True:
        batch = list(itertools.islice(items, batch_size))
        if not batch or (drop_last and len(batch) < batch_size):
            return
        yield batch


@functools.lru_cache(maxsize=1)
def _slices_like_torch() -> bool:
    """True when :func:`_random_items` yields what stepping this torch's RandomSampler
    yields and leaves its generator where stepping does."""
    class Sized:
        def __len__(self) -> int:
            return 7

    def sampler(num_samples: int | None, replacement: bool) -> RandomSampler:
        generator = torch.Generator().manual_seed(3)
        return RandomSampler(Sized(), replacement, num_samples, generator)  # type: ignore[arg-type]

    try:
        for num_samples, replacement in ((None, False), (23, False), (71, True)):
            for skip in (0, 3, 9, 80):
                stepped, sliced = sampler(num_samples, replacement), sampler(num_samples, replacement)
                items = iter(stepped)
                _consume(items, skip)
                if list(items) != list(_random_items(sliced, skip)):
                    return False
                assert stepped.generator is not None and sliced.generator is not None
                if not torch.equal(stepped.generator.get_state(), sliced.generator.get_state()):
                    return False
        return True
    except Exception:  # any surprise means: step the sampler
        return False


def _skipped(sampler: Any, n: int) -> Iterator[Any]:
    """``iter(sampler)`` with its first ``n`` items consumed."""
    if type(sampler) is RandomSampler and _slices_like_torch():
        return _random_items(sampler, n)
    items = iter(sampler)
    _consume(items, n)
    return items


def epoch_aware_part(index_sampler: Any) -> Any | None:
    """The sampler with ``set_epoch`` (DistributedSampler and kin), if any."""
    for obj in (index_sampler, getattr(index_sampler, "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)) and hasattr(obj, "epoch"):
            return obj
    return None


class IndexPlan:
    """The batches of indices of one epoch of a map-style dataset, drawn lazily.

    The first batch is drawn on construction, so the sampler's own random draws happen
    at the epoch start (inside :meth:`RngSource.replaying` on restore); each later one
    when it is taken (a stateful sampler's one batch ahead, see :meth:`take`), as torch's
    sampler iterator draws it when its batch is asked for: a consumer that stops after
    the last batch without asking for one more (Lightning) leaves the sampler's end
    undrawn, and the next epoch's order depends on it.
    """

    def __init__(
        self,
        index_sampler: Any,
        skip: int = 0,
        sampler_state: Any = None,
        *,
        state_at: int | None = None,
        item_offset: int = 0,
    ) -> None:
        """The plan starts at batch ``skip``. ``sampler_state`` is what
        :meth:`sampler_state_before` returned in the run being restored: the stateful
        sampler then stands at batch ``state_at`` (default ``skip``) by itself, and
        the batches from there to ``skip`` are skipped (``load_state_dict(skip=...)``).
        ``item_offset``: sampler items consumed before batch 0 (an epoch part resumed
        with another batch size, ``_format/resize.py``); a sampler state includes them."""
        self.stateful = stateful_part(index_sampler)
        done = False
        if self.stateful is not None and sampler_state is not None:
            self.stateful.load_state_dict(sampler_state["state"])
            done = bool(sampler_state["done"])
            skip -= skip if state_at is None else state_at
            item_offset = 0
        self.batches: Iterator[Any] = iter(()) if done else self._iterate(index_sampler, skip, item_offset)
        # state_dict() of the stateful sampler taken before each drawn batch, oldest first
        self.states: deque[Any] = deque()
        self.next_index = 0
        self.total: int | None = None  # batches in this plan, once the sampler ran dry
        self.drawn = 0
        self.upcoming = self._draw()

    def _iterate(self, index_sampler: Any, skip: int, item_offset: int) -> Iterator[Any]:
        if type(index_sampler) is BatchSampler:
            items = _skipped(index_sampler.sampler, item_offset + skip * index_sampler.batch_size)
            return _batches(items, index_sampler.batch_size, index_sampler.drop_last)
        return _skipped(index_sampler, skip)

    def _draw(self) -> Any | None:
        if self.stateful is not None:
            self.states.append(self.stateful.state_dict())
        batch = next(self.batches, None)
        if batch is None:
            self.total = self.drawn
        else:
            self.drawn += 1
        return batch

    def take(self) -> Any | None:
        """The indices of the next batch, or None at the end of the epoch. A stateful
        sampler is drawn one batch ahead, so that a checkpoint after the epoch's last
        batch knows whether it has anything left (:meth:`sampler_state_before`)."""
        batch, self.upcoming = self.upcoming, None
        if batch is None and self.total is None:
            batch = self._draw()
        if self.stateful is not None and batch is not None:
            self.upcoming = self._draw()
        return batch

    def forget_before(self, yielded_in_plan: int) -> None:
        """Drop the sampler states saved before the ``yielded_in_plan``-th batch: a
        checkpoint can no longer point there (the loader has yielded past it)."""
        while len(self.states) > 1 and self.next_index < yielded_in_plan:
            self.states.popleft()
            self.next_index += 1

    def sampler_state_before(self, yielded_in_plan: int) -> dict[str, Any] | None:
        """For a stateful sampler, ``{"state": ..., "done": ...}`` that puts it before
        the ``yielded_in_plan``-th batch this plan drew (counting from 0); None for
        samplers without the protocol. Past the last batch the sampler may already have
        moved on to its next epoch (a partial last batch runs it dry while being
        drawn), so there the state is its current one and ``done`` says that this
        epoch has nothing left. Reads only: :meth:`forget_before` prunes."""
        if self.stateful is None:
            return None
        if self.total is not None and yielded_in_plan >= self.total:
            return {"state": self.stateful.state_dict(), "done": True}
        at = min(max(yielded_in_plan - self.next_index, 0), len(self.states) - 1)
        return {"state": self.states[at], "done": False}
