"""The table of fault cases: workers that segfault, exit, are SIGKILLed, raise, or
produce an unpicklable batch; workers killed from outside; a main process that dies.

What a user relies on:

- a worker that dies once (a transient fault) is invisible except for one
  :class:`~snaploader.WorkerRespawnedWarning`: the stream is bit for bit the
  uninterrupted one, for every start method, dataset kind and persistent setting;
- a sample that kills its worker every time (a poison sample) ends, after exactly
  ``max_worker_retries`` respawns, in :class:`~snaploader.WorkerCrashedError` naming
  what happened, raised where the failed batch is due, so that ``state_dict()`` taken
  then resumes at that batch;
- an exception in dataset code comes back as itself, with a note saying where;
- nothing outlives the loader, not even when the process that owns it is SIGKILLed.

The uninterrupted reference runs under fork: the stream does not depend on the start
method, so comparing spawn and forkserver runs with it checks that too.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from . import _fault_datasets as fds
from ._support import assert_same_stream as assert_same_batches
from ._support import mp_helpers  # noqa: F401  (a fixture)
from snaploader import DataLoader, WorkerCrashedError, WorkerRespawnedWarning
from snaploader._epoch.iterator import SnapIterator

N = 20  # samples
BATCH = 3
WORKERS = 2
DATASETS: dict[str, type] = {
    "map": fds.MapFaults,
    "iter": fds.IterFaults,
    "iter_stateful": fds.IterFaultsStateful,
}
_WHAT = {
    fds.SEGV: "was killed by SIGSEGV",
    fds.KILL: "was killed by SIGKILL",
    fds.EXIT: f"exited with code {fds.EXIT_CODE}",
}
# How torch's DataLoader words the same death: the message starts with it.
_TORCH_HEAD = {
    fds.SEGV: "is killed by signal: Segmentation fault.",
    fds.KILL: "is killed by signal: Killed.",
    fds.EXIT: "exited unexpectedly.",
}
_CAUSE = {
    fds.SEGV: "native crash",
    fds.KILL: "out-of-memory killer",
    fds.EXIT: "called exit",
}
_ORPHAN_LIMIT_S = 20.0  # the watchdog needs about 1 s; generous for a loaded machine

pytestmark = pytest.mark.usefixtures("mp_helpers")


# -- helpers ----------------------------------------------------------------------------


def make_loader(dataset: Any, context: str, persistent: bool, **kwargs: Any) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=not isinstance(dataset, torch.utils.data.IterableDataset),
        num_workers=WORKERS,
        collate_fn=fds.collate,
        multiprocessing_context=context,
        generator=torch.Generator().manual_seed(7),
        persistent_workers=persistent,
        **kwargs,
    )


def run(loader: DataLoader, epochs: int) -> list[list[dict[str, Any]]]:
    """Every batch of ``epochs`` epochs; stops the workers afterwards."""
    out = []
    it: SnapIterator | None = None
    try:
        for _ in range(epochs):
            it = iter(loader)
            out.append(list(it))
    finally:
        if it is not None:
            it.close()
    return out


_REFERENCES: dict[tuple[Any, ...], list[list[dict[str, Any]]]] = {}


def reference(kind: str, persistent: bool, epochs: int, n: int = N) -> list[list[dict[str, Any]]]:
    """The uninterrupted stream of the first ``epochs`` (at most 2) epochs, computed
    once per configuration, under fork."""
    key = (kind, persistent, n)
    if key not in _REFERENCES:
        ds = fds.GatedMap(n) if kind == "gated_map" else fds.GatedIter(n) if kind == "gated_iter" else DATASETS[kind](n)
        stream = run(make_loader(ds, "fork", persistent), 2)
        # Copies out of shared memory: a cached tensor must not hold a /dev/shm fd.
        _REFERENCES[key] = [[{k: v.clone() for k, v in b.items()} for b in e] for e in stream]
    return _REFERENCES[key][:epochs]


def assert_same_stream(got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]]) -> None:
    assert len(got) == len(want)
    for epoch, (a, b) in enumerate(zip(got, want)):
        assert_same_batches(a, b, f"epoch {epoch}")


def respawn_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, WorkerRespawnedWarning)]


def where_item(kind: str, item: int) -> tuple[int, str]:
    """(worker slot, how the messages name the batch) for the batch holding ``item``
    in epoch 0, for the layouts of ``_fault_datasets`` with BATCH and WORKERS."""
    if kind == "map":
        raise AssertionError("map-style batches are shuffled: use position_of")
    worker = item % WORKERS
    local = (item // WORKERS) // BATCH
    return worker, f"its batch {local} of epoch 0"


def position_of(ref_epoch: list[dict[str, Any]], item: int) -> int:
    return next(k for k, b in enumerate(ref_epoch) if item in b["index"].tolist())


def marker_info(marker: Path) -> tuple[int, int]:
    pid, worker = marker.read_text().split()
    return int(pid), int(worker)


# -- transient faults: die once, the stream is unchanged ----------------------------------

def pairwise(kinds: list[str]) -> list[tuple[str, str, bool, str]]:
    """Fork cases in which every pair of (dataset kind, persistent, fault) occurs: each
    kind with each fault, persistence alternating. How a worker dies changes only the
    words of the message, and persistence only what happens at the epoch's end, so the
    pairs cover what the full product would (half the cases: each costs a respawn)."""
    return [
        ("fork", kind, (i + j) % 2 == 1, fault)
        for i, kind in enumerate(kinds)
        for j, fault in enumerate(fds.DEATH_KINDS)
    ]


TRANSIENT = pairwise(list(DATASETS)) + [
    # A spawn or forkserver worker takes seconds to start (it imports torch): a subset
    # that still covers every fault, dataset kind and persistent setting.
    ("spawn", "map", False, fds.SEGV),
    ("spawn", "iter", True, fds.KILL),
    ("spawn", "iter_stateful", False, fds.EXIT),
    ("forkserver", "map", True, fds.EXIT),
]


@pytest.mark.parametrize("context,kind,persistent,fault", TRANSIENT)
def test_transient_death_leaves_stream_unchanged(
    tmp_path: Path, context: str, kind: str, persistent: bool, fault: str
) -> None:
    epochs = 2 if persistent or context == "fork" else 1
    want = reference(kind, persistent, epochs)
    item = 13  # iterable: the first sample of worker 1's third batch, after it sent two
    marker = tmp_path / "died"
    ds = DATASETS[kind](N, fds.Fault(fault, item, str(marker)))
    loader = make_loader(ds, context, persistent)
    assert loader.multiprocessing_context.get_start_method() == context
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(loader, epochs)
    assert_same_stream(got, want)
    assert marker.exists(), "the fault never fired: the test tests nothing"
    pid, worker = marker_info(marker)
    messages = respawn_warnings(caught)
    assert len(messages) == 1, messages
    message = messages[0]
    assert f"worker {worker} (pid {pid})" in message
    assert _WHAT[fault] in message
    if kind == "map":
        batch = position_of(want[0], item)
        assert f"batch {batch} of epoch 0" in message
        indices = want[0][batch]["index"].tolist()
        assert f"sample indices {indices}" in message
    else:
        slot, batch_text = where_item(kind, item)
        assert slot == worker
        assert batch_text in message
    assert "respawned" in message and "from its snapshot" in message


# -- poison samples: bounded retries, a clear error, resume at the failed batch -----------

PERMANENT = pairwise(["map", "iter"]) + [
    ("spawn", "map", False, fds.SEGV),
]


@pytest.mark.parametrize("context,kind,persistent,fault", PERMANENT)
def test_poison_sample_ends_in_error_and_resumes_at_failed_batch(
    context: str, kind: str, persistent: bool, fault: str
) -> None:
    retries = 2 if context == "fork" else 1
    want = reference(kind, persistent, 1)[0]
    item = 13
    loader = make_loader(DATASETS[kind](N, fds.Fault(fault, item)), context, persistent,
                         max_worker_retries=retries)
    failed = position_of(want, item)
    got: list[dict[str, Any]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        with pytest.raises(WorkerCrashedError) as excinfo:
            for batch in it:
                got.append(batch)
    message = str(excinfo.value)
    assert message.startswith("DataLoader worker (pid") and _TORCH_HEAD[fault] in message.split("\n")[0]
    # Every batch before the failed one was yielded, and nothing after it.
    assert_same_batches(got, want[:failed], "before the error")
    assert len(respawn_warnings(caught)) == retries
    assert _WHAT[fault] in message
    assert _CAUSE[fault] in message
    assert f"{retries + 1} times" in message
    if kind == "map":
        worker = failed % WORKERS
        assert f"worker {worker} (pid " in message
        assert f"batch {failed} of epoch 0" in message
        assert f"sample indices {want[failed]['index'].tolist()}" in message
    else:
        worker, batch_text = where_item(kind, item)
        assert f"worker {worker} (pid " in message
        assert batch_text in message
    # The iterator is finished and its workers are gone.
    assert list(it) == []
    # A checkpoint taken now resumes at the failed batch.
    state = loader.state_dict()
    # The checkpoint does not depend on the start method; fork restarts fastest.
    fixed = make_loader(DATASETS[kind](N), "fork", persistent, replay="allow")
    fixed.load_state_dict(state)
    resumed = run(fixed, 1)[0]
    assert_same_batches(resumed, want[failed:], "resumed")


# -- exceptions and unpicklable batches: the original error, with where -------------------


@pytest.mark.parametrize(
    "context,kind", [("fork", "map"), ("fork", "iter"), ("spawn", "iter_stateful")]
)
def test_dataset_exception_comes_back_as_itself(context: str, kind: str) -> None:
    want = reference(kind, False, 1)[0]
    item = 13
    failed = position_of(want, item)
    loader = make_loader(DATASETS[kind](N, fds.Fault(fds.RAISE, item)), context, False)
    it = iter(loader)
    got = [next(it) for _ in range(failed)]
    with pytest.raises(fds.PoisonError, match=f"cannot load sample {item}") as excinfo:
        next(it)
    note = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "Caught PoisonError" in note
    assert f"batch {failed} of epoch 0" in note
    assert "Traceback" in note and "_fault_datasets.py" in note
    if kind == "map":
        assert f"worker process {failed % WORKERS} " in note
        assert f"sample indices {want[failed]['index'].tolist()}" in note
        # The loader goes on with the next batch, as torch's does.
        got += list(it)
        assert_same_batches(got, want[:failed] + want[failed + 1:])
    else:
        assert f"worker process {where_item(kind, item)[0]} " in note
        it.close()


@pytest.mark.parametrize(
    "context,fault", [("fork", fds.LAMBDA), ("fork", fds.GENERATOR), ("spawn", fds.LAMBDA)]
)
def test_unpicklable_batch_is_an_error_naming_the_batch(context: str, fault: str) -> None:
    want = reference("map", False, 1)[0]
    item = 13
    failed = position_of(want, item)
    loader = make_loader(fds.MapFaults(N, fds.Fault(fault, item)), context, False)
    it = iter(loader)
    got = [next(it) for _ in range(failed)]
    with pytest.raises(Exception) as excinfo:
        next(it)
    text = str(excinfo.value) + "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "could not be sent" in text and "pickle" in text
    assert f"batch {failed} of epoch 0" in text
    assert f"worker process {failed % WORKERS} " in text
    assert f"sample indices {want[failed]['index'].tolist()}" in text
    got += list(it)
    assert_same_batches(got, want[:failed] + want[failed + 1:])


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batch_that_fails_to_unpickle_in_main_is_the_users_error(context: str) -> None:
    """The worker pickles the batch, the main process cannot rebuild it (a reconstructor
    that raises): the original exception when the batch is due, the worker not killed
    for it, and the next batch next, as torch goes on after a raising batch."""
    want = reference("map", False, 1)[0]
    item = 13
    failed = position_of(want, item)
    loader = make_loader(fds.MapFaults(N, fds.Fault(fds.UNLOADABLE, item)), context, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        pids = list(it.worker_pids)
        got = [next(it) for _ in range(failed)]
        with pytest.raises(fds.RebuildError, match=f"cannot rebuild sample {item} here") as excinfo:
            next(it)
        assert it.worker_pids == pids, "a worker was killed for the user's error"
        got += list(it)
    note = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "Caught RebuildError" in note
    assert f"worker process {failed % WORKERS} " in note
    assert f"batch {failed} of epoch 0" in note
    assert f"sample indices {want[failed]['index'].tolist()}" in note
    assert "in the main process, unpickling the batch" in note
    assert respawn_warnings(caught) == []
    assert_same_batches(got, want[:failed] + want[failed + 1:])


# -- deaths the dataset does not cause ----------------------------------------------------


class _StartKiller:
    """Kills worker 1 in its worker_init_fn (announced by fds.slow_start), ``kills``
    times at most, from a thread."""

    def __init__(self, starts: Path, kills: int) -> None:
        self.starts, self.kills = starts, kills
        self.killed: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        seen: set[str] = set()
        while len(self.killed) < self.kills and not self.stop.is_set():
            for name in sorted(set(os.listdir(self.starts)) - seen):
                seen.add(name)
                pid, worker = map(int, name.split("-"))
                if worker == 1 and len(self.killed) < self.kills:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
            time.sleep(0.005)

    def __enter__(self) -> _StartKiller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("context,kills", [("fork", 3), ("spawn", 1)])
def test_deaths_before_a_batch_starts_never_count_against_a_batch(tmp_path: Path, context: str, kills: int) -> None:
    """Worker 1 is killed while starting up (in worker_init_fn), again and again, with
    its first batch outstanding: while the deaths stay within max_worker_retries the run
    completes and no batch is blamed, and every respawn is announced with its count."""
    want = reference("map", False, 1)[0]
    starts = tmp_path / "starts"
    starts.mkdir()
    init = functools.partial(fds.slow_start, str(starts), 0.3)
    loader = make_loader(fds.MapFaults(N), context, False, max_worker_retries=kills, worker_init_fn=init)
    with warnings.catch_warnings(record=True) as caught, _StartKiller(starts, kills) as killer:
        warnings.simplefilter("always")
        got = run(loader, 1)
    assert len(killer.killed) == kills
    assert_same_stream(got, [want])
    messages = respawn_warnings(caught)
    assert len(messages) == kills, messages
    for death, (pid, message) in enumerate(zip(killer.killed, messages), 1):
        assert f"worker 1 (pid {pid}) was killed by SIGKILL while starting (in worker_init_fn or its set-up), before batch 1 " in message
        assert f"death {death} in a row without a batch, of at most {kills + 1}" in message
        assert "not counted against any batch" in message


def test_a_worker_that_dies_at_every_start_ends_in_an_error_and_resumes_at_the_next_batch(tmp_path: Path) -> None:
    """A node whose OOM killer takes every starting worker must not hang the run: after
    max_worker_retries + 1 deaths in a row without a batch, WorkerCrashedError names the
    phase, the signal and the likely cause; state_dict() then resumes at the next batch."""
    want = reference("map", False, 1)[0]
    starts = tmp_path / "starts"
    starts.mkdir()
    init = functools.partial(fds.slow_start, str(starts), 0.3)
    loader = make_loader(fds.MapFaults(N), "fork", False, max_worker_retries=2, worker_init_fn=init)
    got = []
    with warnings.catch_warnings(record=True) as caught, _StartKiller(starts, 1000) as killer:
        warnings.simplefilter("always")
        it = iter(loader)
        with pytest.raises(WorkerCrashedError) as excinfo:
            for batch in it:
                got.append(batch)
    assert len(killer.killed) == 3
    message = str(excinfo.value)
    assert message.startswith("DataLoader worker (pid ")
    assert f"worker 1 (pid {killer.killed[-1]}) was killed by SIGKILL while starting (in worker_init_fn or its set-up)" in message
    assert "out-of-memory killer" in message
    assert "3 times in a row without producing a batch" in message
    assert "max_worker_retries=2" in message
    assert "state_dict() still resumes at this batch" in message
    assert len(respawn_warnings(caught)) == 2
    assert_same_batches(got, want[:1])  # worker 0's batch 0; batch 1 was worker 1's
    state = loader.state_dict()
    resumed = make_loader(fds.MapFaults(N), "fork", False)
    resumed.load_state_dict(state)
    assert_same_stream(run(resumed, 1), [want[1:]])


_NO_MAIN_GUARD = """
import torch, snaploader
loader = snaploader.DataLoader(torch.arange(8), batch_size=2, num_workers=2,
                               multiprocessing_context={context!r})
