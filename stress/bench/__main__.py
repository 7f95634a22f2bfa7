"""The benchmark's orchestration and command line: runs every measure of a Config in
order, writes results.json and prints the tables. ``python stress/bench.py`` and ``python -m stress.bench`` (from the
repository root) both land in ``main()`` here; the package's docstring says what is
measured."""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import __doc__ as _PACKAGE_DOC
from .config import Config
from .contenders import available, find_contenders
from .report import render_text
from .pinning import PIN_WORKERS, measure_pinning
from .restore import measure_restore
from .seed_per_sample import measure_seed_per_sample
from .shards import measure_shards
from .snapshot import measure_snapshot
from .state_dict import measure_state_dict
from .throughput import measure_workload, run_trial
from .training_loop import measure_training_loop
from .workloads import WORKLOADS, TinyItems, calibrate_compute_rounds


def _plain_json(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so results.json is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    return value


def run(config: Config, out_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every measurement of ``config``; writes results.json into ``out_dir`` and returns
    the report."""
    with warnings.catch_warnings():
        # W=4 on 2 cores is on purpose; torchdata's deprecation notice is not ours
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        # the memory sampler is a thread; Python >= 3.12 warns about any fork beside one
        warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks.*")
        return _run(config, out_dir, log)


def _run(config: Config, out_dir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    contenders = find_contenders(config.contenders)
    active = available(contenders)
    for c in contenders.values():
        if c.skipped:
            log(f"{c.name}: skipped, {c.skipped}")
    rounds, item_ms = calibrate_compute_rounds()
    log(f"compute items: {rounds} rounds = {item_ms:.3f} ms per item")
    report: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "start_method": multiprocessing.get_start_method(),
            "loadavg_start": list(os.getloadavg()),
            "compute_rounds": rounds,
            "compute_item_ms": item_ms,
        },
        "config": asdict(config),
        "contenders": {
            c.name: {"version": c.version, "skipped": c.skipped} for c in contenders.values()
        },
        "workloads": {},
        "timing_s": {},
    }
    # Warm-up: the first loader of a process pays one-off costs (imports, shared-memory
    # manager, page faults) that belong to no contender.
    for c in active:
        run_trial(c, TinyItems(64 * 8), 64, 1, config.seed)

    t0 = time.perf_counter()
    log(f"throughput sweep, W in {config.workers}, {config.repeats} repeats")
    for ws in WORKLOADS:
        if ws.name not in config.workloads:
            continue
        report["workloads"][ws.name] = {
            "description": ws.description,
            "batch_size": ws.batch_size,
            "epoch_batches": config.workloads[ws.name],
            "by_workers": measure_workload(
                ws.name, active, config.workers, config.repeats, config.workloads[ws.name],
                rounds, config.trial_s, config.seed, log,
            ),
        }
    report["timing_s"]["throughput"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("snapshot cost in a worker")
    for name, entry in report["workloads"].items():
        entry["snapshot"] = measure_snapshot(name, rounds, config.snapshot_calls)
        log(f"  {name:8s} {entry['snapshot']['snapshot_after_batch_us']:.1f} us right after a batch, "
            f"{entry['snapshot']['snapshot_us']:.1f} us in a loop")
    report["timing_s"]["snapshot"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("state_dict() latency and size")
    report["state_dict"] = measure_state_dict(
        active, config.state_dict_cases, config.state_dict_warm_calls, config.seed
    )
    for r in report["state_dict"]:
        log(f"  {r['loader']:10s} W={r['workers']} {r['pipeline']:5s} length {r['dataset_len']:>10,}: cold "
            + " / ".join(f"{r['cold'][k]:.0f}" for k in ("median_us", "p99_us", "max_us"))
            + " us (median / p99 / max), warm "
            + " / ".join(f"{r['warm'][k]:.0f}" for k in ("median_us", "p99_us", "max_us"))
            + f" us, {r['size_bytes'] / 1024:.1f} KB")
    report["timing_s"]["state_dict"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log(f"training loop with state_dict() after every step, W={config.checkpoint_workers}")
    report["training_loop"] = measure_training_loop(
        active, config.loop_cases, config.checkpoint_workers, config.loop_repeats, config.seed, log
    )
    report["timing_s"]["training_loop"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log(f"seed_per_sample=True: cost per sample, W in {config.seed_workers}, {config.seed_repeats} repeats")
    report["seed_per_sample"] = measure_seed_per_sample(
        active, config.seed_workers, config.seed_repeats, config.seed_batches, config.trial_s,
        config.seed_states_calls, config.seed, log,
    )
    report["timing_s"]["seed_per_sample"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log(f"pin_memory=True with the stand-in pin beside a training step, W={PIN_WORKERS}, {config.pin_repeats} repeats")
    report["pinning"] = measure_pinning(active, config.pin_repeats, config.pin_batches, config.seed, log)
    report["timing_s"]["pinning"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("restore: load_state_dict() to first batch")
    report["restore"] = measure_restore(
        active, config.restore_items, config.restore_batch_size, config.restore_late_fraction,
        config.restore_repeats, config.table_workers, config.seed, log, config.restore_fractions,
    )
    report["timing_s"]["restore"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    log("shard stream: a resume late in the epoch, by state and by replay, to the first batch")
    report["shards"] = measure_shards(
        *config.shards, config.shards_read_ms, config.shards_fraction, config.shards_repeats, config.seed, log
    )
    report["timing_s"]["shards"] = time.perf_counter() - t0

    report["meta"]["loadavg_end"] = list(os.getloadavg())
    report["timing_s"]["total"] = time.time() - started
    (out_dir / "results.json").write_text(
        json.dumps(_plain_json(report), indent=1, allow_nan=False) + "\n"
    )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(_PACKAGE_DOC or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (2-3 minutes): the CI smoke test")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory")
    parser.add_argument("--repeats", type=int, help="override the number of interleaved repeats")
    parser.add_argument("--no-torchdata", action="store_true", help="leave torchdata out")
    args = parser.parse_args(argv)
    config = Config.quick() if args.quick else Config.full()
    if args.repeats:
        config.repeats = args.repeats
    if args.no_torchdata:
        config.contenders = tuple(c for c in config.contenders if c != "torchdata")
    report = run(config, args.out)
    print()
    print(render_text(report))
    print(f"\nwrote {args.out / 'results.json'}")
    print(f"took {report['timing_s']['total']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
