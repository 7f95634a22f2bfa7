"""Resume iterable-dataset checkpoints in a fresh process (run by test_iterable.py).

``python -m tests._iterable_child JOBS OUT`` loads JOBS with
``torch.load(weights_only=True)``: a list of {"config", "state", "epochs", "seed"}.
For each job it builds a new loader from the config (:func:`build_loader`, its
generator seeded with ``seed``, unlike the original's), loads the checkpoint and
iterates ``epochs`` epochs. OUT gets, per job, the list of epochs of batches.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

import snaploader

from . import _iterable_datasets as ids


def build_loader(config: dict[str, Any], seed: int) -> snaploader.DataLoader:
    """The loader a config describes: {"dataset": class name in _iterable_datasets,
    "n" or "sizes", "num_workers", and optionally "batch_size" (default 3),
    "drop_last", "persistent_workers", "snapshot_every", "replay", "context"}."""
    cls = getattr(ids, config["dataset"])
    sizes = config.get("sizes")
    dataset = cls(n=config.get("n"), sizes=None if sizes is None else tuple(sizes))
    workers = config["num_workers"]
    return snaploader.DataLoader(
        dataset,
        batch_size=config.get("batch_size", 3),
        num_workers=workers,
        drop_last=config.get("drop_last", False),
        multiprocessing_context=config.get("context") if workers else None,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=config.get("persistent_workers", False) and workers > 0,
        snapshot_every=config.get("snapshot_every", 1),
        replay=config.get("replay", "allow"),
    )


def main(jobs_path: str, out_path: str) -> None:
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    jobs = torch.load(jobs_path, weights_only=True)
    results = []
    for job in jobs:
        loader = build_loader(job["config"], job["seed"])
        loader.load_state_dict(job["state"])
        results.append([list(loader) for _ in range(job["epochs"])])
        del loader
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
