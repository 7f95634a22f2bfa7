"""A loader outside its epochs: pickled without its iterators and workers, and its
workers ended on request, by the user or by a framework's teardown.

- **Pickling** (plain ``pickle``, cloudpickle, ``spawn``): a loader pickles as torch's
  does, without its live iterators and worker processes, and its place in the stream
  goes with it: the copy's next ``iter()`` is the one the original's would be (a state
  loaded with ``load_state_dict()`` and not yet used, the epoch after one that is under
  way or ended, with persistent workers' carried RNG states), and its ``state_dict()``
  until then is the original's.
- **Ending workers**: :meth:`LoaderLifecycle.shutdown_workers` stops the worker
  processes of every live iterator, persistent ones included. torch's DataLoader keeps
  its persistent iterator as ``loader._iterator``, and frameworks end its workers by
  setting that to None after shutting it down (Lightning's
  ``_shutdown_workers_and_reset_iterator``, at the end of every ``fit``, returned or
  raised); the same assignment ends this loader's workers.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Final

from ._state.published import Publisher

if TYPE_CHECKING:
    from ._epoch.iterator import SnapIterator
    from ._state.ledger import EpochStart

_SHUT_DOWN: Final = (
    "this iterator's workers were ended by loader.shutdown_workers() (or a framework's "
    "teardown: Lightning's at the end of fit); call iter(loader) for the next epoch"
)


class LoaderLifecycle:
    """The part of :class:`~snaploader.DataLoader` that is about its life outside an epoch."""

    _persistent_iter: SnapIterator | None
    _iterators: weakref.WeakSet[SnapIterator]
    _pending: EpochStart | None
    _published: Publisher

    if TYPE_CHECKING:  # the loader's

        def _upcoming_start(self) -> EpochStart | None: ...

        def state_dict(self) -> dict[str, Any]: ...

    def shutdown_workers(self) -> None:
        """End this loader's worker processes now: the persistent workers, and those of
        any iterator still alive, whose ``next()`` then raises ``RuntimeError``. Where
        the loader stands does not change: ``state_dict()`` is what it was, and the next
        ``iter()`` starts workers again for the next epoch (or a loaded state). Lightning
        calls it at the end of every ``fit``; call it yourself to free a persistent
        loader's workers before the loader is garbage-collected (notebooks, sweeps)."""
        if "_iterators" not in self.__dict__:
            return  # torch's constructor, before snaploader's own state exists
        for iterator in list(self._iterators):
            iterator.invalidate(_SHUT_DOWN)
        self._iterators.clear()
        self._persistent_iter = None

    # torch's name for the persistent iterator, which frameworks read and reset.
    @property
    def _iterator(self) -> SnapIterator | None:
        return self.__dict__.get("_persistent_iter")

    @_iterator.setter
    def _iterator(self, value: None) -> None:
        if value is not None:
            raise AttributeError("a snaploader DataLoader's _iterator can only be reset to None, which ends its workers")
        self.shutdown_workers()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_iterators"] = state["_persistent_iter"] = None
        upcoming = self._upcoming_start()
        published = Publisher()
        if upcoming is not None:
            published.load(self.state_dict())
        state["_pending"], state["_published"] = upcoming, published
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_iterators"] = weakref.WeakSet()
