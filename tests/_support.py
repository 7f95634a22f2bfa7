"""Helpers shared by the tests: exact comparison of batch streams, running loaders,
and fixtures that start multiprocessing's helper processes before the leak check."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import multiprocessing.forkserver
import multiprocessing.resource_tracker
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any
import pytest


# The stream comparisons live in _streams.py, which needs no pytest (the stress scripts
# import them in a `.[cpu]` install); re-exported here for the tests.
from ._streams import (  # noqa: F401
    assert_same,
    assert_same_stream,
    cut_state,
    epochs,
    generator,
    take,
    through_bytes,
)


_HAMMER_JOIN_S = 10.0


@contextlib.contextmanager
def states_meanwhile(loader: Any) -> Iterator[list[dict[str, Any]]]:
    """``loader.state_dict()`` called again and again from another thread while the
    block runs (as an async checkpoint writer would); yields the list of states taken."""
    taken: list[dict[str, Any]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            taken.append(loader.state_dict())

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        yield taken
    finally:
        stop.set()
        thread.join(_HAMMER_JOIN_S)
    assert not thread.is_alive(), f"state_dict() from another thread did not return within {_HAMMER_JOIN_S} s"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def mp_helpers() -> None:
    """Start the forkserver and the resource tracker (long-lived helper processes that
    multiprocessing starts on first use of spawn or forkserver) before any test's leak
    check, so that they are not counted as processes the test left behind."""
    multiprocessing.resource_tracker.ensure_running()
    multiprocessing.forkserver.ensure_running()


def load_stress_script(name: str) -> ModuleType:
    """The script ``stress/<name>.py`` as a module (stress/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "stress" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"snaploader_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up
    spec.loader.exec_module(module)
    return module


def wait_all(children: list[subprocess.Popen[str]], timeout_s: float) -> list[str]:
    """The output of each child once all have exited; all are killed when one of them
    has not exited within ``timeout_s`` (a rank waiting forever on a dead peer)."""
    logs = []
    for child in children:
        try:
            logs.append(child.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
                other.communicate()
            raise
    return logs


def run_ranks(args: list[str], world: int, timeout_s: float) -> list[tuple[int, str]]:
    """``python -m <args>`` as ``world`` fresh processes of one job (with ``world`` > 1,
    ranks of a gloo group on loopback: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT`` set as torchrun sets them); each one's exit status
    and output."""
    root = Path(__file__).resolve().parents[1]
    base = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        base.pop(name, None)
    port = free_port()
    children = []
    for rank in range(world):
        env = dict(base)
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        children.append(subprocess.Popen([sys.executable, "-m", *args], cwd=root, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = wait_all(children, timeout_s)
    return [(child.returncode, log) for child, log in zip(children, logs)]
