"""Throughput, first-batch latency, CPU time and memory of whole epochs: one trial per
contender, workload and num_workers, interleaved and repeated, summarized by medians."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from stress._probes import children_cpu_s, median, pss_bytes, rss_bytes

from .contenders import Contender, build_loader, close_iterator
from .memory import MemorySampler
from .workloads import make_dataset, spec

_MB: Final = 1 << 20


@dataclass
class Trial:
    """One epoch of one contender: the raw numbers."""

    batches: int
    first_batch_s: float
    steady_s: float  # first batch received -> last batch received
    cpu_s: float  # main-process CPU over the same span, less the memory sampler's
    worker_cpu_s: float  # the workers' CPU (user + system) over the same span
    peak_rss_bytes: int
    base_rss_bytes: int  # main process just before the loader was built
    end_pss_bytes: int | None  # main plus workers after the last batch (see pss_bytes)
    peak_fds: int | None = None  # the main process's open file descriptors, sampled

    @property
    def throughput_bps(self) -> float:
        return (self.batches - 1) / self.steady_s if self.steady_s > 0 else float("nan")

    @property
    def cpu_us_per_batch(self) -> float:
        return self.cpu_s / max(1, self.batches - 1) * 1e6

    @property
    def worker_cpu_us_per_batch(self) -> float:
        return self.worker_cpu_s / max(1, self.batches - 1) * 1e6


def run_trial(
    contender: Contender,
    dataset: Any,
    batch_size: int,
    workers: int,
    seed: int,
    max_s: float = float("inf"),
) -> Trial:
    """One epoch but its last batch, or its first ``max_s`` seconds. Throughput and CPU
    time are counted from the first batch to the last (steady state); the start-up is
    the first-batch latency, reported apart. The last batch of the epoch is left
    unread so that the workers are still alive to be measured (the end of an epoch
    stops them)."""
    gc.collect()
    base_rss = rss_bytes()
    sampler = MemorySampler()
    sampler.start()
    loader = build_loader(contender, dataset, batch_size, workers, seed)
    t_start = time.perf_counter()
    iterator = iter(loader)
    try:
        next(iterator)
        t_first = time.perf_counter()
        cpu_first = time.process_time() - sampler.cpu_s()
        workers_first = children_cpu_s()
        t_last, cpu_last, batches = t_first, cpu_first, 1
        stop_at = t_first + max_s
        last = len(loader) - 1
        while batches < last and t_last < stop_at:
            next(iterator)
            batches += 1
            t_last = time.perf_counter()
            cpu_last = time.process_time() - sampler.cpu_s()
        workers_last = children_cpu_s()
        end_pss = pss_bytes()
        sampler.sample()  # the fds held with every prefetched batch in
    finally:
        close_iterator(iterator)
        peak = sampler.stop()
    del iterator, loader
    return Trial(
        batches=batches,
        first_batch_s=t_first - t_start,
        steady_s=t_last - t_first,
        cpu_s=cpu_last - cpu_first,
        worker_cpu_s=workers_last - workers_first,
        peak_rss_bytes=peak,
        base_rss_bytes=base_rss,
        end_pss_bytes=end_pss,
        peak_fds=sampler.peak_fds,
    )


def summarize_trials(trials: Sequence[Trial]) -> dict[str, Any]:
    return {
        "throughput_bps": median([t.throughput_bps for t in trials]),
        "first_batch_ms": median([t.first_batch_s * 1e3 for t in trials]),
        "cpu_us_per_batch": median([t.cpu_us_per_batch for t in trials]),
        "worker_cpu_us_per_batch": median([t.worker_cpu_us_per_batch for t in trials]),
        "peak_rss_mb": median([t.peak_rss_bytes / _MB for t in trials]),
        "rss_growth_mb": median([(t.peak_rss_bytes - t.base_rss_bytes) / _MB for t in trials]),
        "end_pss_mb": median([t.end_pss_bytes / _MB for t in trials if t.end_pss_bytes is not None]),
        "peak_fds": median([float(t.peak_fds) for t in trials if t.peak_fds is not None]),
        "runs": [
            {
                "throughput_bps": t.throughput_bps,
                "first_batch_ms": t.first_batch_s * 1e3,
                "cpu_us_per_batch": t.cpu_us_per_batch,
                "worker_cpu_us_per_batch": t.worker_cpu_us_per_batch,
                "peak_rss_mb": t.peak_rss_bytes / _MB,
                "base_rss_mb": t.base_rss_bytes / _MB,
                "end_pss_mb": None if t.end_pss_bytes is None else t.end_pss_bytes / _MB,
                "peak_fds": t.peak_fds,
                "batches": t.batches,
            }
            for t in trials
        ],
    }


def measure_workload(
    name: str,
    contenders: Sequence[Contender],
    workers: Sequence[int],
    repeats: int,
    batches: int,
    compute_rounds: int,
    trial_s: float = float("inf"),
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, dict[str, Any]]]:
    """{str(W): {contender: summary}} for one workload. Within each W the contenders
    are interleaved and the starting one rotates with each repeat (A B C, B C A, ...),
    so slow drifts of the machine hit each of them alike."""
    ws = spec(name)
    dataset = make_dataset(name, batches * ws.batch_size, compute_rounds)
    by_workers: dict[str, dict[str, dict[str, Any]]] = {}
    for w in workers:
        trials: dict[str, list[Trial]] = {c.name: [] for c in contenders}
        for rep in range(repeats):
            shift = rep % len(contenders)
            for contender in [*contenders[shift:], *contenders[:shift]]:
                trials[contender.name].append(
                    run_trial(contender, dataset, ws.batch_size, w, seed, trial_s)
                )
        row = {c: summarize_trials(t) for c, t in trials.items()}
        torch_bps = row["torch"]["throughput_bps"] if "torch" in row else float("nan")
        for summary in row.values():
            summary["ratio_to_torch"] = summary["throughput_bps"] / torch_bps
        by_workers[str(w)] = row
        log(
            f"  {name:8s} W={w}: "
            + "  ".join(
                f"{c} {s['throughput_bps']:8.1f} b/s ({s['ratio_to_torch']:.2f}x)"
                for c, s in row.items()
            )
        )
    return by_workers
