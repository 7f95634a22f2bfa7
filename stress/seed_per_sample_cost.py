"""What ``seed_per_sample=True`` costs per sample (``_rng/per_sample.py``), in numbers.

    python -m stress.seed_per_sample_cost

Prints, in one run, the time to set a sample's states (the three global RNGs; then with
3 generator objects held by the dataset) on the worker's own code path, beside what
seeding the same generators the ordinary way costs measured alongside
(``random.seed(int)``, ``np.random.seed(int)``, ``torch.default_generator.manual_seed``,
``torch.manual_seed``); and a whole loader's time per sample with and without the option
(``num_workers=0``, a dataset drawing from all three global RNGs). Ratios, not targets:
the machine's load moves every number together.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import numpy as np
import torch

from snaploader import DataLoader
from snaploader._rng.objects import ObjectRngs
from snaploader._rng.per_sample import Domain, SampleSeeder, epoch_seed
from tests._datasets import Augmented

_BATCH = 64


def _per_call_us(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def _seeder_us(seeder: SampleSeeder) -> float:
    seed = epoch_seed(12345, 0)
    keys = list(range(_BATCH))

    def batch() -> None:
        for row in seeder.states(seed, Domain.SAMPLE, keys):
            seeder.put(row)

    return _per_call_us(batch, 100) / _BATCH


def _loaders_us(rounds: int = 7) -> tuple[float, float]:
    """Per sample, the fastest epoch of each loader, the two taking turns so that the
    machine's slow stretches fall on both."""
    loaders = [
        DataLoader(Augmented(1024), batch_size=_BATCH, generator=torch.Generator().manual_seed(0), seed_per_sample=on)
        for on in (False, True)
    ]
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, loader in enumerate(loaders):
            start = time.perf_counter()
            count = sum(len(batch) for batch in loader)
            best[i] = min(best[i], (time.perf_counter() - start) / count * 1e6)
    return best[0], best[1]


def main() -> None:
    bare = _seeder_us(SampleSeeder(ObjectRngs([], [])))
    held = ObjectRngs.find(
        [("objects", [random.Random(1), np.random.default_rng(1), torch.Generator().manual_seed(1)])], None, None
    )
    with_objects = _seeder_us(SampleSeeder(held))
    references = {
        "random.seed(int)": _per_call_us(lambda: random.seed(123456789), 2000),
        "np.random.seed(int)": _per_call_us(lambda: np.random.seed(123456789), 2000),
        "torch.default_generator.manual_seed": _per_call_us(lambda: torch.default_generator.manual_seed(5), 2000),
        "torch.manual_seed": _per_call_us(lambda: torch.manual_seed(5), 200),
    }
    print(f"per-sample states, 3 global RNGs:             {bare:7.1f} us")
    print(f"per-sample states, + 3 generator objects:     {with_objects:7.1f} us")
    for name, us in references.items():
        print(f"{name + ' (alone):':46s}{us:7.1f} us   per-sample states / this: {bare / us:5.2f}x")
    print(f"{'the three ordinary seeds together:':46s}{sum(list(references.values())[:3]):7.1f} us")
    off, on = _loaders_us()
    print(f"loader, num_workers=0, per sample: {off:.1f} us without, {on:.1f} us with (+{on - off:.1f} us, {on / off:.2f}x)")


if __name__ == "__main__":
    main()
