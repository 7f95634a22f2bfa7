#!/usr/bin/env python
"""What an expensive iterable-dataset state costs: per batch, and on resume.

    python stress/iterable_cost.py               # the default run (under a minute)
    python stress/iterable_cost.py --quick       # CI's smoke run (seconds)
    python stress/iterable_cost.py --repeats 5 --batches 300 --resume-repeats 3

The dataset is a shuffle buffer of 10,000 items (``--buffer``) over a stream of ints,
with its own ``random.Random``; its iterator's ``state_dict()`` holds the whole buffer
(a list of ints, or an int64 tensor with ``tensor`` in the table), the source position
and the RNG state. The same stream without ``state_dict()`` is the baseline: its
snapshots hold the three global RNG states only.

1. Per-batch cost. An epoch is timed after its first batch (so worker start-up is left
   out) at ``snapshot_every`` = 1, 16 and 64, with ``num_workers=1`` (the worker calls
   ``state_dict()`` and pickles it; the main process unpickles it) and ``num_workers=0``
   (``state_dict()`` and a deep copy, in the main process). The overhead is the median
   time per batch minus the baseline's. ``snapshot alone`` times ``state_dict()`` plus a
   pickle round trip in one process, without a loader.
2. Resume time at a late cut (``--cut`` of the epoch): ``load_state_dict`` to the first
   batch of a new loader, protocol vs replay (no protocol: the worker reads and
   discards every batch before the cut), beside a fresh ``iter()`` to the first batch.
   Every resumed first batch is checked against the uninterrupted run.

Medians of ``--repeats`` interleaved runs. Nothing is asserted: timings on a shared
machine are noisy; the table is for docs/iterable.md.
"""

from __future__ import annotations

import argparse
import io
import pickle
import random
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import snaploader  # noqa: E402
from stress._probes import saved_bytes  # noqa: E402


