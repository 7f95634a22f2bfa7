"""Resume loader checkpoints in a fresh process (run by test_resume.py).

``python -m tests._resume_child JOBS OUT`` loads JOBS with
``torch.load(weights_only=True)``: a list of {"config", "state", "seed", "global_rng"}.
For each job it builds a new loader from the config (its generator seeded with
``seed``, unlike the original's), sets the global torch RNG to ``global_rng``, loads
the checkpoint, and iterates the rest of the checkpoint's epoch and the next epoch.
OUT gets, per job, {"rest", "next", "generator_after_rest", "global_untouched"}.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import snaploader

from ._datasets import Augmented, draws_in_init


def build_loader(config: dict[str, Any], seed: int) -> snaploader.DataLoader:
    """The loader a test config describes, its generator (if any) seeded with ``seed``."""
    num_workers = config["num_workers"]
    return snaploader.DataLoader(
        Augmented(config["n"]),
        batch_size=config["batch_size"],
        shuffle=config["shuffle"],
        num_workers=num_workers,
        drop_last=config["drop_last"],
        worker_init_fn=draws_in_init if config.get("init") else None,
        multiprocessing_context=config.get("context") if num_workers else None,
        generator=torch.Generator().manual_seed(seed) if config.get("generator", True) else None,
        prefetch_factor=config.get("prefetch_factor") if num_workers else None,
        persistent_workers=config.get("persistent_workers", False) and num_workers > 0,
    )


def resume(config: dict[str, Any], state: dict[str, Any], seed: int) -> dict[str, Any]:
    """Load ``state`` into a new loader; the rest of its epoch and the next epoch."""
    loader = build_loader(config, seed)
    before = torch.get_rng_state()
    loader.load_state_dict(state)
    rest = [] if state["ended"] else list(loader)
    global_untouched = bool(torch.equal(torch.get_rng_state(), before))
    generator_after_rest = None if loader.generator is None else loader.generator.get_state()
    following = list(loader)
    return {
        "rest": rest,
        "next": following,
        "generator_after_rest": generator_after_rest,
        "global_untouched": global_untouched,
    }


def main(jobs_path: str, out_path: str) -> None:
    jobs = torch.load(jobs_path, weights_only=True)
    results = []
    for job in jobs:
        if job["global_rng"] is not None:
            torch.set_rng_state(job["global_rng"])
        results.append(resume(job["config"], job["state"], job["seed"]))
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
