"""Helpers shared by the tests: exact comparison of batch streams, running loaders,
and fixtures that start multiprocessing's helper processes before the leak check."""

from __future__ import annotations

import importlib.util
import io
import multiprocessing
import os
import socket
import subprocess
import sys
import warnings
import multiprocessing.forkserver
import multiprocessing.resource_tracker
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch


def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    """Bit-for-bit equality of two (nested) batches: tensors by torch.equal with the
    same dtype and shape, containers element by element, everything else by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {b!r:.200}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_stream(got: list[Any], expected: list[Any], what: str = "stream") -> None:
    assert len(got) == len(expected), f"{what}: {len(got)} batches, expected {len(expected)}"
    for k, (x, y) in enumerate(zip(got, expected)):
        assert_same(x, y, f"{what} batch {k}")


def epochs(loader: Iterable[Any], count: int, before_epoch: Callable[[int], None] | None = None) -> list[list[Any]]:
    """``count`` full epochs of ``loader``, one list of batches per epoch."""
    out = []
    for epoch in range(count):
        if before_epoch is not None:
            before_epoch(epoch)
        out.append(list(loader))
    return out


def take(iterator: Iterator[Any], k: int) -> list[Any]:
    out = []
    for _ in range(k):
        out.append(next(iterator))
    return out


def through_bytes(state: Any) -> Any:
    """``state`` after torch.save and torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def cut_state(loader: Any, epochs_before: int, cut: int) -> dict[str, Any]:
    """``loader``'s state after ``epochs_before`` whole epochs and ``cut`` batches of the
    next, through torch.save/torch.load(weights_only=True); its warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs_before):
            list(loader)
        iterator = iter(loader)
        for _ in range(cut):
            next(iterator)
        state = through_bytes(loader.state_dict())
        del iterator
    return state


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
