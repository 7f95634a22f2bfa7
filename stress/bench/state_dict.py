"""``state_dict()`` latency and ``torch.save`` size in the main process, mid-epoch, per
contender with a ``state_dict()``, per (num_workers, dataset length, pipeline) case."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

from stress._probes import saved_bytes

from .contenders import Contender, build_loader, close_iterator
from .workloads import RngItems, TinyItems


def describe_pipeline(row: dict[str, Any]) -> str:
    """The pipeline of a state_dict() row, in words, for the tables and targets."""
    if row.get("pipeline", "plain") == "rng":
        return "3 RNGs drawn, persistent, epoch 2"
    return "no RNG draws"


# The calls are spread over a span in rounds: a shared machine's speed
# drifts in stretches of about a second (the same pure-Python work measured 15 µs and
# 25-30 µs in alternating stretches on the 2-core machine), and calls made back to back
# would all land in one of them. The target reads the fastest round's median, as
# timeit reads the best of its repeats (the snapshot row does the same): the cost of
# the code, not of the stretch; the median and p90 over all calls show the rest.
def measure_state_dict(
    contenders: Sequence[Contender], cases: Sequence[tuple[int, int, str]], calls: int, seed: int,
    rounds: int, span_s: float,
) -> list[dict[str, Any]]:
    """state_dict() latency (µs, every call timed alone) mid-epoch and its torch.save
    size, per contender with a state_dict(), per (num_workers, dataset length, pipeline)
    case. The loaders shuffle, so a long dataset would show in the size if the sampler's
    position were saved as anything but a count. An "rng" case runs persistent workers
    whose items draw from all three global RNGs through two whole epochs first, then
    measures mid-way through the third: every worker's states have moved, and since its
    seed, not just since the epoch began. The calls are made in ``rounds`` rounds
    spread over ``span_s`` seconds: the median and p90 over all of them, and the fastest
    round's median."""
    rows = []
    for w, length, pipeline in cases:
        rng = pipeline == "rng"
        dataset = RngItems(length) if rng else TinyItems(length)
        for contender in contenders:
            if contender.name == "torch":
                continue  # no state_dict()
            loader = build_loader(contender, dataset, 16, w, seed, persistent=rng)
            iterator = None
            try:
                for _ in range(2 if rng else 0):
                    for _ in loader:
                        pass
                iterator = iter(loader)
                for _ in range(2 * w + 3):
                    next(iterator)
                time.sleep(0.05)  # let the prefetched batches land
                loader.state_dict()  # the first call of an epoch finds the RNG codes (_rngcode.py)
                rounds_ns: list[list[int]] = []
                for round_ in range(rounds):
                    if round_:
                        time.sleep(span_s / rounds)
                    rounds_ns.append([])
                    for _ in range(max(1, calls // rounds)):
                        t0 = time.perf_counter_ns()
                        loader.state_dict()
                        rounds_ns[-1].append(time.perf_counter_ns() - t0)
                size = len(saved_bytes(loader.state_dict()))
            finally:
                if iterator is not None:
                    close_iterator(iterator)
                del iterator, loader
                gc.collect()
            times_ns = sorted(t for round_ns in rounds_ns for t in round_ns)
            rows.append(
                {
                    "loader": contender.name,
                    "workers": w,
                    "dataset_len": length,
                    "pipeline": pipeline,
                    "median_us": times_ns[len(times_ns) // 2] / 1e3,
                    "best_round_us": min(statistics.median(r) for r in rounds_ns) / 1e3,
                    "p90_us": times_ns[int(len(times_ns) * 0.9)] / 1e3,
                    "size_bytes": size,
                }
            )
    return rows
