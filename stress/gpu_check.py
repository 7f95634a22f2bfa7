#!/usr/bin/env python
"""What only a GPU node shows (issue 34), in one table:

    python stress/gpu_check.py           # on a GPU node: within 6 minutes on 1 GPU + 16 cores
    python stress/gpu_check.py --quick   # the CI run: small sizes, a minute on 2 cores

Rows, snaploader beside torch's DataLoader where there is a comparison:

- ``pin_memory=True``: every batch is pinned (``is_pinned()``), and ``.to("cuda",
  non_blocking=True)`` of it arrives intact; a mid-epoch resume with pinning is exact
  (through ``torch.save`` bytes), also when a worker was SIGKILLed before the checkpoint.
- throughput of an image-like pipeline (uint8 3x224x224, batch 256, a random crop and
  flip in the worker from its torch RNG) with ``pin_memory=True`` and a training step
  that copies each batch to the GPU and runs a matmul on it, at W = 4, 8, 14 (target
  >= 1.00x torch's);
- compute-bound throughput (the benchmark's ``compute`` workload) at W = 1, 2, 4, 8, 14
  (target >= 1.00x);
- ``state_dict()`` after every step at W=8 of the image pipeline: median, p99 and max
  (targets <= 1 ms p99, <= 5 ms max) and the calling thread's CPU time a call.

Without a CUDA device the CUDA rows are skipped (the table says so) and everything else
still runs: pinning goes through the stand-in of ``stress/_pin_standin.py`` (the
accelerator faked, a 4 ms sleeping pin), so the pin thread, the resume checks and the
throughput comparison run for real on the CPU, with a 4 ms sleep as the training step.
The image rows need the prefetched batches' room in /dev/shm; a row that would not fit
is skipped and says why. Timings are printed, never asserted; the exit code is 1 only
when a correctness row (pinned, intact, exact) fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

import snaploader  # noqa: E402
from snaploader._workers.pinning import THREAD_NAME  # noqa: E402
from stress._pin_standin import PinRecord, fake_pinning  # noqa: E402
from stress._probes import median, percentile  # noqa: E402
from stress.bench.contenders import Contender, close_iterator, find_contenders  # noqa: E402
from stress.bench.throughput import run_trial  # noqa: E402
from stress.bench.workloads import calibrate_compute_rounds, make_dataset  # noqa: E402

CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Sizes:
    image_batch: int
    image_side: int
    image_workers: tuple[int, ...]
    image_steps: int  # timed steps a trial, after the first batch
    compute_workers: tuple[int, ...]
    compute_trial_s: float  # a trial stops after this long, or at its epoch's end
    compute_batches: int  # the epoch of the compute rows, in batches of 32
    repeats: int
    state_dict_steps: int
    check_batch: int  # batch size of the correctness rows
    check_batches: int  # their epoch, in batches


FULL = Sizes(256, 224, (4, 8, 14), 60, (1, 2, 4, 8, 14), 3.0, 5000, 2, 200, 16, 24)
QUICK = Sizes(16, 224, (2,), 12, (1, 2), 0.5, 300, 2, 40, 4, 12)


class ImageItems(Dataset[tuple[torch.Tensor, int]]):
    """Item i: a fixed uint8 3x(S+32)x(S+32) "photo" shifted by i, randomly cropped to
    SxS and flipped with the worker's torch RNG (what a resume must reproduce)."""

    def __init__(self, length: int, side: int) -> None:
        self.length = length
        self.side = side
        generator = torch.Generator().manual_seed(0)
        self.photo = torch.randint(0, 256, (3, side + 32, side + 32), dtype=torch.uint8, generator=generator)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        y, x = torch.randint(0, 33, (2,)).tolist()
        image = self.photo[:, y : y + self.side, x : x + self.side]
        if torch.rand(()) < 0.5:
            image = image.flip(-1)
        return image + (i % 251), i  # a new tensor, contiguous, different per item


# -- the table --------------------------------------------------------------------


@dataclass
class Row:
    check: str
    workers: str = ""
    ours: str = ""
    theirs: str = ""
    ratio: str = ""
    target: str = ""
    verdict: str = ""  # "ok", "FAILED", "met", "MISSED", or why it was skipped


def print_table(rows: list[Row]) -> None:
    header = Row("check", "W", "snaploader", "torch", "x torch", "target", "result")
    cells = [[r.check, r.workers, r.ours, r.theirs, r.ratio, r.target, r.verdict] for r in [header, *rows]]
    widths = [max(len(line[i]) for line in cells) for i in range(6)]
    for k, line in enumerate(cells):
        print("  ".join(cell.ljust(widths[i]) if i < 6 else cell for i, cell in enumerate(line)).rstrip())
        if k == 0:
            print("-" * (sum(widths) + 2 * 6 + len("result")))


