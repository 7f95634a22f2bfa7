"""Runs doc code blocks for test_docs.py, each as a script in a process of its own.

Importing torch takes seconds, more than most blocks take to run. So this process
imports torch, NumPy and snaploader once and then, for each script path read from
stdin, forks a child that runs the script as ``__main__`` (``runpy.run_path``: a
fresh namespace, ``__file__`` set, so spawn workers re-import it as they would a
user's script), with its output in ``<script>.out``, and exits as an interpreter
would (atexit handlers, multiprocessing's clean-up). It answers each path with the
child's exit status on stdout. The parent test enforces the timeout.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback

import numpy  # noqa: F401  (the imports every block pays for, paid once)
import torch  # noqa: F401

import snaploader  # noqa: F401


def _child(script: str) -> None:
    out = os.open(script + ".out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.chdir(os.path.dirname(script))
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` does
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for line in sys.stdin:
        script = line.strip()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(script)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