print(list(loader))
"""


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_script_without_the_main_guard_fails_at_the_first_start_with_the_hint(tmp_path: Path, context: str) -> None:
    """Under spawn or forkserver a worker imports the main module again; without the
    ``if __name__ == "__main__":`` guard it cannot start. Like torch, that fails at the
    first attempt (no respawns), and the error says what the fix is."""
    script = tmp_path / "no_guard.py"
    script.write_text(_NO_MAIN_GUARD.format(context=context))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert done.returncode != 0
    assert "WorkerCrashedError" in done.stderr
    tail = done.stderr[done.stderr.rindex("WorkerCrashedError"):]
    assert "exited unexpectedly" in tail
    assert "before it could start" in tail
    assert 'if __name__ == "__main__":' in tail
    assert "WorkerRespawnedWarning" not in done.stderr
    # one bootstrap failure per worker process, none from a respawn
    assert done.stderr.count("An attempt has been made to start a new process") <= 2



@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_poison_death_is_blamed_on_its_batch_while_a_sibling_restarts(tmp_path: Path, context: str) -> None:
    """Under spawn and forkserver every worker process maps the shared fetch marks when
    it starts. Worker 1 is killed and respawned while worker 0 is loading a poison
    sample: the new process must leave worker 0's mark alone, or worker 0's death is
    taken for one before any batch, not counted, and the poison sample is loaded once
    more than max_worker_retries allows."""
    starts = tmp_path / "starts"
    starts.mkdir()
    gate = tmp_path / "gate"
    poison = 2  # batch_size 1, no shuffle: batch 2, worker 0's second
    loader = DataLoader(
        fds.GatedPoison(6, poison, str(gate)), batch_size=1, num_workers=2,
        multiprocessing_context=context, max_worker_retries=1,
        worker_init_fn=functools.partial(fds.slow_start, str(starts), 0.0),
    )

    def starts_of_worker_1() -> list[int]:
        return [int(name.split("-")[0]) for name in os.listdir(starts) if name.endswith("-1")]

    def restart_worker_1_during_the_poison_fetch() -> None:
        try:
            deadline = time.monotonic() + 60
            while (not (tmp_path / "gate.fetching").exists() or not starts_of_worker_1()) and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(starts_of_worker_1()[0], signal.SIGKILL)
            while len(starts_of_worker_1()) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            gate.touch()

    restarter = threading.Thread(target=restart_worker_1_during_the_poison_fetch)
    got: list[dict[str, Any]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restarter.start()
        try:
            with pytest.raises(WorkerCrashedError) as excinfo:
                for batch in loader:
                    got.append(batch)
        finally:
            restarter.join()
    assert len(starts_of_worker_1()) >= 2, "worker 1 was not restarted during the poison fetch"
    assert [b["index"].tolist() for b in got] == [[0], [1]]
    assert "worker 0" in str(excinfo.value) and f"while loading batch {poison} of epoch 0" in str(excinfo.value)
    of_worker_0 = [m for m in respawn_warnings(caught) if m.startswith("worker 0 ")]
    assert len(of_worker_0) == 1, of_worker_0
    assert f"while loading batch {poison} of epoch 0" in of_worker_0[0] and "retry 1 of 1" in of_worker_0[0]


class _GateOnWarning(list):  # type: ignore[type-arg]
    """A warnings record that opens ``gate`` when a WorkerRespawnedWarning arrives."""

    def __init__(self, gate: Path) -> None:
        super().__init__()
        self.gate = gate
        self.opened_by_warning = False

    def append(self, w: Any) -> None:
        super().append(w)
        if issubclass(w.category, WorkerRespawnedWarning) and not self.gate.exists():
            self.opened_by_warning = True
            self.gate.touch()


def _record_into(record: list[Any]) -> Callable[..., None]:
    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        record.append(warnings.WarningMessage(message, category, filename, lineno, file, line))

    return show


@pytest.mark.parametrize(
    "context,kind", [("fork", "gated_map"), ("fork", "gated_iter")]
)
def test_worker_killed_while_main_waits(tmp_path: Path, context: str, kind: str) -> None:
    """Kill the worker the main process is waiting on, in the middle of its batch."""
    want = reference(kind, False, 1)[0]
    gate = tmp_path / "gate"
    item = 13
    cls = fds.GatedMap if kind == "gated_map" else fds.GatedIter
    loader = make_loader(cls(N, item, str(gate)), context, False)
    failed = position_of(want, item)
    it = iter(loader)
    got = [next(it) for _ in range(failed)]
    worker = failed % WORKERS if kind == "gated_map" else item % WORKERS
    pid = it.worker_pids[worker]

    def kill_then_open() -> None:
        time.sleep(0.2)  # let the main process block in next()
        os.kill(pid, signal.SIGKILL)
        gate.touch()  # the respawned worker gets through

    killer = threading.Thread(target=kill_then_open)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        killer.start()
        try:
            got += list(it)
        finally:
            killer.join()
    assert_same_batches(got, want)
    messages = respawn_warnings(caught)
    assert len(messages) == 1
    assert f"worker {worker} (pid {pid}) was killed by SIGKILL" in messages[0]


@pytest.mark.parametrize("context", ["fork"])
def test_idle_worker_killed_while_main_waits_is_detected(tmp_path: Path, context: str) -> None:
    """Worker 1 has nothing outstanding; the main process waits on worker 0's last
    batch, which only arrives once worker 1's death has been seen and handled."""
    n = 10  # 4 batches, all dispatched at once: worker 0 makes 0 and 2, worker 1 makes
    n_batches = 4  # 1 and 3, so after 3 batches worker 0 has nothing outstanding
    want = reference("gated_map", True, 2, n=n)
    last = want[0][-1]["index"].tolist()
    gate = tmp_path / "gate"
    loader = make_loader(fds.GatedMap(n, last[0], str(gate)), context, True)
    it = iter(loader)
    got = [next(it) for _ in range(n_batches - 1)]
    assert it.dispatched == n_batches
    waited = (n_batches - 1) % WORKERS
    idle = 1 - waited
    pid = it.worker_pids[idle]
    os.kill(pid, signal.SIGKILL)
    record = _GateOnWarning(gate)
    # A fallback so that a missed death fails the test instead of hanging it.
    fallback = threading.Timer(30.0, gate.touch)
    fallback.start()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _record_into(record)
        try:
            got += list(it)
            second = list(iter(loader))
        finally:
            fallback.cancel()
            it.close()
    assert record.opened_by_warning, "the death of the idle worker was not noticed while waiting"
    assert_same_stream([got, second], want)
    messages = respawn_warnings(record)
    assert len(messages) == 1
    assert f"worker {idle} (pid {pid}) was killed by SIGKILL" in messages[0]


