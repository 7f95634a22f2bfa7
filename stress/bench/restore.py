"""The time from ``load_state_dict()`` to the first batch, resuming early, at given
fractions and late in a long shuffled epoch, beside every contender's cold start; and
whether the restored batch is the one the uninterrupted run yielded."""

from __future__ import annotations

import gc
import io
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from stress._probes import median, saved_bytes

from .config import TABLE_WORKERS
from .contenders import Contender, build_loader, close_iterator
from .workloads import AugmentedTinyItems

def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def time_first_batch(loader: Any, state: Any) -> tuple[float, Any]:
    """ms from ``load_state_dict(state)`` (None: no checkpoint, a cold start) and
    ``iter()`` to the first batch, and that batch; the iterator's workers stopped."""
    gc.collect()
    t0 = time.perf_counter()
    if state is not None:
        loader.load_state_dict(state)
    iterator = iter(loader)
    batch = next(iterator)
    elapsed = time.perf_counter() - t0
    close_iterator(iterator)
    return elapsed * 1e3, batch


def restore_positions(total: int, late_fraction: float, fractions: Sequence[float]) -> dict[str, int]:
    """Label -> the batch after which a checkpoint is taken: ``early`` (batch 1), one per
    fraction strictly between (labelled like ``10%``), and ``late``, in that order."""
    late = max(2, int(total * late_fraction))
    positions = {"early": 1}
    for fraction in sorted(fractions):
        k = int(total * fraction)
        if max(positions.values()) < k < late:
            positions[f"{fraction:.0%}"] = k
    positions["late"] = late
    return positions


def measure_restore(
    contenders: Sequence[Contender],
    items: int,
    batch_size: int,
    late_fraction: float,
    repeats: int,
    workers: int = TABLE_WORKERS,
    seed: int = 0,
    log: Callable[[str], None] = print,
    fractions: Sequence[float] = (),
) -> dict[str, Any]:
    """Time from load_state_dict() to the first batch, resuming at batch 1 (early) and
    at ``late_fraction`` of a long shuffled epoch (late); and every contender's cold
    start (iter() to first batch, no checkpoint). Each checkpoint is taken once, saved
    with torch.save and loaded with weights_only=True before each timed restore; the
    restored batch is compared with the one the uninterrupted run yielded next (its
    items draw from the workers' NumPy RNG, so this checks the RNG states too)."""
    dataset = AugmentedTinyItems(items)
    total = items // batch_size
    positions = restore_positions(total, late_fraction, fractions)
    stateful = [c for c in contenders if c.name != "torch"]
    saved: dict[tuple[str, str], tuple[bytes, Any]] = {}
    for contender in stateful:
        # one pass per contender: a checkpoint at each position, then the batch after it
        loader = build_loader(contender, dataset, batch_size, workers, seed)
        iterator = iter(loader)
        done = 0
        try:
            for label, k in sorted(positions.items(), key=lambda item: item[1]):
                while done < k:
                    next(iterator)
                    done += 1
                saved[(contender.name, label)] = (saved_bytes(loader.state_dict()), next(iterator))
                done += 1
        finally:
            close_iterator(iterator)
            del iterator, loader
            gc.collect()
    log(f"  checkpoints taken at batches {positions} of {total}")

    cases: list[tuple[Contender, str]] = [(c, "cold") for c in contenders]
    cases += [(c, label) for c in stateful for label in positions]
    times: dict[tuple[str, str], list[float]] = {(c.name, label): [] for c, label in cases}
    matches: dict[tuple[str, str], bool] = {}
    for rep in range(repeats):
        shift = rep % len(cases)
        for contender, label in [*cases[shift:], *cases[:shift]]:
            loader = build_loader(contender, dataset, batch_size, workers, seed)
            state = None
            if label != "cold":
                blob, expected = saved[(contender.name, label)]
                state = torch.load(io.BytesIO(blob), weights_only=True)
            elapsed_ms, batch = time_first_batch(loader, state)
            del loader
            times[(contender.name, label)].append(elapsed_ms)
            if label != "cold":
                ok = _same(batch, expected)
                matches[(contender.name, label)] = matches.get((contender.name, label), True) and ok

    result: dict[str, Any] = {
        "items": items,
        "batch_size": batch_size,
        "workers": workers,
        "batches_per_epoch": total,
        "positions": positions,
        "loaders": {},
    }
    for contender in contenders:
        entry: dict[str, Any] = {
            "cold_ms": median(times[(contender.name, "cold")]),
            "cold_runs_ms": times[(contender.name, "cold")],
        }
        if contender.name != "torch":
            for label in positions:
                entry[f"{label}_ms"] = median(times[(contender.name, label)])
                entry[f"{label}_runs_ms"] = times[(contender.name, label)]
                entry[f"{label}_batch_matches"] = matches[(contender.name, label)]
            entry["late_over_early"] = entry["late_ms"] / entry["early_ms"]
        result["loaders"][contender.name] = entry
    return result