# -- pinning: the real one on a GPU, the stand-in elsewhere -----------------------


@contextlib.contextmanager
def pinning() -> Iterator[PinRecord | None]:
    if CUDA:
        yield None
    else:
        with fake_pinning() as record:
            yield record


def image_loader(maker: Callable[..., Any], dataset: Any, batch: int, workers: int, seed: int) -> Any:
    return maker(
        dataset, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=True,
        generator=torch.Generator().manual_seed(seed),
    )


def through_bytes(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b)
    )


def correctness_rows(sizes: Sizes) -> list[Row]:
    rows: list[Row] = []
    workers = 4 if CUDA else 2
    dataset = ImageItems(sizes.check_batch * sizes.check_batches, sizes.image_side)

    def make(seed: int = 5) -> Any:
        return image_loader(snaploader.DataLoader, dataset, sizes.check_batch, workers, seed)

    with pinning() as record:
        whole = list(make())
        ours_pinned_on = set() if record is None else record.threads()
        torchs = list(image_loader(torch.utils.data.DataLoader, dataset, sizes.check_batch, workers, 5))
        if CUDA:
            pinned = all(b[0].is_pinned() and b[1].is_pinned() for b in whole)
            rows.append(Row("pin_memory=True: every batch is_pinned()", str(workers), str(pinned), "", "", "True",
                            "ok" if pinned else "FAILED"))
            intact = True
            for batch in whole[:4]:
                on_gpu = batch[0].to("cuda", non_blocking=True)
                torch.cuda.synchronize()
                intact &= torch.equal(on_gpu.cpu(), batch[0])
            rows.append(Row('.to("cuda", non_blocking=True) arrives intact', str(workers), str(intact), "", "",
                            "True", "ok" if intact else "FAILED"))
        else:
            by_thread = ours_pinned_on == {THREAD_NAME}
            rows.append(Row("pin_memory=True: pinned by the pin thread (stand-in)", str(workers), str(by_thread),
                            "", "", "True", "ok" if by_thread else "FAILED"))
            rows.append(Row('.to("cuda", non_blocking=True) arrives intact', str(workers),
                            verdict="skipped: no CUDA device"))
        equal = same(whole, torchs)
        rows.append(Row("pin_memory=True: the stream is torch's", str(workers), str(equal), "", "", "True",
                        "ok" if equal else "FAILED"))
        for killed in (False, True):
            cut = sizes.check_batches // 2
            first = make()
            iterator = iter(first)
            got = [next(iterator) for _ in range(cut // 2)]
            if killed:
                os.kill(iterator.worker_pids[-1], signal.SIGKILL)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got += [next(iterator) for _ in range(cut - cut // 2)]
            state = through_bytes(first.state_dict())
            close_iterator(iterator)
            del iterator
            again = make()
            again.load_state_dict(state)
            exact = same(got + list(again), whole)
            what = "a mid-epoch resume with pin_memory=True is exact"
            rows.append(Row(what + (", a worker SIGKILLed before it" if killed else ""), str(workers),
                            str(exact), "", "", "True", "ok" if exact else "FAILED"))
    return rows


# -- throughput -------------------------------------------------------------------


def shm_free_bytes() -> int | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def image_trial(maker: Callable[..., Any], dataset: Any, sizes: Sizes, workers: int, seed: int) -> float:
    """Batches a second of ``maker``'s loader under a training step on each batch."""
    if CUDA:
        weight = torch.randn(sizes.image_side * sizes.image_side, 256, device="cuda")

        def step(batch: Any) -> None:
            images = batch[0].to("cuda", non_blocking=True)
            flat = images.view(images.shape[0] * 3, -1).float()
            (flat @ weight).sum().item()  # the loss read back: one synchronisation a step
    else:

        def step(batch: Any) -> None:
            time.sleep(0.004)

    loader = image_loader(maker, dataset, sizes.image_batch, workers, seed)
    iterator = iter(loader)
    try:
        step(next(iterator))
        started = time.perf_counter()
        for _ in range(sizes.image_steps):
            step(next(iterator))
        return sizes.image_steps / (time.perf_counter() - started)
    finally:
        close_iterator(iterator)
        del iterator


def compare(measure: Callable[[Contender, int], float], contenders: list[Contender], repeats: int) -> tuple[float, float, float]:
    """Median batches/s of snaploader and torch, alternating, and the median of the
    repeats' ratios."""
    rates: dict[str, list[float]] = {c.name: [] for c in contenders}
    for repeat in range(repeats):
        for contender in contenders if repeat % 2 == 0 else contenders[::-1]:
            rates[contender.name].append(measure(contender, repeat))
    ratios = [a / b for a, b in zip(rates["snaploader"], rates["torch"])]
    return median(rates["snaploader"]), median(rates["torch"]), median(ratios)


def throughput_rows(sizes: Sizes, contenders: list[Contender]) -> list[Row]:
    rows: list[Row] = []
    what = "image pipeline + GPU matmul step, b/s" if CUDA else "image pipeline + 4 ms step (stand-in pin), b/s"
    steps = sizes.image_steps + 2
    batch_bytes = sizes.image_batch * 3 * sizes.image_side * sizes.image_side
    with pinning():
        for workers in sizes.image_workers:
            need = 2 * workers * 2 * batch_bytes  # prefetch_factor 2, and a copy being collated
            free = shm_free_bytes()
            if free is not None and free < need:
                rows.append(Row(what, str(workers), verdict=f"skipped: /dev/shm has {free / 2**30:.1f} GiB free, "
                                f"the prefetched batches need {need / 2**30:.1f} GiB"))
                continue
            length = sizes.image_batch * (steps + workers * 2)
            dataset = ImageItems(length, sizes.image_side)

            def measure(contender: Contender, repeat: int) -> float:
                assert contender.make is not None
                return image_trial(contender.make, dataset, sizes, workers, 100 + repeat)

            ours, theirs, ratio = compare(measure, contenders, sizes.repeats)
            rows.append(Row(what, str(workers), f"{ours:.1f}", f"{theirs:.1f}", f"{ratio:.3f}", ">= 1.00",
                            "met" if ratio >= 1.0 else "MISSED"))
    rounds, _ = calibrate_compute_rounds()
    for workers in sizes.compute_workers:
        dataset = make_dataset("compute", 32 * sizes.compute_batches, rounds)

        def measure_compute(contender: Contender, repeat: int) -> float:
            trial = run_trial(contender, dataset, 32, workers, 200 + repeat, sizes.compute_trial_s)
            return trial.throughput_bps

        ours, theirs, ratio = compare(measure_compute, contenders, sizes.repeats)
        rows.append(Row("compute-bound (bench 'compute'), b/s", str(workers), f"{ours:.1f}", f"{theirs:.1f}",
                        f"{ratio:.3f}", ">= 1.00", "met" if ratio >= 1.0 else "MISSED"))
    return rows


# -- state_dict() -----------------------------------------------------------------


def state_dict_rows(sizes: Sizes) -> list[Row]:
    workers = 8
    side = sizes.image_side if CUDA else 64
    dataset = ImageItems(16 * (sizes.state_dict_steps + 2), side)
    wall_us: list[float] = []
    cpu_us: list[float] = []
    with pinning():
        loader = image_loader(snaploader.DataLoader, dataset, 16, workers, 300)
        iterator = iter(loader)
        try:
            for _ in range(sizes.state_dict_steps):
                next(iterator)
                wall, cpu = time.perf_counter(), time.thread_time()
                loader.state_dict()
                cpu_us.append((time.thread_time() - cpu) * 1e6)
                wall_us.append((time.perf_counter() - wall) * 1e6)
        finally:
            close_iterator(iterator)
            del iterator
    p99, most = percentile(wall_us, 0.99), max(wall_us)
    what = f"state_dict() after each of {len(wall_us)} steps, us"
    return [
        Row(what + ", median", str(workers), f"{median(wall_us):.0f}"),
        Row(what + ", p99", str(workers), f"{p99:.0f}", target="<= 1000", verdict="met" if p99 <= 1000 else "MISSED"),
        Row(what + ", max", str(workers), f"{most:.0f}", target="<= 5000", verdict="met" if most <= 5000 else "MISSED"),
        Row("state_dict(): the calling thread's CPU a call, us", str(workers), f"{median(cpu_us):.0f}"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: the CI run")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    started = time.perf_counter()
    contenders = [c for c in find_contenders(("snaploader", "torch")).values() if c.make is not None]
    device = torch.cuda.get_device_name() if CUDA else "no CUDA device: CUDA rows skipped, pinning by the stand-in"
    print(f"gpu_check{' --quick' if args.quick else ''}: {os.cpu_count()} CPUs, {device}, "
          f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    rows = correctness_rows(sizes) + throughput_rows(sizes, contenders) + state_dict_rows(sizes)
    print_table(rows)
    print(f"took {time.perf_counter() - started:.0f} s")
    return 1 if any(r.verdict == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
