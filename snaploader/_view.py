"""The loader's internal read API: where a loader stands, and its state as of one batch
back or as if its epoch had ended, for snaploader's integrations (Lightning,
Accelerate, the Hugging Face Trainer), which checkpoint around a training loop that
does not consume batches exactly as the loader yields them.

``LoaderView.of(loader)`` reads the loader's published position once; everything the
view answers is about that one moment, whatever the loader's iterator does meanwhile
(except the generator's state for the next epoch, which a state of an ended epoch
reads when it is built: build it before the next ``iter()``). It is the only way code
outside ``_loader.py`` reads the loader's progress.

Why "one batch back": a framework that fetches batch k+1 before step k runs
(Lightning's fetcher does when the loader has no length, to know which batch is the
last) has made the loader yield one batch more than the training step consumed; a
checkpoint of the loader's current state would skip that batch on resume. The ledger
keeps the position before the last yielded batch (``EpochProgress.previous``), so the
state of "one batch back" is as cheap and as exact as the current one.

Why "as if the epoch ended": a framework that ends an epoch after a number of batches
without asking the loader for one more (Lightning, after ``num_training_batches``)
resumes a checkpoint of that last step with the next epoch; the loader, which has not
seen its epoch end, would first give that epoch's (empty) rest.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._format.build import build_state
from ._rng.capture import RngSource
from ._state.ledger import EpochProgress, Position
from ._state.published import Seen

if TYPE_CHECKING:
    from ._loader import DataLoader


@dataclass(frozen=True)
class LoaderView:
    """Where ``loader`` stood when the view was made.

    ``epoch``: its current (or last) epoch, -1 before its first; ``yielded``: batches of
    that epoch yielded so far (a loaded state's count until the next ``iter()``);
    ``live``: an epoch is under way (iterated and not ended); ``used``: the loader was
    iterated or loaded from a state since it was built.
    """

    loader: DataLoader[Any]
    epoch: int
    yielded: int
    live: bool
    used: bool
    _progress: EpochProgress | None
    _position: Position | None
    _previous: Position | None  # the position one batch back, kept by the ledger

    @classmethod
    def of(cls, loader: DataLoader[Any]) -> LoaderView:
        published = loader._published.current  # one record: progress, or a loaded state
        progress = published.progress
        if progress is not None:
            # Read once: the iterator publishes a new position (and previous) per batch.
            position, previous = progress.position, progress.previous
            return cls(loader, progress.epoch, position.yielded, not position.ended, True, progress, position, previous)
        pending = published.loaded
        if pending is None:
            return cls(loader, -1, 0, False, False, None, None, None)
        ended = bool(pending.get("ended"))
        return cls(loader, int(pending.get("epoch", -1)), 0 if ended else int(pending.get("yielded", 0)),
                   False, True, None, None, None)

    def state_dict(self) -> dict[str, Any]:
        """The loader's ``state_dict()`` at this view's moment."""
        if self._progress is None or self._position is None:
            return self.loader.state_dict()
        return self._state_at(self._position)

    def state_as_of(self, yielded: int) -> dict[str, Any]:
        """The state as it was when ``yielded`` batches of the epoch had been yielded:
        this view's, or the one before its last yielded batch. ``RuntimeError`` for any
        other count (the ledger keeps those two only)."""
        if yielded == self.yielded:
            return self.state_dict()
        previous = self._previous
        if previous is None or yielded != self.yielded - 1 or previous.yielded != yielded:
            raise RuntimeError(
                f"the loader's state is asked for as of batch {yielded} of its epoch, but it has "
                f"yielded {self.yielded} batches and keeps the state of only the last one and the "
                "one before; the consumer reads further ahead than one batch, which snaploader "
                "cannot resume exactly (see docs/lightning.md)"
            )
        return self._state_at(previous)

    def state_ending_epoch(self) -> dict[str, Any]:
        """The state as if the epoch had ended where this view stands: a resume starts
        the next epoch. The view's own state when no epoch is live. ``RuntimeError``
        before the last batch of a map-style epoch, whose checkpoint format has no
        place for an epoch ended early."""
        if not self.live or self._progress is None or self._position is None:
            return self.state_dict()
        batches = self.loader._facts().batches_per_epoch
        if batches is not None and self.yielded != batches:
            raise RuntimeError(
                f"the loader's epoch is asked to end after {self.yielded} of its {batches} "
                "batches; a map-style epoch ends only after its last batch (a consumer that "
                "stops an epoch early, as limit_train_batches does, is not covered)"
            )
        ending = copy.copy(self._progress)
        ending.position = self._position
        ending.end()
        return self._state(ending, ending.position)

    def _state_at(self, position: Position) -> dict[str, Any]:
        assert self._progress is not None
        at = copy.copy(self._progress)
        at.position = position
        return self._state(at, position)

    def _state(self, progress: EpochProgress, position: Position) -> dict[str, Any]:
        loader = self.loader
        source = RngSource(loader.generator)
        # An ended epoch's checkpoint carries the generator's state for the next one,
        # read now: a view of an ended epoch is read before the next iter() draws.
        rng_next = source.next_epoch_state() if position.ended else None
        seen = Seen(None, progress, position, rng_next)
        return build_state(loader._fingerprint(), seen, source, loader._snaploader_options.logical_workers)
