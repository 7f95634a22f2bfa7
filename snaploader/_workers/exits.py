"""How a dead worker is described: the exit in words, torch's own wording for it, and
the usual cause, for the warnings and errors of ``_workers/process_runner.py``."""

from __future__ import annotations

import signal
from typing import Final


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

# Python's own words for the missing guard (multiprocessing's bootstrapping error),
# which torch's users know from its DataLoader under spawn.
NO_MAIN_GUARD: Final = (
    "This probably means that you are not using fork to start your child processes "
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
