#!/usr/bin/env python
"""Peak file descriptors of the main process, snaploader beside torch, under a low
``ulimit -n`` (see NOTE [ fd budget ] in snaploader/_receiver.py).

    python stress/fd_peak.py                     # W=8, prefetch 8, ulimit -n 1024
    python stress/fd_peak.py --only snaploader --workers 2 --limit 400 --batches 24

Every batch is ``--tensors`` tensors of ``--tensor-kb`` KB (over snaploader's by-value
limit, so each travels through shared memory and is one fd in the receiver). After
the first batch the loop pauses ``--pause-s`` so that every worker fills its prefetch.
Each loader runs in its own child process with ``RLIMIT_NOFILE`` set to ``--limit``;
a thread samples the child's open fds every millisecond. Prints one line per loader:

    loader=snaploader ok=1 batches=N peak_fds=N limit=N

and, with both loaders, ``peak_fds snaploader/torch = R``. Exit status 1 when a
loader failed (for example "Too many open files") or yielded wrong batches.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

_LOADERS = ("snaploader", "torch")


class BigSamples(Dataset[torch.Tensor]):
    """Sample i: a float32 tensor of ``kb`` KB filled with i."""

    def __init__(self, n: int, kb: int) -> None:
        self.n = n
        self.items = kb * 1024 // 4

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.items,), float(i))


def as_list(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    return samples  # one tensor (one shared-memory fd) per sample


def count_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def child(args: argparse.Namespace) -> int:
    """Run one loader in this process under the fd limit; print its line. (Also the
    target of tests/test_resources.py, in a forked child.)"""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (args.limit, hard))
    if args.loader == "snaploader":
        from snaploader import DataLoader as Loader
    else:
        from torch.utils.data import DataLoader as Loader
    n = args.batches * args.tensors
    loader: Any = Loader(
        BigSamples(n, args.tensor_kb), batch_size=args.tensors, num_workers=args.workers,
        prefetch_factor=args.prefetch, collate_fn=as_list, multiprocessing_context="fork",
    )
    peak = count_fds()
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.001):
            try:
                peak = max(peak, count_fds())
            except OSError:  # at the limit, listdir itself needs an fd
                pass

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ok, got, error = True, 0, ""
    try:
        for k, batch in enumerate(loader):
            if [int(t[0]) for t in batch] != list(range(k * args.tensors, (k + 1) * args.tensors)):
                ok, error = False, f"batch {k} holds the wrong samples"
                break
            got += 1
            if k == 0:
                time.sleep(args.pause_s)
            del batch
    except Exception as exc:  # the failure to report, e.g. "Too many open files"
        ok, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        stop.set()
        sampler.join()
    ok = ok and got == args.batches
    print(f"loader={args.loader} ok={int(ok)} batches={got} peak_fds={peak} limit={args.limit}"
          + (f" error={error}" if error else ""), flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=32, help="tensors per batch")
    parser.add_argument("--tensor-kb", type=int, default=300)
    parser.add_argument("--batches", type=int, default=80)
    parser.add_argument("--limit", type=int, default=1024, help="RLIMIT_NOFILE of each run")
    parser.add_argument("--pause-s", type=float, default=1.0, help="pause after the first batch")
    parser.add_argument("--only", choices=_LOADERS, help="run one loader")
    parser.add_argument("--loader", choices=_LOADERS, help=argparse.SUPPRESS)  # in the child
    args = parser.parse_args()
    if args.loader:
        return child(args)
    peaks: dict[str, int] = {}
    status = 0
    for name in [args.only] if args.only else _LOADERS:
        argv = [a for a in sys.argv[1:] if not a.startswith("--only") and a not in _LOADERS]
        done = subprocess.run([sys.executable, __file__, *argv, "--loader", name],
                              capture_output=True, text=True, timeout=600)
        line = next((x for x in done.stdout.splitlines() if x.startswith("loader=")), "")
        print(line or f"loader={name} ok=0 (no result; exit {done.returncode}) {done.stderr[-500:]}", flush=True)
        status |= done.returncode != 0 or not line
        if "peak_fds=" in line:
            peaks[name] = int(line.split("peak_fds=")[1].split()[0])
    if len(peaks) == 2:
        print(f"peak_fds snaploader/torch = {peaks['snaploader'] / peaks['torch']:.2f}")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
