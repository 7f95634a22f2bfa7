"""``num_workers=0``: the logical workers run in the main process, behind the runner interface.

Ordinarily there is one slot, for 0 logical workers: torch's contract at
``num_workers=0`` stays (``get_worker_info()`` is None, no ``worker_init_fn``, the
dataset object itself is loaded from), but the data stream keeps its own RNG states:
the slot is seeded like worker 0, and its Python, NumPy and torch RNG states are
swapped in around each call and swapped out after it. So the training loop's own draws
(dropout, its own shuffles) never touch the data stream, and the other way round; and a
checkpoint resumes it exactly, as it resumes a worker process.

A checkpoint taken with W >= 1 logical workers resumed at ``num_workers=0`` (or
``DataLoader(num_workers=0, logical_workers=W)``) runs W slots here, each a logical
worker with its own copy of the setup, worker info and RNG states, as a worker process
hosting them would (NOTE [ logical workers ] in ``_workers/worker_loop.py``).

A task is run when its result is asked for (``next_result``), not when it is sent: the
iterator sends one task ahead, and running it early would do a batch's work before
the training step that precedes it, which torch's ``num_workers=0`` never does.

The swap is the whole per-batch cost of this mode, so it is kept to four unencoded
copies (:class:`~snaploader._rng.capture.NativeRng`): the main process's states out and the
slot's in before the call; after it, the slot's states are the snapshot the call
took anyway, and only the main process's are put back. Encoding waits for a checkpoint.

The swap is not thread-safe: the states are process-wide, and another thread drawing
from them during a fetch draws from the slot's states (changing the data stream) and
its draw is undone from its own. Where it is cheap to see, it is reported: while other
threads exist, the global states are compared after each batch with the batch's
snapshot (they differ only if something drew in between), and a warning is given once.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from torch.utils.data._utils import worker as torch_worker

from .worker_loop import copy_setup
from .._format.plain import check_plain
from .messages import Result, Task, WorkerSetup
from .._state.protocol import has_state_protocol
from .._state.records import Resume, Snapshot
from .._errors import user_stacklevel
from .._rng.capture import NativeRng
from .runner import Runner
from .logical_worker import WorkerRuntime, set_worker_info

_T = TypeVar("_T")


class InlineRunner(Runner):
    """The slots of a ``num_workers=0`` loader, run in this process."""

    def __init__(self, setup: WorkerSetup) -> None:
        super().__init__(setup.logical)
        slots = self.count
        self.runtimes = []
        for slot in range(slots):
            # Logical workers each get their own copy, as a worker process would; the
            # main-process contract uses the user's objects themselves.
            own = setup if setup.logical == 0 else copy_setup(setup, fresh=True)
            # NOTE [ collate in the main process ]: torch's default_collate allocates its
            # output in shared memory whenever get_worker_info() answers; here that would
            # hold an fd and /dev/shm space per live batch, so collate runs without it.
            own = replace(own, collate_fn=_collate_outside_worker(own.collate_fn))
            self.runtimes.append(WorkerRuntime(own, slot, in_main_process=True))
        # Per slot, its RNG states while swapped out.
        self.rng: list[NativeRng | None] = [None] * slots
        self.warned_threads = False
        self.epoch_start: Snapshot | None = None  # own_epoch_start(), taken by _position()
        # The generator objects the slot's code holds are swapped the same way: the
        # dataset is the user's object here, and between calls its generators are left
        # as a worker process would leave the main process's copy: untouched. So every
        # epoch starts them where a fresh worker would (num_workers=0 is 1's stream).
        self.object_states: list[list[bytes] | None] = [None] * slots
        for slot, runtime in enumerate(self.runtimes):
            self._call(slot, runtime.initialize)

    @property
    def worker_pids(self) -> list[int]:
        return []

    def _call(
        self, slot: int, fn: Callable[[], _T], rng_after: Callable[[_T], NativeRng | None] | None = None
    ) -> _T:
        """Run ``fn`` as logical worker ``slot``: its RNG states and worker info swapped
        in. ``rng_after`` picks the slot's states out of ``fn``'s return value when it
        took them last thing (a batch's snapshot), saving one more copy."""
        runtime = self.runtimes[slot]
        main_rng = NativeRng.take()
        main_info = torch_worker._worker_info
        objects = runtime.objects
        outside = objects.read_all() if objects.access else None  # most datasets hold none
        rng, object_states = self.rng[slot], self.object_states[slot]
        if rng is not None:
            rng.put()
        if object_states:
            objects.write_all(object_states)
        set_worker_info(runtime.info)
        taken: NativeRng | None = None
        try:
            out = fn()
            if rng_after is not None:
                taken = rng_after(out)
            return out
        finally:
            self.rng[slot] = taken if taken is not None else NativeRng.take(runtime.seed_rng)
            if taken is not None and not self.warned_threads and threading.active_count() > 1:
                self._check_no_other_draws(taken)
            # resume() may have found the objects anew: take the slot's states from the
            # current ones, put the outside states back into those they were read from
            self.object_states[slot] = runtime.objects.read_all() if runtime.objects.access else None
            if outside is not None:
                objects.write_all(outside)
            main_rng.put()
            set_worker_info(main_info)

    def _check_no_other_draws(self, snapshot: NativeRng) -> None:
        now = NativeRng.take()
        # bytes compare: a third of torch.equal's cost on a 5 KB state
        if (now.python, now.numpy) == (snapshot.python, snapshot.numpy) and (
            now.torch.numpy().tobytes() == snapshot.torch.numpy().tobytes()
        ):
            return
        self.warned_threads = True
        warnings.warn(
            "the global RNG states changed between a batch's snapshot and the swap back "
            "(num_workers=0): another thread drew from random, numpy.random or torch's "
            "global generator while the loader was fetching. num_workers=0 swaps the "
            "process-wide RNG states around each fetch, which is not thread-safe: the "
            "data stream and that thread's draws both change. Give that thread its own "
            "generator (random.Random, numpy.random.default_rng, torch.Generator) or use "
            "num_workers >= 1 (see docs/differences.md). Warned once",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    def own_epoch_start(self) -> Snapshot | None:
        return self.epoch_start

    def _transmit(self, slot: int, msg: Resume | Task) -> None:
        if isinstance(msg, Resume):
            runtime = self.runtimes[slot]
            self._call(slot, lambda: self._position(runtime, msg))

    def _position(self, runtime: WorkerRuntime, msg: Resume) -> None:
        """``runtime.resume(msg)``; and under the main-process contract, at an epoch
        that starts afresh, the dataset's epoch-start state for the checkpoint.

        The dataset object itself is iterated there and holds its own state across
        epochs, as in torch: its load_state_dict() is called only when a checkpoint
        asks for it (a Resume with a base), never with the state it already holds. Its
        state_dict() is taken after iter(dataset), where every dataset has one."""
        fresh = (
            runtime.main_contract and msg.base is None and runtime.setup.options.state_protocol
            and has_state_protocol(runtime.dataset)
        )
        objects = runtime.objects.snapshot()[0] if fresh else None  # before iter() draws
        runtime.resume(msg)
        self.epoch_start = None
        if not fresh:
            return
        if runtime.seed_rng is None:
            raise RuntimeError("the main-process slot was never initialized")
        dataset = runtime.dataset
        data = dataset.state_dict()
        check_plain(data, f"{type(dataset).__qualname__}.state_dict()")
        # With the fresh seed state: resume() restores it, loads this, calls iter(dataset).
        self.epoch_start = Snapshot(runtime.seed_rng, 0, runtime._copied(data), "dataset", True, objects=objects)

    def next_result(self, slot: int) -> tuple[Task, Result]:
        self.wait_any(slot)
        task, result, _ = self.slots[slot].pop()
        return task, result

    def wait_any(self, first: int) -> None:
        # Nothing runs ahead here, so only the slot the fixed order takes is ever
        # ready: num_workers=0 yields in order whatever in_order says.
        state = self.slots[first]
        if not state.received:
            task = state.outstanding[0]
            runtime = self.runtimes[first]
            result = self._call(first, lambda: runtime.run(task), _native_rng_of)
            self.accept(first, result)

    def settle(self, timeout_s: float) -> None:
        # Tasks sent ahead of an iterable's end would each be answered "exhausted":
        # in this process there is nothing to wait for, so they are simply dropped.
        for state in self.slots:
            state.outstanding.clear()

    def close(self) -> None:
        self.rng = [None] * self.count


def _native_rng_of(result: Result) -> NativeRng | None:
    rng = result.snapshot.rng
    return rng if isinstance(rng, NativeRng) else None


def _collate_outside_worker(collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def collate(batch: Any) -> Any:
        info = torch_worker._worker_info
        set_worker_info(None)
        try:
            return collate_fn(batch)
        finally:
            set_worker_info(info)

    return collate
