"""What ``seed_per_sample=True`` costs per sample (issue 26; ``snaploader/_rng/per_sample.py``).

Two measures, both per sample:

- **the states alone**: ``SampleSeeder.states()`` for a batch of 64 keys, then ``put()``
  of each row, as a worker does before each ``dataset[i]``; with the three global RNGs,
  then with 3 generator objects held by the dataset; beside what seeding the same
  generators the ordinary way costs, measured alongside (``random.seed(int)``,
  ``np.random.seed(int)``, ``torch.default_generator.manual_seed``,
  ``torch.manual_seed``). Best of 5 chunks of calls: the code's own cost.
- **a whole loader**: torch's DataLoader, snaploader's, and snaploader's with
  ``seed_per_sample=True`` read the same dataset (each sample draws one value from each
  of the three global RNGs, so the fresh states' first draws are paid as in a real
  pipeline), interleaved and repeated as the throughput sweep's trials
  (``throughput.run_trial``). Per sample: wall time from the first batch to the last,
  and the workers' CPU time. The added cost is the median, over the repeats, of each
  repeat's with-option time less its without-option one (the two ran back to back).

At ``num_workers=0`` every sample is read in the main process, so the wall time holds
the whole cost: the target reads that. With worker processes the seeding runs beside
the main process, and on a 2-core machine shared with the workers' siblings the wall
time hides or exaggerates it with the scheduler's choices; the workers' CPU time per
sample is what shows it there.

``python -m stress.seed_per_sample_cost`` prints the same measures without the rest of
the benchmark.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import torch

import snaploader
from snaploader._rng.objects import ObjectRngs
from snaploader._rng.per_sample import Domain, SampleSeeder, epoch_seed
from stress._probes import median, per_call_us

from .contenders import Contender
from .throughput import Trial, run_trial
from .workloads import NoiseItems

SEEDED: Final = "snaploader, seed_per_sample"  # the contender name of the loader with the option
SEED_BATCH: Final = 64  # batch size of the loaders, and keys per states() call
_DRAWS: Final = (1,)  # one value from each global RNG per sample


def seeder_us(seeder: SampleSeeder, batches: int = 100) -> float:
    """µs per sample to make a batch's states and set each sample's, as a worker does."""
    seed = epoch_seed(12345, 0)
    keys = list(range(SEED_BATCH))

    def batch() -> None:
        for row in seeder.states(seed, Domain.SAMPLE, keys):
            seeder.put(row)

    return per_call_us(batch, batches) / SEED_BATCH


def measure_states(calls: int) -> dict[str, Any]:
    """The states alone, per sample (``calls`` batches a chunk), and the ordinary
    seeders' cost per call (``calls`` × 20 calls a chunk; ``torch.manual_seed``, which
    seeds every device, × 2). This process's global RNG states are put back after."""
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        held = ObjectRngs.find(
            [("objects", [random.Random(1), np.random.default_rng(1), torch.Generator().manual_seed(1)])], None, None
        )
        seeders = {
            "global_us": seeder_us(SampleSeeder(ObjectRngs([], [])), calls),
            "with_3_objects_us": seeder_us(SampleSeeder(held), calls),
        }
        ordinary = {
            "random.seed(int)": per_call_us(lambda: random.seed(123456789), 20 * calls),
            "np.random.seed(int)": per_call_us(lambda: np.random.seed(123456789), 20 * calls),
            "torch.default_generator.manual_seed": per_call_us(lambda: torch.default_generator.manual_seed(5), 20 * calls),
            "torch.manual_seed": per_call_us(lambda: torch.manual_seed(5), 2 * calls),
        }
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
    return {**seeders, "ordinary_us": ordinary, "ordinary_three_us": sum(list(ordinary.values())[:3])}


def seeded_contender() -> Contender:
    """snaploader's DataLoader with ``seed_per_sample=True``, as a contender of its own."""
    return Contender(SEEDED, functools.partial(snaploader.DataLoader, seed_per_sample=True), snaploader.__version__)


def _per_sample(trials: Sequence[Trial]) -> dict[str, Any]:
    wall = [1e6 / (t.throughput_bps * SEED_BATCH) for t in trials]
    cpu = [t.worker_cpu_us_per_batch / SEED_BATCH for t in trials]
    return {"wall_us": median(wall), "worker_cpu_us": median(cpu), "wall_runs_us": wall, "worker_cpu_runs_us": cpu}


def measure_loaders(
    contenders: Sequence[Contender],
    workers: Sequence[int],
    repeats: int,
    batches: int,
    trial_s: float,
    seed: int,
    log: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """{str(W): row} for each W: per loader (torch's and snaploader's among
    ``contenders``, and snaploader's with the option, interleaved with the first one rotating), the per-sample wall time and
    workers' CPU time, their medians, and the option's added cost."""
    dataset = NoiseItems(batches * SEED_BATCH, _DRAWS)
    # torchdata has no such option: its rows would only lengthen the run
    loaders = [*(c for c in contenders if c.name in ("torch", "snaploader")), seeded_contender()]
    by_workers: dict[str, dict[str, Any]] = {}
    for w in workers:
        trials: dict[str, list[Trial]] = {c.name: [] for c in loaders}
        for rep in range(repeats):
            shift = rep % len(loaders)
            for contender in [*loaders[shift:], *loaders[:shift]]:
                trials[contender.name].append(run_trial(contender, dataset, SEED_BATCH, w, seed, trial_s))
        row: dict[str, Any] = {"loaders": {name: _per_sample(t) for name, t in trials.items()}}
        on, off = row["loaders"][SEEDED], row["loaders"].get("snaploader")
        if off is not None:
            for kind in ("wall", "worker_cpu"):
                pairs = zip(on[f"{kind}_runs_us"], off[f"{kind}_runs_us"])
                row[f"added_{kind}_us"] = median([a - b for a, b in pairs])
        theirs = row["loaders"].get("torch")
        if theirs is not None:
            for entry in row["loaders"].values():
                entry["wall_over_torch"] = entry["wall_us"] / theirs["wall_us"]
        by_workers[str(w)] = row
        log(
            f"  W={w}: "
            + "  ".join(f"{name} {e['wall_us']:.1f} us" for name, e in row["loaders"].items())
            + (f"  (the option adds {row['added_wall_us']:+.1f} us" if "added_wall_us" in row else "")
            + (f", {row['added_worker_cpu_us']:+.1f} us of the workers' CPU" if w and "added_wall_us" in row else "")
            + (")" if "added_wall_us" in row else "")
        )
    return by_workers


def measure_seed_per_sample(
    contenders: Sequence[Contender],
    workers: Sequence[int],
    repeats: int,
    batches: int,
    trial_s: float,
    states_calls: int,
    seed: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Both measures: ``{"states": ..., "loaders": {str(W): row}, "batch_size": ...}``."""
    states = measure_states(states_calls)
    log(f"  states alone: {states['global_us']:.1f} us a sample (3 global RNGs), "
        f"{states['with_3_objects_us']:.1f} us with 3 generator objects; "
        f"ordinary seeders {states['ordinary_three_us']:.1f} us for the three")
    return {
        "batch_size": SEED_BATCH,
        "items": batches * SEED_BATCH,
        "states": states,
        "loaders": measure_loaders(contenders, workers, repeats, batches, trial_s, seed, log),
    }
