"""``pin_memory=True`` beside the training step (issue 34; ``snaploader/_workers/pinning.py``).

On a machine without an accelerator, with the stand-in of ``stress/_pin_standin.py``: the
accelerator calls faked so that torch's DataLoader and snaploader's both take their
pinning path, and torch's pin function sleeping ``PIN_S`` a batch (a copy into
page-locked memory releases the GIL as a sleep does). The training step sleeps
``STEP_S`` (a GPU step leaves the CPU to other threads as well). torch pins in a thread,
beside the step; a loader that pinned on the training thread would add the pin to every
step (0.58-0.62x of torch's throughput before issue 34). Each repeat times both loaders,
in alternating order, over the same batches at ``PIN_WORKERS`` workers; the ratio is the
median of the repeats' ratios. ``stress/gpu_check.py`` measures the real pin on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from stress._pin_standin import fake_pinning
from stress._probes import median

from .contenders import Contender, close_iterator
from .workloads import TinyItems

PIN_WORKERS: Final = 2
PIN_S: Final = 0.004
STEP_S: Final = 0.004
PIN_BATCH: Final = 64


def pin_trial(contender: Contender, batches: int, seed: int) -> float:
    """Batches a second over ``batches`` steps after the first batch, pinned by the stand-in."""
    assert contender.make is not None
    loader = contender.make(
        TinyItems(PIN_BATCH * (batches + 2)), batch_size=PIN_BATCH, shuffle=True, num_workers=PIN_WORKERS,
        generator=torch.Generator().manual_seed(seed), pin_memory=True,
    )
    iterator = iter(loader)
    try:
        next(iterator)
        started = time.perf_counter()
        for _ in range(batches):
            next(iterator)
            time.sleep(STEP_S)  # the training step
        return batches / (time.perf_counter() - started)
    finally:
        close_iterator(iterator)
        del iterator


def measure_pinning(
    active: Sequence[Contender], repeats: int, batches: int, seed: int, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """torch's and snaploader's throughput with the stand-in pin, and their ratio."""
    both = [c for c in active if c.name in ("torch", "snaploader")]
    if len(both) < 2 or repeats < 1:
        return {}
    rates: dict[str, list[float]] = {c.name: [] for c in both}
    with fake_pinning(PIN_S):
        for repeat in range(repeats):
            for contender in both if repeat % 2 == 0 else both[::-1]:
                rates[contender.name].append(pin_trial(contender, batches, seed + repeat))
    ratios = [ours / theirs for ours, theirs in zip(rates["snaploader"], rates["torch"])]
    result = {
        "workers": PIN_WORKERS,
        "pin_ms": PIN_S * 1e3,
        "step_ms": STEP_S * 1e3,
        "batches": batches,
        "repeats": repeats,
        "throughput_bps": {name: median(values) for name, values in rates.items()},
        "ratios": ratios,
        "ratio_to_torch": median(ratios),
    }
    log(f"  torch {result['throughput_bps']['torch']:.1f} b/s, snaploader "
        f"{result['throughput_bps']['snaploader']:.1f} b/s, ratio {result['ratio_to_torch']:.3f} "
        f"(per repeat {', '.join(f'{r:.3f}' for r in ratios)})")
    return result

