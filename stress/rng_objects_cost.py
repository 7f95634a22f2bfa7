"""What capturing generator objects costs (``_rng/objects.py``), in numbers.

    python -m stress.rng_objects_cost

Prints, per worker, the time of one batch-boundary snapshot of the generator objects
(read every state, compare, re-encode what moved) with 0, 1, 10 and 100 generators
held by the dataset (a mix of random.Random, numpy default_rng and torch.Generator),
when all of them moved since the last snapshot and when none did; the size of the
encoding; and the time of the walk that finds them at worker start for a dataset
holding 10^7 file names. Measured in this process on the worker's own code path
(``ObjectRngs``), so the numbers are free of pipe and scheduling noise.
"""

from __future__ import annotations

import time

import torch

from snaploader._rng.objects import ObjectRngs
from stress._probes import per_call_us
from tests._object_datasets import ManyGenerators


def snapshot_cost() -> None:
    print("generators  snapshot, all moved (us)  snapshot, none moved (us)  encoded (bytes)")
    for count in (0, 1, 10, 100):
        dataset = ManyGenerators(10_000, count)
        objects = ObjectRngs.find([("dataset", dataset)], None, None)
        assert len(objects.paths) == count
        objects.snapshot()
        i = 0

        def moved() -> None:
            nonlocal i
            for k in range(count):
                dataset[i * count + k]
            i += 1
            objects.snapshot()

        draw_only = per_call_us(lambda: [dataset[k] for k in range(count)], 200)
        all_moved = per_call_us(moved, 200) - draw_only
        none_moved = per_call_us(objects.snapshot, 200)
        size = len(objects.snapshot()[0] or b"")
        print(f"{count:10d}  {all_moved:24.1f}  {none_moved:25.1f}  {size:15d}")


def start_cost() -> None:
    for names in (0, 10**7):
        dataset = ManyGenerators(10, 3, names=names)
        start = time.perf_counter()
        objects = ObjectRngs.find([("dataset", dataset), ("collate_fn", torch.utils.data.default_collate)], None, None)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        print(f"worker-start walk, dataset with {names:>8} file names and 3 generators: "
              f"{elapsed_ms:.2f} ms ({len(objects.paths)} found)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    snapshot_cost()
    start_cost()
