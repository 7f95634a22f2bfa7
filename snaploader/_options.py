"""snaploader's own options (the loader's keyword-only arguments beyond torch's), checked
once into one frozen record that the loader keeps, the iterator and the workers read, and
``snaploader verify`` rebuilds a loader from. Adding an option means a field here, its
check in :meth:`Options.checked`, and the code that uses it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Final

REPLAY_MODES: Final = ("warn", "allow", "refuse")

# The most logical workers a loader runs (and a checkpoint may name: its load's work grows
# with them, so an untrusted checkpoint is bounded by this too).
MAX_LOGICAL_WORKERS: Final = 1024


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class Options:
    """The options as the loader's constructor documents them, checked; ``logical_workers``
    resolved (None there means ``num_workers``)."""

    # For an iterable dataset with the state protocol: call its state_dict() after every
    # N-th batch of a worker (and its last); 0 only after the last (torchdata's
    # snapshot_every_n_steps=0). Resume replays the batches since that state.
    snapshot_every: int = 1
    replay: str = "warn"  # one of REPLAY_MODES
    max_worker_retries: int = 3
    check_resume: bool = True
    rng_objects: Callable[[], Any] | None = None
    exclude_rngs: tuple[str, ...] | Callable[[str, Any], bool] = ()
    state_protocol: bool = True
    logical_workers: int = 0  # the stream's worker count for a new epoch
    # Each sample's draws from states of (base seed, epoch, index) alone (_rng/per_sample.py).
    seed_per_sample: bool = False

    @staticmethod
    def checked(
        num_workers: int,
        *,
        snapshot_every: int,
        snapshot_every_n_steps: int | None,
        replay: str,
        max_worker_retries: int,
        check_resume: bool,
        rng_objects: Callable[[], Any] | None,
        exclude_rngs: Iterable[str] | Callable[[str, Any], bool],
        state_protocol: bool,
        logical_workers: int | None,
        seed_per_sample: bool,
        snapshot_every_given: bool,
    ) -> Options:
        """The record of the constructor's arguments; ``ValueError`` naming the option
        for a value outside what the constructor documents. ``snapshot_every_given``:
        whether ``snapshot_every`` was passed (it and its torchdata alias exclude each other)."""
        if snapshot_every_n_steps is not None:
            if snapshot_every_given:
                raise ValueError(
                    f"snapshot_every={snapshot_every!r} and snapshot_every_n_steps="
                    f"{snapshot_every_n_steps!r} were both given; they are one option (the second is "
                    "torchdata's name for it): pass only one"
                )
            if not _is_count(snapshot_every_n_steps, 0):
                raise ValueError(f"snapshot_every_n_steps should be an int >= 0, got {snapshot_every_n_steps!r}")
            snapshot_every = snapshot_every_n_steps
        if not _is_count(snapshot_every, 0):
            raise ValueError(f"snapshot_every should be an int >= 0, got {snapshot_every!r}")
        if replay not in REPLAY_MODES:
            raise ValueError(f"replay should be one of {REPLAY_MODES}, got {replay!r}")
        if not _is_count(max_worker_retries, 0):
            raise ValueError(f"max_worker_retries should be an int >= 0, got {max_worker_retries!r}")
        if not isinstance(check_resume, bool):
            raise ValueError(f"check_resume should be True or False, got {check_resume!r}")
        if rng_objects is not None and not callable(rng_objects):
            raise ValueError(
                "rng_objects should be a callable that returns the objects holding "
                f"generators (called in each worker), or None; got {type(rng_objects).__name__}"
            )
        if not isinstance(state_protocol, bool):
            raise ValueError(f"state_protocol should be True or False, got {state_protocol!r}")
        if logical_workers is None:
            logical_workers = num_workers
        if not _is_count(logical_workers, 0) or logical_workers > MAX_LOGICAL_WORKERS:
            raise ValueError(
                f"logical_workers should be an int from 0 to {MAX_LOGICAL_WORKERS} (the worker "
                f"count that defines the stream) or None for num_workers; got {logical_workers!r}"
            )
        if logical_workers == 0 and num_workers > 0:
            raise ValueError(
                "logical_workers=0 is num_workers=0's stream (torch's main-process "
                "contract: the dataset object itself, no worker info); it cannot be "
                f"hosted by num_workers={num_workers} worker processes. Pass "
                "logical_workers >= 1, or None for num_workers"
            )
        if not isinstance(seed_per_sample, bool):
            raise ValueError(f"seed_per_sample should be True or False, got {seed_per_sample!r}")
        return Options(
            snapshot_every=int(snapshot_every),
            replay=replay,
            max_worker_retries=max_worker_retries,
            check_resume=check_resume,
            rng_objects=rng_objects,
            exclude_rngs=_checked_exclude(exclude_rngs),
            state_protocol=state_protocol,
            logical_workers=logical_workers,
            seed_per_sample=seed_per_sample,
        )

    def arguments(self) -> dict[str, Any]:
        """The constructor's keyword arguments that give these options back."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def state_due(self, produced: int) -> bool:
        """Whether a worker that has produced ``produced`` batches calls the state
        protocol's ``state_dict()`` now (it also does after its last batch)."""
        return self.snapshot_every > 0 and produced % self.snapshot_every == 0


def _checked_exclude(exclude: Any) -> tuple[str, ...] | Callable[[str, Any], bool]:
    if callable(exclude):
        return exclude  # type: ignore[no-any-return]
    if isinstance(exclude, str):
        return (exclude,)
    try:
        paths = tuple(exclude)
    except TypeError:
        paths = None
    if paths is None or not all(isinstance(path, str) for path in paths):
        raise ValueError(
            "exclude_rngs should be paths as captured_rngs() names them (a list of str, "
            "e.g. ['dataset.noise_rng']) or a predicate (path, generator) -> bool; "
            f"got {exclude!r:.80}"
        )
    return paths
