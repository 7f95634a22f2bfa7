"""What ``seed_per_sample=True`` costs per sample (``_rng/per_sample.py``), in numbers.

    python -m stress.seed_per_sample_cost

Prints, in one run, the time to set a sample's states (the three global RNGs; then with
3 generator objects held by the dataset) on the worker's own code path, beside what
seeding the same generators the ordinary way costs measured alongside
(``random.seed(int)``, ``np.random.seed(int)``, ``torch.default_generator.manual_seed``,
``torch.manual_seed``); and a loader's time per sample with and without the option beside
torch's (``num_workers=0``, a dataset drawing from all three global RNGs). Ratios, not
targets: the machine's load moves every number together. The measures are the
benchmark's (``stress/bench/seed_per_sample.py``, which ``python stress/bench.py`` runs
among the others, with worker processes too, and reads against issue 26's target).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stress.bench.contenders import available, find_contenders  # noqa: E402
from stress.bench.seed_per_sample import SEEDED, measure_loaders, measure_states  # noqa: E402


def main() -> None:
    states = measure_states(100)
    bare = states["global_us"]
    print(f"per-sample states, 3 global RNGs:             {bare:7.1f} us")
    print(f"per-sample states, + 3 generator objects:     {states['with_3_objects_us']:7.1f} us")
    for name, us in states["ordinary_us"].items():
        print(f"{name + ' (alone):':46s}{us:7.1f} us   per-sample states / this: {bare / us:5.2f}x")
    print(f"{'the three ordinary seeds together:':46s}{states['ordinary_three_us']:7.1f} us")
    contenders = available(find_contenders(["torch", "snaploader"]))
    row = measure_loaders(contenders, (0,), repeats=7, batches=200, trial_s=float("inf"), seed=0, log=lambda _: None)["0"]
    torch_us, off, on = (row["loaders"][name]["wall_us"] for name in ("torch", "snaploader", SEEDED))
    print(f"loader, num_workers=0, per sample (median of 7, taking turns): torch {torch_us:.1f} us, "
          f"snaploader {off:.1f} us without, {on:.1f} us with (+{row['added_wall_us']:.1f} us, {on / off:.2f}x)")


if __name__ == "__main__":
    main()
