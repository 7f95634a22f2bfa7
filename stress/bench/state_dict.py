"""``state_dict()`` as users call it: in the main process, right after each new batch
of a running loop, per contender with a ``state_dict()`` and per case (num_workers,
dataset length, pipeline); its latency (median, p99, max) and ``torch.save`` size.

Each batch is followed by one *cold* call (the first since that batch was yielded: it
sees everything the batch moved) and ``warm_calls`` more with nothing in between (what
a second caller, a logger or a look-back, pays). Every call is timed alone; nothing is
called untimed first, and no call is dropped: a slow first call of an epoch, a garbage
collection or a search that runs long shows in the p99 and the max, as in a training
loop. The loaders shuffle, so a long dataset would show in the size if the sampler's
position were saved as anything but a count. The light and heavy pipelines run with
persistent workers through several epochs, so every worker's RNGs have moved on from
their seeds, as in a long run. Each case's loaders have a seed of their own
(``config.STATE_DICT_SEEDS_FROM`` says why).

Where Linux tells it (/proc/thread-self/schedstat), each call's wait for a CPU is read
too: a call's *own* time is its wall time less that wait. The targets read the wall
time, as a user meets it; the own time says how much of a slow call was the call and
how much another process holding the CPU (on a machine with fewer cores than workers,
the workers themselves).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any, Final

from stress._probes import median, percentile, run_queue_wait_ns, saved_bytes

from .config import STATE_DICT_BATCH, STATE_DICT_SEEDS_FROM, StateDictCase
from .contenders import Contender, build_loader, close_iterator
from .workloads import pipeline

_SIZE_SAMPLES: Final = 8  # states saved with torch.save per case, spread over its steps


def describe_pipeline(row: dict[str, Any]) -> str:
    """The pipeline of a state_dict() or training-loop row, in words."""
    return pipeline(row.get("pipeline", "plain")).description


def latency_summary(times_ns: Sequence[int]) -> dict[str, float]:
    """Median, p99 and max of call times, in µs."""
    times_us = [t / 1e3 for t in times_ns]
    return {
        "median_us": median(times_us),
        "p99_us": percentile(times_us, 0.99),
        "max_us": max(times_us),
    }


def measure_state_dict(
    contenders: Sequence[Contender], cases: Sequence[StateDictCase], warm_calls: int, seed: int
) -> list[dict[str, Any]]:
    """One row per case and contender with a ``state_dict()``: ``cold`` and ``warm``
    latency summaries (see the module docstring), the largest ``torch.save`` size of
    the states sampled through the run, and every call's time; where the waits for a
    CPU can be read, ``cold_own`` and ``warm_own`` summaries of the calls' own time and
    the count of calls that waited over 0.1 ms (``cold_waited_calls``, ``warm_waited_calls``)."""
    if warm_calls < 1:
        raise ValueError(f"warm_calls should be at least 1 (a warm call per batch), got {warm_calls}")
    rows = []
    for index, case in enumerate(cases):
        case_seed = seed + STATE_DICT_SEEDS_FROM + index  # the contenders of a case see the same data
        pipe = pipeline(case.pipeline)
        dataset = pipe.make(case.dataset_len)
        for contender in contenders:
            if contender.name == "torch":
                continue  # no state_dict()
            loader = build_loader(
                contender, dataset, STATE_DICT_BATCH, case.workers, case_seed, persistent=pipe.persistent
            )
            try:
                cold, warm, sizes, epochs = _call_after_each_batch(loader, case.steps, warm_calls)
            finally:
                del loader
                gc.collect()
            cold_ns, warm_ns = [wall for wall, _ in cold], [wall for wall, _ in warm]
            row: dict[str, Any] = {
                "loader": contender.name,
                "seed": case_seed,
                "workers": case.workers,
                "dataset_len": case.dataset_len,
                "pipeline": case.pipeline,
                "persistent": pipe.persistent,
                "steps": len(cold_ns),
                "epochs": epochs,
                "cold": latency_summary(cold_ns),
                "warm": latency_summary(warm_ns),
                "size_bytes": max(sizes),
                "sizes_bytes": sizes,
                "cold_us": [round(t / 1e3, 1) for t in cold_ns],
                "warm_us": [round(t / 1e3, 1) for t in warm_ns],
            }
            for kind, calls in (("cold", cold), ("warm", warm)):
                found = _own_times(calls)
                if found is not None:
                    row[f"{kind}_own"] = latency_summary(found[0])
                    row[f"{kind}_waited_calls"] = found[1]
            rows.append(row)
    return rows


def _timed(loader: Any) -> tuple[tuple[int, int | None], Any]:
    """One ``state_dict()`` call: (its wall time, the part of it spent waiting for a
    CPU, or None where that cannot be read), in ns; and the state."""
    queued = run_queue_wait_ns()
    t0 = time.perf_counter_ns()
    state = loader.state_dict()
    wall = time.perf_counter_ns() - t0
    after = run_queue_wait_ns()
    waited = None if queued is None or after is None else min(wall, after - queued)
    return (wall, waited), state


_WAITED_NS: Final = 100_000  # a call that waited longer than this for a CPU is counted


def _own_times(calls: Sequence[tuple[int, int | None]]) -> tuple[list[int], int] | None:
    """Each call's wall time less its wait for a CPU (ns), and how many calls waited
    longer than ``_WAITED_NS``; None when a wait is unknown."""
    own = []
    waited_calls = 0
    for wall, waited in calls:
        if waited is None:
            return None
        own.append(wall - waited)
        waited_calls += waited > _WAITED_NS
    return own, waited_calls


def _call_after_each_batch(
    loader: Any, steps: int, warm_calls: int
) -> tuple[list[tuple[int, int | None]], list[tuple[int, int | None]], list[int], int]:
    """Cold and warm calls (``_timed``'s pairs), sampled torch.save sizes, and the
    epochs begun, over ``steps`` batches of ``loader``, epoch after epoch."""
    cold: list[tuple[int, int | None]] = []
    warm: list[tuple[int, int | None]] = []
    sizes: list[int] = []
    size_every = max(1, steps // _SIZE_SAMPLES)
    epochs = 0
    iterator = None
    try:
        while len(cold) < steps:
            epochs += 1
            iterator = iter(loader)  # persistent workers carry on into the next epoch
            begun = len(cold)
            for _ in iterator:
                timed, state = _timed(loader)
                cold.append(timed)
                for _ in range(warm_calls):
                    warm.append(_timed(loader)[0])
                if len(cold) % size_every == 0 or len(cold) == steps:
                    sizes.append(len(saved_bytes(state)))
                if len(cold) == steps:
                    break
            if len(cold) == begun:
                raise ValueError("the state_dict() case's dataset yields no batch: give it at least one")
    finally:
        if iterator is not None:
            close_iterator(iterator)
    return cold, warm, sizes, epochs