@pytest.mark.parametrize("context,kind", [("fork", "map"), ("fork", "iter"), ("fork", "iter_stateful")])
def test_persistent_worker_killed_between_epochs(context: str, kind: str) -> None:
    want = reference(kind, True, 2)
    loader = make_loader(DATASETS[kind](N), context, True)
    it = iter(loader)
    try:
        first = list(it)
        pids = it.worker_pids
        os.kill(pids[0], signal.SIGKILL)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            second = list(iter(loader))
        assert it.worker_pids[0] != pids[0]
    finally:
        it.close()
    assert_same_stream([first, second], want)
    messages = respawn_warnings(caught)
    assert len(messages) == 1 and f"worker 0 (pid {pids[0]}) was killed by SIGKILL" in messages[0]


@pytest.mark.parametrize("context,kind", [("fork", "map"), ("fork", "iter"), ("fork", "iter_stateful")])
def test_sender_killed_right_after_sending(tmp_path: Path, context: str, kind: str) -> None:
    """The worker returns a batch of tensors (in shared memory) and is SIGKILLed a moment
    later, possibly before the main process has opened them: either the batch counts
    as received or it is produced again, never lost and never doubled."""
    want = reference(kind, False, 1)
    marker = tmp_path / "died"
    item = 13
    ds = DATASETS[kind](N, fds.Fault(fds.KILL_AFTER, item, str(marker)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(make_loader(ds, context, False), 1)
    assert_same_stream(got, want)
    assert marker.exists()
    pid, worker = marker_info(marker)
    # Killed 2 ms after returning the sample: it died before the epoch ended, unless
    # the epoch's end stopped it first (then there is nothing to respawn).
    messages = respawn_warnings(caught)
    assert len(messages) <= 1
    if messages:
        assert f"worker {worker} (pid {pid}) was killed by SIGKILL" in messages[0]


# -- the main process dies -----------------------------------------------------------------


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_workers_exit_when_the_main_process_is_killed() -> None:
    mp = multiprocessing.get_context("fork")
    receive, send = mp.Pipe(duplex=False)
    child = mp.Process(target=fds.run_loader_child, args=(send,))
    child.start()
    send.close()
    helper: int | None = None
    left: list[int] = []
    try:
        assert receive.poll(120), "the child never started its loader"
        workers, helper = receive.recv()
        assert child.pid is not None
        descendants = {p.pid for p in psutil.Process(child.pid).children(recursive=True)}
        assert set(workers) <= descendants and len(workers) == WORKERS
        descendants.discard(helper)  # not snaploader's: the test ends it
        child.kill()
        child.join()
        deadline = time.monotonic() + _ORPHAN_LIMIT_S
        while not all(_gone(p) for p in descendants) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in descendants if not _gone(p)]
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
            child.join()
        for pid in left + ([] if helper is None else [helper]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"processes still running {_ORPHAN_LIMIT_S} s after the main process died: {left}"