class _BufferIterator:
    def __init__(self, n: int, buffer_size: int, as_tensor: bool) -> None:
        self.rng = random.Random(1234)
        self.n = n
        self.as_tensor = as_tensor
        self.source = min(buffer_size, n)
        self.buffer = list(range(self.source))

    def __iter__(self) -> _BufferIterator:
        return self

    def __next__(self) -> int:
        if not self.buffer:
            raise StopIteration
        j = self.rng.randrange(len(self.buffer))
        item = self.buffer[j]
        if self.source < self.n:
            self.buffer[j] = self.source
            self.source += 1
        else:
            self.buffer[j] = self.buffer[-1]
            self.buffer.pop()
        return item

    def state_dict(self) -> dict[str, Any]:
        buffer: Any = torch.tensor(self.buffer, dtype=torch.int64) if self.as_tensor else list(self.buffer)
        version, words, gauss = self.rng.getstate()
        return {"source": self.source, "buffer": buffer, "rng": [version, list(words), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source = int(state["source"])
        buffer = state["buffer"]
        self.buffer = buffer.tolist() if isinstance(buffer, torch.Tensor) else list(buffer)
        version, words, gauss = state["rng"]
        self.rng.setstate((version, tuple(words), gauss))


def _without_protocol(it: _BufferIterator) -> Iterator[int]:
    yield from it


class ShuffleBuffer(IterableDataset[int]):
    """``n`` ints through a ``buffer_size`` shuffle buffer (one worker's stream)."""

    def __init__(self, n: int, buffer_size: int, *, stateful: bool, as_tensor: bool = False) -> None:
        self.n = n
        self.buffer_size = buffer_size
        self.stateful = stateful
        self.as_tensor = as_tensor

    def __iter__(self) -> Iterator[int]:
        it = _BufferIterator(self.n, self.buffer_size, self.as_tensor)
        return it if self.stateful else _without_protocol(it)


@dataclass(frozen=True)
class Variant:
    name: str
    stateful: bool
    as_tensor: bool = False
    every: int = 1


VARIANTS = (
    Variant("no state_dict (baseline)", stateful=False),
    Variant("list, snapshot_every=1", stateful=True, every=1),
    Variant("list, snapshot_every=16", stateful=True, every=16),
    Variant("list, snapshot_every=64", stateful=True, every=64),
    Variant("tensor, snapshot_every=1", stateful=True, as_tensor=True, every=1),
)


def make_loader(
    v: Variant, n: int, args: argparse.Namespace, workers: int, batch_size: int | None = None
) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        ShuffleBuffer(n, args.buffer, stateful=v.stateful, as_tensor=v.as_tensor),
        batch_size=batch_size or args.batch_size,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
        snapshot_every=v.every,
        replay="allow",
    )


def per_batch_ms(v: Variant, args: argparse.Namespace, workers: int) -> float:
    n = args.buffer + (args.batches + 1) * args.batch_size
    loader = make_loader(v, n, args, workers)
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    count = sum(1 for _ in iterator)
    elapsed = time.perf_counter() - start
    del iterator, loader
    return 1000 * elapsed / count


def snapshot_alone_ms(v: Variant, args: argparse.Namespace) -> float:
    it = _BufferIterator(args.buffer * 2, args.buffer, v.as_tensor)
    rounds = 200
    start = time.perf_counter()
    for _ in range(rounds):
        pickle.loads(ForkingPickler.dumps(it.state_dict()))
    return 1000 * (time.perf_counter() - start) / rounds


def through_bytes(state: Any) -> Any:
    blob = saved_bytes(state)
    return torch.load(io.BytesIO(blob), weights_only=True), len(blob)


@dataclass
class ResumeTiming:
    seconds: float
    exact: bool
    checkpoint_bytes: int


def resume_s(v: Variant, args: argparse.Namespace) -> ResumeTiming:
    n = args.resume_batches * args.resume_batch_size
    cut = int(args.cut * args.resume_batches)
    loader = make_loader(v, n, args, 1, args.resume_batch_size)
    iterator = iter(loader)
    for _ in range(cut):
        next(iterator)
    state, size = through_bytes(loader.state_dict())
    expected = next(iterator)
    del iterator, loader
    resumed = make_loader(v, n, args, 1, args.resume_batch_size)
    start = time.perf_counter()
    resumed.load_state_dict(state)
    first = next(iter(resumed))
    seconds = time.perf_counter() - start
    del resumed
    return ResumeTiming(seconds, bool(torch.equal(first, expected)), size)


def cold_start_s(args: argparse.Namespace) -> float:
    n = args.resume_batches * args.resume_batch_size
    loader = make_loader(VARIANTS[1], n, args, 1, args.resume_batch_size)
    start = time.perf_counter()
    next(iter(loader))
    seconds = time.perf_counter() - start
    del loader
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffer", type=int, default=10_000, help="shuffle buffer items")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=200, help="timed batches per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resume-batch-size", type=int, default=256)
    parser.add_argument("--resume-batches", type=int, default=600, help="epoch length for the resume test")
    parser.add_argument("--cut", type=float, default=0.9, help="where in that epoch to cut")
    parser.add_argument("--resume-repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a few seconds: CI's smoke run")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.repeats, args.resume_batches, args.resume_batch_size = 20, 1, 40, 64
    warnings.simplefilter("ignore")
    started = time.perf_counter()

    print(f"# per-batch cost: {args.buffer:,}-item shuffle buffer, batch_size={args.batch_size}, "
          f"{args.batches} batches a run, median of {args.repeats}")
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(args.repeats):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            for workers in (1, 0):
                times.setdefault((v.name, workers), []).append(per_batch_ms(v, args, workers))
    base = {w: statistics.median(times[(VARIANTS[0].name, w)]) for w in (1, 0)}
    header = f"{'variant':28} {'snapshot alone':>15} {'W=1 ms/batch':>13} {'overhead':>9} {'W=0 ms/batch':>13} {'overhead':>9}"
    print(header)
    print("-" * len(header))
    for v in VARIANTS:
        alone = "-" if not v.stateful else f"{snapshot_alone_ms(v, args):.3f} ms"
        cells = []
        for workers in (1, 0):
            ms = statistics.median(times[(v.name, workers)])
            extra = "-" if not v.stateful else f"{ms - base[workers]:+.3f}"
            cells += [f"{ms:13.3f}", f"{extra:>9}"]
        print(f"{v.name:28} {alone:>15} {' '.join(cells)}")

    cut = int(args.cut * args.resume_batches)
    print()
    items = cut * args.resume_batch_size
    print(f"# resume at batch {cut:,} of {args.resume_batches:,} ({items:,} items read before the cut; "
          f"num_workers=1, batch_size={args.resume_batch_size}): load_state_dict -> first batch, "
          f"median of {args.resume_repeats}")
    cases = [
        Variant("protocol, snapshot_every=1", stateful=True, every=1),
        Variant("protocol, snapshot_every=64", stateful=True, every=64),
        Variant("no protocol (replay)", stateful=False),
    ]
    header = f"{'variant':30} {'resume s':>9} {'exact':>6} {'checkpoint':>11}"
    print(header)
    print("-" * len(header))
    for v in cases:
        runs = [resume_s(v, args) for _ in range(args.resume_repeats)]
        seconds = statistics.median(t.seconds for t in runs)
        exact = all(t.exact for t in runs)
        size = runs[0].checkpoint_bytes
        print(f"{v.name:30} {seconds:9.3f} {str(exact):>6} {size / 1024:8.0f} KB")
    cold = statistics.median(cold_start_s(args) for _ in range(args.resume_repeats))
    print(f"{'(fresh iter() -> first batch)':30} {cold:9.3f}")
    print(f"\n# total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
