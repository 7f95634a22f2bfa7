#!/usr/bin/env python
"""Fuzz loader checkpoints: mutate real states one field at a time and load each
mutant into a fresh loader, for every configuration of ``tests/_fuzz.py`` (map-style
and iterable, with and without the state protocol, W=0 and W=2, persistent workers,
generator objects, a pending skip, in_order=False, a DistributedSampler, a sampler
holding its own generator, seed_per_sample in a later epoch), and the
states ``snaploader.distributed.reshard`` takes (4 ranks onto 3: the old ranks', and a
ReshardedLoader's during the re-partitioned epoch). A fourth of
the mutants edit a byte of a decoded blob (an RNG state's flags and twist codes, a
generator-object record's header) rather than a field.

    python stress/fuzz_checkpoints.py --seconds 300   # a long run, for people
    python stress/fuzz_checkpoints.py --quick         # the CI variant (about 30 s)

It starts with every integer field of every configuration set to huge values (past
int64 and uint64) and negative ones, re-signed: each must be refused at load, naming the
field, before it reaches torch or NumPy. Half the random mutants are re-signed (their digest recomputed, as a deliberate editor would),
so that the checks behind the digest are reached too. Every mutant must either fail
with a named ``CheckpointFormatError``/``CheckpointMismatchError`` ("clear") or resume
exactly the stream the original resumes ("identical"). A line per configuration
(signed and unsigned mutants), then the summary line (the last line):

    mutants=N clear=N identical=N other=N

Exit status 1 when ``other`` is not 0; each such mutant is printed with what was done.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests._fuzz import (  # noqa: E402
    CONFIGS, RESHARD_CONFIGS, build_case, build_reshard_case, check_integers, check_one, check_one_reshard,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to fuzz")
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (drawn and printed if absent)")
    parser.add_argument("--quick", action="store_true", help="the short bounded CI variant")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 30.0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    print(f"fuzz_checkpoints: seed={seed} seconds={args.seconds:g}", flush=True)
    cases: list[Any] = [build_case(name) for name in sorted(CONFIGS)]
    cases += [build_reshard_case(name) for name in RESHARD_CONFIGS]
    counts = {"clear": 0, "identical": 0, "other": 0}
    per_case: dict[tuple[str, bool], dict[str, int]] = {}
    deadline = time.monotonic() + args.seconds
    # First every integer field of every configuration, huge and negative (re-signed).
    for case in cases[: len(CONFIGS)]:
        for result, what in check_integers(case):
            kind = result if result in counts else "other"
            counts[kind] += 1
            tally = per_case.setdefault((case.name, True), {"clear": 0, "identical": 0, "other": 0})
            tally[kind] += 1
            if kind == "other":
                print(f"  {case.name}: {what}: {result}", flush=True)
    while time.monotonic() < deadline:
        case = rng.choice(cases)
        result, what = check_one_reshard(case, rng) if case.name in RESHARD_CONFIGS else check_one(case, rng)
        kind = result if result in counts else "other"
        counts[kind] += 1
        tally = per_case.setdefault((case.name, what.endswith("(re-signed)")), {"clear": 0, "identical": 0, "other": 0})
        tally[kind] += 1
        if kind == "other":
            print(f"  {case.name}: {what}: {result}", flush=True)
    for (name, signed), tally in sorted(per_case.items()):
        print(f"  {name:<20} {'signed' if signed else 'unsigned':<8} " + " ".join(f"{k}={v}" for k, v in tally.items()))
    mutants = sum(counts.values())
    print(f"mutants={mutants} clear={counts['clear']} identical={counts['identical']} other={counts['other']}")
    return 1 if counts["other"] else 0


if __name__ == "__main__":
    sys.exit(main())
