"""How a dead worker is described: the exit in words, torch's own wording for it, the
usual cause, what the worker was doing, and the messages of the warnings and errors of
``_workers/process_runner.py`` (:class:`Death`)."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Final

from .._errors import short_indices
from .pool import FetchMarks


def describe_exit(exitcode: int | None) -> str:
    """'was killed by SIGKILL' / 'exited with code 3' / 'is still running'."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def torch_wording(pid: int, exitcode: int | None) -> str:
    """How torch's DataLoader reports a dead worker, word for word (scripts and restart
    wrappers grep for it): the head of snaploader's own message."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.strsignal(-exitcode) or f"signal {-exitcode}"
        except ValueError:
            name = f"signal {-exitcode}"
        return f"DataLoader worker (pid {pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid(s) {pid}) exited unexpectedly."


_LIKELY_CAUSE: Final = {
    "SIGKILL": "often the out-of-memory killer",
    "SIGSEGV": "a native crash, often in a decoder or C extension",
    "SIGBUS": "a native crash, often a truncated memory-mapped file or full /dev/shm",
    "SIGABRT": "a native abort, often a failed assertion in a C extension",
}

_CALLED_EXIT: Final = (
    "the worker process called exit(): sys.exit() or os._exit() in dataset code, or "
    "a library that gave up"
)

# With Python's own words for the missing guard (multiprocessing's bootstrapping
# error), which torch's users know from its DataLoader under spawn.
CANNOT_START: Final = (
    "a worker that cannot start is not respawned. This probably means that you are not using fork to start your child processes "
    "and you have forgotten to use the proper idiom in the main module: "
    'if __name__ == "__main__": ... (under spawn or forkserver each worker imports the '
    "main module again, and a loader built at its top level starts workers of its own). "
    "Its stderr above says why it failed"
)


def likely_cause(exitcode: int | None) -> str:
    """The usual reason a worker ends with ``exitcode``, as " (...)" to append to a
    message, or "" when there is none to give. (A worker that exits before it could
    start is told apart by its fetch mark: ``_workers/process_runner.py``.)"""
    how = describe_exit(exitcode)
    cause = _LIKELY_CAUSE.get(how.rsplit(" ", 1)[-1], "")
    if not cause and (exitcode or 0) >= 0:
        cause = _CALLED_EXIT
    return f" ({cause})" if cause else ""


_PHASES: Final = {
    FetchMarks.UNSTARTED: "being started (it died before it could start: no worker code ran)",
    FetchMarks.STARTING: "starting (in worker_init_fn or its set-up)",
    FetchMarks.RESTORING: "restoring its snapshot",
    FetchMarks.IDLE: "idle",
}


def worker_name(slot: int, processes: int, count: int) -> str:
    """Logical worker ``slot`` of ``count``, hosted by one of ``processes`` processes."""
    if processes == count:
        return f"worker {slot}"
    return f"worker process {slot % processes} (hosting logical worker {slot})"


def doing(epoch: int, iterable: bool, key: int | None, indices: Any, fetching: bool, mark: int) -> str:
    """What a worker was doing when it died: loading the batch of task ``key`` (None:
    no task was due), or the phase its fetch mark ``mark`` names before that batch."""
    phase = _PHASES.get(mark, "idle")
    if key is None:
        return f"{phase} in epoch {epoch}"
    if iterable:
        batch = f"its batch {key} of epoch {epoch}"
    else:
        batch = f"batch {key} of epoch {epoch} (sample indices {short_indices(indices)})"
    return f"loading {batch}" if fetching else f"{phase}, before {batch}"


@dataclass(frozen=True)
class Death:
    """A worker process's death, in words: ``who`` (:func:`worker_name`) died with
    ``exitcode`` while ``what`` (:func:`doing`)."""

    pid: int
    exitcode: int | None
    who: str
    what: str

    def said(self) -> str:
        """The news, for the respawn warning."""
        return f"{self.who} (pid {self.pid}) {describe_exit(self.exitcode)} while {self.what}{likely_cause(self.exitcode)}"

    def _head(self) -> str:
        return f"{torch_wording(self.pid, self.exitcode)} {self.said()}"

    def cannot_start(self) -> str:
        head = f"{torch_wording(self.pid, self.exitcode)} {self.who} (pid {self.pid}) {describe_exit(self.exitcode)} while {self.what}"
        return f"{head}; {CANNOT_START}"

    def storm(self, times: int, retries: int) -> str:
        return (
            f"{self._head()}, {times} times in a row without producing a batch; gave up after "
            f"{times - 1} respawn(s) (at most max_worker_retries + 1 deaths of a process between "
            f"two of its results, max_worker_retries={retries}). state_dict() still resumes at this batch"
        )

    def poison(self, times: int, retries: int) -> str:
        return (
            f"{self._head()}, {times} times in a row; gave up after {retries} respawn(s) "
            f"(max_worker_retries={retries}). The batch likely holds a sample that crashes the "
            "dataset code; state_dict() still resumes at this batch"
        )
