"""Which indices make batch k of an epoch. Pure bookkeeping in the main process: no
processes, no datasets read, no RNG touched but the sampler's own draws.

:class:`IndexPlan` walks the index sampler lazily, batch by batch, as torch does.
Restoring to batch k skips k batches of *indices* (for torch's ``BatchSampler`` by
skipping k * batch_size sampler items at C speed), or loads the sampler's own
``state_dict()`` saved before batch k when the sampler implements the protocol. Where
the sampler's randomness comes from is ``_rng.RngSource``'s business.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import BatchSampler

from ._protocol import has_state_protocol


def _consume(iterator: Iterator[Any], n: int) -> None:
    next(itertools.islice(iterator, n, n), None)


def _batches(items: Iterator[Any], batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    # Yields exactly what torch's BatchSampler yields over the same items.
    while True:
        batch = list(itertools.islice(items, batch_size))
        if not batch or (drop_last and len(batch) < batch_size):
            return
        yield batch


def stateful_part(index_sampler: Any) -> Any | None:
    """The object whose state_dict()/load_state_dict() positions the index stream: the
    index sampler itself, or the sampler inside torch's BatchSampler; None if neither
    implements the protocol."""
    if has_state_protocol(index_sampler):
        return index_sampler
    if type(index_sampler) is BatchSampler and has_state_protocol(index_sampler.sampler):
        return index_sampler.sampler
    return None


def epoch_aware_part(index_sampler: Any) -> Any | None:
    """The sampler with ``set_epoch`` (DistributedSampler and kin), if any."""
    for obj in (index_sampler, getattr(index_sampler, "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)) and hasattr(obj, "epoch"):
            return obj
    return None


class IndexPlan:
    """The batches of indices of one epoch of a map-style dataset, drawn lazily.

    The first batch is drawn on construction, so the sampler's own random draws happen
    at the epoch start (inside :meth:`RngSource.replaying` on restore).
    """

    def __init__(
        self,
        index_sampler: Any,
        skip: int = 0,
        sampler_state: Any = None,
        *,
        state_at: int | None = None,
    ) -> None:
        """The plan starts at batch ``skip``. ``sampler_state`` is what
        :meth:`sampler_state_before` returned in the run being restored: the stateful
        sampler then stands at batch ``state_at`` (default ``skip``) by itself, and
        the batches from there to ``skip`` are skipped (``load_state_dict(skip=...)``)."""
        self.stateful = stateful_part(index_sampler)
        done = False
        if self.stateful is not None and sampler_state is not None:
            self.stateful.load_state_dict(sampler_state["state"])
            done = bool(sampler_state["done"])
            skip -= skip if state_at is None else state_at
        self.batches: Iterator[Any] = iter(()) if done else self._iterate(index_sampler, skip)
        # state_dict() of the stateful sampler taken before each drawn batch, oldest first
        self.states: deque[Any] = deque()
        self.next_index = 0
        self.total: int | None = None  # batches in this plan, once the sampler ran dry
        self.drawn = 0
        self.upcoming = self._draw()

    def _iterate(self, index_sampler: Any, skip: int) -> Iterator[Any]:
        if type(index_sampler) is BatchSampler:
            items = iter(index_sampler.sampler)
            _consume(items, skip * index_sampler.batch_size)
            return _batches(items, index_sampler.batch_size, index_sampler.drop_last)
        batches = iter(index_sampler)
        _consume(batches, skip)
        return batches

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
        """The indices of the next batch, or None at the end of the epoch."""
        batch = self.upcoming
        if batch is not None:
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
