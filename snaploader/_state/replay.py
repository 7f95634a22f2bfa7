"""Replaying from the epoch start: how many batches each worker of a restored epoch
reads again because its iterable dataset has no state protocol, and what the user is
told about it (the ``replay`` option: a warning, nothing, or ReplayRefusedError)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .._errors import ReplayRefusedError, user_stacklevel
from .ledger import WorkerLedger, replay_without_protocol


def announce_replay(
    ledgers: Sequence[WorkerLedger], dataset: Any, mode: str, *, state_protocol: bool,
    lossy: str | None, warn: bool,
) -> None:
    """Raise :class:`ReplayRefusedError` when ``mode`` is "refuse" and a restored epoch
    of ``ledgers`` replays batches; with ``warn``, warn when it is "warn". The loader
    refuses at ``load_state_dict()``, while the caller can still act; the iterator warns
    (or refuses, for a state loaded before the option said so) at the epoch's start."""
    replays = [replay_without_protocol(ledger) for ledger in ledgers]
    if not any(replays) or mode == "allow" or (mode == "warn" and not warn):
        return
    message = replay_message(dataset, replays, refused=mode == "refuse", state_protocol=state_protocol, lossy=lossy)
    if mode == "refuse":
        raise ReplayRefusedError(message)
    warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


def replay_message(
    dataset: Any, replays: list[int], *, refused: bool, state_protocol: bool = True,
    lossy: str | None = None,
) -> str:
    """Why a resume of ``dataset`` replays ``replays[w]`` batches in worker ``w``, and
    how to avoid it; for the warning (``refused=False``) or ReplayRefusedError.
    ``state_protocol``: the loader's option of that name; ``lossy``: why the loader
    turned the dataset's own protocol off by itself (``lossy_state_protocol``)."""
    name = type(dataset).__qualname__
    per_worker = ", ".join(f"worker {w}: {n}" for w, n in enumerate(replays))
    if state_protocol:
        why = (
            f"because neither {name} nor the iterator iter(dataset) returns has "
            "state_dict()/load_state_dict()"
        )
        fix = (
            "implement state_dict()/load_state_dict() returning plain data on the "
            "iterator or the dataset to resume without reading skipped data "
            "(docs/iterable.md)"
        )
    elif lossy is not None:
        why = f"instead of through its own state_dict(), because {lossy}"
        fix = (
            "give the dataset a state_dict() that saves everything it needs, or build the "
            "loader with state_protocol=True to resume through the dataset's own state "
            "anyway (not exact)"
        )
    else:
        why = "because the loader was built with state_protocol=False"
        fix = (
            "build the loader with state_protocol=True (the default) if the dataset's "
            "own state_dict() resumes it exactly"
        )
    total = sum(replays)
    if refused:
        return (
            f"an exact resume of {name} would replay {total} batch(es) from the epoch start, "
            f"and the loader was built with replay='refuse'; to resume, {fix}, or build the "
            f"loader with replay='warn' or replay='allow'\n"
            f"Per worker: {per_worker}. It would replay {why}."
        )
    return (
        f"an exact resume of {name} replays {total} batch(es) from the epoch start, "
        f"reading and discarding them; to avoid it, {fix}; replay='allow' silences this "
        "warning\n"
        f"Per worker: {per_worker}. It replays {why}. replay='refuse' raises "
        "ReplayRefusedError instead."
    )
