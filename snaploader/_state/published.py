"""What a loader's ``state_dict()`` reads, published whole so that it is consistent
from any thread, an epoch's start included (NOTE [ epoch start ]).

- ``iter()`` publishes through :meth:`Publisher.starting`: before the epoch's first
  draw from the loader's generator, the generator's state beside the last epoch; once
  the new epoch exists, its progress.
- ``state_dict()`` reads through :meth:`Publisher.read`: one :class:`Seen`, whose
  position and generator state belong to the same moment.
- ``load_state_dict()`` publishes the loaded checkpoint (:meth:`Publisher.load`), which
  ``state_dict()`` returns until its epoch starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from .ledger import EpochProgress, Position

# NOTE [ epoch start ]
# iter() draws the epoch's base seed and its permutation from the loader's generator,
# and only then has a new epoch to publish. state_dict() on another thread meanwhile
# still reads the last epoch ("ended"), whose checkpoint carries the generator's state
# for the next one: read then, it would be the state after some of those draws, and a
# resume would draw another epoch. So before the first draw the loader publishes the
# generator's state beside the last epoch (one assignment of a Published), and
# Publisher.read() takes it from there; a reader that found none and read the
# generator itself checks afterwards that nothing was published meanwhile, and reads
# again if so. A loaded checkpoint stays what state_dict() returns until its epoch
# is published.


@dataclass(frozen=True)
class Published:
    """What a loader's ``state_dict()`` reads, replaced whole: the current (or last)
    epoch's ``progress``, or a ``loaded`` checkpoint whose epoch has not started yet;
    and ``rng_next``, the generator's state from before the draws of an epoch that
    ``iter()`` is starting (None: read the generator itself)."""

    progress: EpochProgress | None = None
    loaded: dict[str, Any] | None = None
    rng_next: bytes | None = None


@dataclass(frozen=True)
class Seen:
    """One consistent reading of a :class:`Published`: its progress at ``position``
    (read once), and ``rng_next`` as of that moment (None while the epoch runs)."""

    loaded: dict[str, Any] | None
    progress: EpochProgress | None
    position: Position | None
    rng_next: bytes | None


class Publisher:
    """A loader's :class:`Published` record, replaced whole at each change, and the two
    sides of NOTE [ epoch start ]: :meth:`starting` for ``iter()``, :meth:`read` for
    ``state_dict()`` on any thread."""

    def __init__(self) -> None:
        self.current = Published()

    @property
    def progress(self) -> EpochProgress | None:
        """The current (or last) epoch's progress; None before the first, or after a load."""
        return self.current.progress

    @property
    def loaded(self) -> dict[str, Any] | None:
        """The loaded checkpoint whose epoch has not started yet, or None."""
        return self.current.loaded

    def load(self, state: dict[str, Any]) -> None:
        self.current = Published(loaded=state)

    @contextmanager
    def starting(self, generator_state: Callable[[], bytes | None]) -> Iterator[Callable[[EpochProgress], None]]:
        """Around the start of an epoch: the body draws from the generator, then calls
        the function it is given with the new epoch's progress. When the body raises,
        the last epoch is published as it was, with the generator as it now stands (the
        start is consumed either way: the next ``iter()`` draws from there)."""
        before = self.current
        if before.loaded is None:
            self.current = replace(before, rng_next=generator_state())

        def publish(progress: EpochProgress) -> None:
            self.current = Published(progress)

        try:
            yield publish
        except BaseException:
            self.current = Published(before.progress)
            raise

    def read(self, generator_state: Callable[[], bytes | None]) -> Seen:
        """What ``state_dict()`` describes: the published record, with the generator's
        state (``generator_state()``) read consistently with it."""
        while True:
            published = self.current
            progress = published.progress
            position = None if progress is None else progress.position
            rng_next = published.rng_next
            if published.loaded is None and (position is None or position.ended) and rng_next is None:
                rng_next = generator_state()
                if self.current is not published:
                    continue  # an epoch began to draw meanwhile
            return Seen(published.loaded, progress, position, rng_next)
