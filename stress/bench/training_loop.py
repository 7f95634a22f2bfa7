"""A training loop that calls ``state_dict()`` after every step, against the same loop
without the call (issue 24): its throughput in steps per second, per pipeline, for
snaploader and torchdata's StatefulDataLoader (``snapshot_every_n_steps=1``, its
default), with torch's DataLoader (no call) for scale.

The loop does nothing else: no model work hides the call's cost, so the ratio is the
least a real loop would see. Every variant runs ``repeats`` times, interleaved with
the starting one rotating (A B C, B C A, ...); each trial builds a fresh loader with
persistent workers, seeded apart from every other (``config.LOOP_SEEDS_FROM`` says
why), and times from the first batch to the last (worker start-up is apart). The ratio of a loader's loop with the call to the one without is taken per
repeat (the two ran close in time) and its median reported, beside the main process's
CPU time a step with and without the call: on a machine with fewer cores than
workers, every µs of it is taken from the workers too.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from stress._probes import median

from .config import LOOP_SEEDS_FROM, STATE_DICT_BATCH, LoopCase
from .contenders import Contender, build_loader, close_iterator
from .workloads import pipeline


def measure_training_loop(
    contenders: Sequence[Contender],
    cases: Sequence[LoopCase],
    workers: int,
    repeats: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """One row per case: per contender, steps/s without the call and (contenders with a
    ``state_dict()``) with it, and the median per-repeat ratio of the two."""
    rows = []
    trial_seed = seed + LOOP_SEEDS_FROM  # a seed per trial: see config.LOOP_SEEDS_FROM
    for case in cases:
        if case.steps < 2:
            raise ValueError(f"a training-loop case needs at least 2 steps to time, got {case.steps}")
        pipe = pipeline(case.pipeline)
        dataset = pipe.make(case.steps * STATE_DICT_BATCH)
        variants = [(c, False) for c in contenders]
        variants += [(c, True) for c in contenders if c.name != "torch"]
        runs: dict[tuple[str, bool], list[float]] = {(c.name, calls): [] for c, calls in variants}
        cpu: dict[tuple[str, bool], list[float]] = {(c.name, calls): [] for c, calls in variants}
        for rep in range(repeats):
            shift = rep % len(variants)
            for contender, calls in [*variants[shift:], *variants[:shift]]:
                trial_seed += 1
                loader = build_loader(
                    contender, dataset, STATE_DICT_BATCH, workers, trial_seed, persistent=pipe.persistent
                )
                steps_per_s, cpu_us = _steps_per_s(loader, case.steps, calls)
                runs[(contender.name, calls)].append(steps_per_s)
                cpu[(contender.name, calls)].append(cpu_us)
                del loader
                gc.collect()
        loaders: dict[str, dict[str, Any]] = {}
        for contender in contenders:
            without = runs[(contender.name, False)]
            entry: dict[str, Any] = {
                "without_sps": median(without),
                "without_runs_sps": without,
                "without_main_cpu_us": median(cpu[(contender.name, False)]),
            }
            if (contender.name, True) in runs:
                with_ = runs[(contender.name, True)]
                entry["with_sps"] = median(with_)
                entry["with_main_cpu_us"] = median(cpu[(contender.name, True)])
                entry["with_runs_sps"] = with_
                entry["with_over_without"] = median([a / b for a, b in zip(with_, without)])
            loaders[contender.name] = entry
        rows.append(
            {"pipeline": case.pipeline, "workers": workers, "steps": case.steps, "loaders": loaders}
        )
        log(
            f"  {case.pipeline:6s} W={workers}: "
            + "  ".join(
                f"{name} {e['without_sps']:.1f} steps/s"
                + (f", {e['with_sps']:.1f} with the call ({e['with_over_without']:.3f}x)" if "with_sps" in e else "")
                for name, e in loaders.items()
            )
        )
    return rows


def _steps_per_s(loader: Any, steps: int, calls: bool) -> tuple[float, float]:
    """Steps per second over one epoch of ``steps`` batches, from the first batch to
    the last, each step followed by ``loader.state_dict()`` when ``calls``; and the
    main process's CPU time a step over the same span (µs)."""
    iterator = iter(loader)
    try:
        next(iterator)
        if calls:
            loader.state_dict()
        t_first = time.perf_counter()
        cpu_first = time.process_time()
        for _ in range(steps - 1):
            next(iterator)
            if calls:
                loader.state_dict()
        elapsed = time.perf_counter() - t_first
        cpu_s = time.process_time() - cpu_first
    finally:
        close_iterator(iterator)
    return (steps - 1) / elapsed, cpu_s / (steps - 1) * 1e6
