"""The dataset state protocol (torchdata's ``state_dict()``/``load_state_dict()``) as the
main process meets it: whether an object has it, whether the loader uses it for a
dataset (``state_protocol=``, and the datasets known to lose data through it), the
dataset's own check of the states a checkpoint holds for it, the part of an index sampler
that has it (``stateful_part``), and the state a finished epoch carries into the dataset object at ``num_workers=0``. A worker's own capture and
restore of these states is ``_workers/logical_worker.py``'s."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler

from .._errors import user_stacklevel
from .._rng.capture import NativeRng

if TYPE_CHECKING:
    from .ledger import WorkerLedger


def has_state_protocol(obj: Any) -> bool:
    """True when ``obj`` has torchdata's ``state_dict()``/``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def stateful_part(index_sampler: Any) -> Any | None:
    """The object whose state_dict()/load_state_dict() positions the index stream: the
    index sampler itself, or the sampler inside torch's BatchSampler; None if neither
    implements the protocol."""
    if has_state_protocol(index_sampler):
        return index_sampler
    if type(index_sampler) is BatchSampler and has_state_protocol(index_sampler.sampler):
        return index_sampler.sampler
    return None


def check_own_states(dataset: Any, ledgers: Iterable[WorkerLedger]) -> None:
    """Run the dataset's optional ``check_state(state, owner)`` on each worker state a
    mid-epoch checkpoint holds for it (``owner``: ``"dataset"`` or ``"iterator"``), in
    the main process, so that a state the dataset refuses (taken over other data, say)
    raises at ``load_state_dict()``, before anything forks, rather than in a worker."""
    check = getattr(dataset, "check_state", None)
    if not callable(check):
        return
    for ledger in ledgers:
        for snapshot in {id(s): s for s in (ledger.yielded, ledger.yielded_complete) if s is not None}.values():
            if snapshot.data_owner is not None and snapshot.complete:
                check(snapshot.data, snapshot.data_owner)


def resolve_state_protocol(option: Any, dataset: Any) -> tuple[bool, str | None]:
    """``DataLoader(state_protocol=option)`` for ``dataset``: whether its own protocol is
    used, and why not when the loader decided so itself (announced by a warning)."""
    if option is not None and not isinstance(option, bool):
        raise ValueError(f"state_protocol should be True, False or None, got {option!r}")
    lossy = lossy_state_protocol(dataset) if option is None else None
    if lossy is not None:
        warnings.warn(
            f"{lossy}. snaploader resumes it exactly by replay from the epoch start "
            "instead (as with state_protocol=False), which reads the epoch's batches "
            "before the checkpoint again; pass state_protocol=False to say so and silence "
            "this, or state_protocol=True to resume through the dataset's own state "
            "anyway (not exact)",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return (lossy is None if option is None else option), lossy


# How far lossy_state_protocol() walks a dataset's chain of wrapped iterables.
_LOSSY_WALK_MAX = 64


def lossy_state_protocol(dataset: Any) -> str | None:
    """Why ``dataset``'s own state protocol is known to lose data on resume, or None.

    Known: a Hugging Face ``datasets.IterableDataset`` with ``shuffle(buffer_size=...)``
    anywhere in its chain (its state holds the source position, not the buffer: a load
    refills the buffer, and the examples that were in it are lost; with several
    workers the load can fail outright). Recognised by class and attribute names, so
    ``datasets`` is never imported here.
    """
    if not type(dataset).__module__.startswith("datasets."):
        return None
    stack = [getattr(dataset, "_ex_iterable", None)]
    for _ in range(_LOSSY_WALK_MAX):
        if not stack:
            break
        node = stack.pop()
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            size = getattr(node, "buffer_size", "?")
            return (
                f"{type(dataset).__qualname__} (Hugging Face datasets) is shuffled through a "
                f"buffer of {size} examples (shuffle(buffer_size=...)), and its state_dict() "
                "holds the source position but not the buffer: a resume through it loses the "
                "buffered examples"
            )
        stack.append(getattr(node, "ex_iterable", None))
        stack.extend(list(getattr(node, "ex_iterables", None) or ()))
    return None


def load_carried_state(dataset: Any, state: Any) -> None:
    """Load a checkpoint's carried dataset state (EpochStart.dataset_state) into the
    dataset, with every global RNG state kept: the original run never made this call,
    so whatever it draws or sets must change neither the training loop's RNGs nor the
    data stream's (seeded afresh for the epoch after it)."""
    kept = NativeRng.take()
    try:
        dataset.load_state_dict(pickle.loads(pickle.dumps(state, pickle.HIGHEST_PROTOCOL)))
    finally:
        kept.put()
