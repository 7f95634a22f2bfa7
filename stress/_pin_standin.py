"""A stand-in for pinning on a machine without an accelerator, shared by the benchmark,
``stress/gpu_check.py`` and the tests: the accelerator calls that decide whether and for
which device a loader pins (``torch.accelerator``'s ``is_available``,
``current_accelerator``, ``current_device_index``, ``set_device_index``) are faked, so
torch's DataLoader and snaploader's both take their pinning path; torch's pin function
(``torch.utils.data._utils.pin_memory.pin_memory``, what both loaders call) sleeps once
a batch (a copy into page-locked memory releases the GIL as a sleep does: 4 ms is a
256x3x224x224 uint8 batch at ~10 GB/s) and then walks the batch as torch does
(namedtuples, mappings, a batch's own ``pin_memory()``), with ``Tensor.pin_memory`` a
copy. Each batch's call is recorded with the thread it ran on.

Imported as ``stress._pin_standin`` with the repository root on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.utils.data._utils import pin_memory as torch_pin_memory


@dataclass
class PinRecord:
    """What the stand-in saw: per call of torch's pin function, its thread's name and
    the device it was asked to pin for."""

    calls: list[tuple[str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def threads(self) -> set[str]:
        with self.lock:
            return {name for name, _ in self.calls}

    def count(self) -> int:
        with self.lock:
            return len(self.calls)


@contextlib.contextmanager
def fake_pinning(sleep_s: float = 0.004, fail: Any = None) -> Iterator[PinRecord]:
    """Within it, loaders with ``pin_memory=True`` pin through the stand-in. ``fail``:
    a predicate on a batch; torch's pin function raises ``RuntimeError`` for a batch it
    accepts (an exception inside pinning)."""
    record = PinRecord()
    real = torch_pin_memory.pin_memory
    inside = threading.local()  # torch's function calls itself (by its module's name) per element

    def pin(data: Any, device: str | None = None) -> Any:
        if getattr(inside, "depth", 0):
            return real(data, device)
        with record.lock:
            record.calls.append((threading.current_thread().name, device))
        time.sleep(sleep_s)
        if fail is not None and fail(data):
            raise RuntimeError("the stand-in pin failed for this batch")
        inside.depth = 1
        try:
            return real(data, device)
        finally:
            inside.depth = 0

    def tensor_pin(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.clone()

    fake_device = torch.device("cuda")
    with contextlib.ExitStack() as stack:
        for name, value in [
            ("is_available", lambda *a, **k: True),
            ("current_accelerator", lambda *a, **k: fake_device),
            ("current_device_index", lambda *a, **k: 0),
            ("set_device_index", lambda *a, **k: None),
        ]:
            stack.enter_context(mock.patch.object(torch.accelerator, name, value))
        stack.enter_context(mock.patch.object(torch_pin_memory, "pin_memory", pin))
        stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", tensor_pin))
        yield record
