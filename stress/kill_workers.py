#!/usr/bin/env python
"""Kill random workers at random moments; check that every epoch is bit for bit the
uninterrupted one.

    python stress/kill_workers.py --seconds 300      # a long run, for people
    python stress/kill_workers.py --storm --seconds 90  # kill storms only
    python stress/kill_workers.py --quick            # the CI variant (under a minute),
                                                     # its last runs kill storms

Each *run* builds a loader with a randomly drawn configuration: dataset kind (map-style,
iterable without a state protocol, iterable with one), persistent workers on or off,
start method fork or spawn, 2 or 3 workers, ``pin_memory`` on or off (on: through the
stand-in of ``stress/_pin_standin.py``, so the pin thread receives, pins and meets the
deaths). It iterates a few epochs while a killer
thread sends SIGKILL or SIGSEGV to a random live worker of that loader at random
moments. Every epoch's batches (sample ids and a digest of every tensor byte) are
compared with an uninterrupted reference run of the same configuration, computed first
(under fork: the stream does not depend on the start method).

Kill storms (``--storm``, and the last runs of ``--quick``): for the first seconds of
a run the killer sends SIGKILL or SIGSEGV every 10-80 ms under fork (every 1-3 s under
spawn, where a respawn takes seconds), without waiting for the loop to receive a batch
in between, so workers die idle, while starting, while restoring their snapshot and
while fetching. Those runs keep the default ``max_worker_retries``. A storm may kill
one batch's fetch more than ``max_worker_retries`` times in a row, which to the loader
is a poison sample, or one worker process ``max_worker_retries + 1`` times in a row
before it delivers a result (NOTE [ restart storms ]): it gives up with
``WorkerCrashedError``. The run then does what its message
tells a user to do: ``state_dict()``, a new loader, ``load_state_dict()``, go on; the
epoch's batches before and after must still be the uninterrupted epoch's. The number
of such give-ups is reported (``give_ups=N``); a storm run with more than 10 fails.

Latency: for every kill, the time from the kill to the next batch the training loop
receives, against the normal time between batches of the reference runs (reported per
start method; a spawn respawn imports torch again, a fork respawn does not).

Summary line (the last line of output):

    runs=N storms=N kills=N failures=N leaks=N respawns=N give_ups=N respawn_latency_ms=... normal_batch_ms=...

A failure is an epoch that differs from the reference or a run that raised; a leak is
a child process, fd or /dev/shm entry left at the end. Exit status 1 on either.
Workers' stderr (torch prints a line per SIGSEGV) goes to a log file named at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import multiprocessing.resource_tracker
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import torch  # noqa: E402

from snaploader import DataLoader, WorkerCrashedError, WorkerRespawnedWarning
from stress._datasets import KINDS, LeakCheck, fingerprint, make_dataset, quiet_worker  # noqa: E402
from stress._pin_standin import fake_pinning  # noqa: E402
from stress._probes import percentile  # noqa: E402

# torch's advice when num_workers exceeds the CPU count: 3 workers on 2 cores is the point.
warnings.filterwarnings("ignore", message="This DataLoader will create")

_BATCH = 4
_EPOCHS = 3
_BATCH_TIMEOUT_S = 300  # a hang becomes a failure, not a stuck CI job
_SIGNALS = (signal.SIGKILL, signal.SIGSEGV)
_STORM_GIVE_UPS = 10  # a storm run that gives up more often than this fails


@dataclass(frozen=True)
class Config:
    kind: str
    persistent: bool
    context: str
    workers: int
    pin: bool = False  # pin_memory=True through the stand-in (stress/_pin_standin.py)

    def __str__(self) -> str:
        return f"{self.kind:13} persistent={int(self.persistent)} {self.context:5} W={self.workers} pin={int(self.pin)}"


class Killer(threading.Thread):
    """Sends SIGKILL or SIGSEGV to a random live worker of ``self.iterator`` every
    ``gap_s`` (drawn per kill), until ``budget`` kills are spent (``run_budget`` in the
    current run) or it is stopped. It kills only after the training loop has received
    a batch since the last kill, so that a run always makes progress (a spawn respawn
    that is killed again while importing torch would otherwise loop for minutes);
    except during a storm (until ``storm_until``), when it kills every ``gap_s``
    whatever happens."""

    def __init__(self, rng: random.Random, budget: int) -> None:
        super().__init__(daemon=True)
        self.rng = rng
        self.budget = budget
        self.run_budget = budget
        self.run_start = 0  # len(self.kills) when the current run began
        self.iterator: Any = None
        self.batches = 0  # batches the training loop has received, all runs
        self.gap_s = (0.02, 0.25)
        self.storm_until = 0.0  # monotonic time
        self.kills: list[tuple[float, int, str]] = []  # (monotonic time, pid, signal)
        self.stopping = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        seen = -1
        while not self.stopping.wait(self.rng.uniform(*self.gap_s)):
            storming = time.monotonic() < self.storm_until
            if len(self.kills) >= self.budget or (
                not storming and len(self.kills) - self.run_start >= self.run_budget
            ):
                continue
            if self.batches == seen and not storming:
                continue
            iterator = self.iterator
            try:
                pids = [] if iterator is None else iterator.worker_pids
            except (AttributeError, ValueError, RuntimeError):
                pids = []  # between iterators, or a process object already closed
            if not pids:
                continue
            pid = self.rng.choice(pids)
            sig = self.rng.choice(_SIGNALS)
            try:
                # Only ever a live child of ours: never a recycled pid.
                if psutil.Process(pid).ppid() != me or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    continue
                os.kill(pid, sig)
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
            seen = self.batches
            self.kills.append((time.monotonic(), pid, signal.Signals(sig).name))


def make_loader(cfg: Config, n: int, delay_s: float, log_path: str, storm: bool = False) -> DataLoader:
    return DataLoader(
        make_dataset(cfg.kind, n, delay_s),
        batch_size=_BATCH,
        shuffle=cfg.kind == "map",
        num_workers=cfg.workers,
        worker_init_fn=functools.partial(quiet_worker, log_path),
        multiprocessing_context=cfg.context,
        generator=torch.Generator().manual_seed(1234),
        persistent_workers=cfg.persistent,
        pin_memory=cfg.pin,
        timeout=_BATCH_TIMEOUT_S,
        replay="allow",
        # Outside storms the killer may strike one batch's fetch again and again: it is
        # not a poison sample, never give up. In a storm, the default: see the docstring.
        max_worker_retries=3 if storm else 1_000_000,
    )


def run_epochs(make: Callable[[], DataLoader], epochs: int, killer: Killer | None, times: list[float],
               give_ups: int = 0) -> tuple[list[list[str]], int]:
    """The batches' fingerprints of ``epochs`` epochs of ``make()``'s loader, and how
    many times it gave up. A give-up (``WorkerCrashedError``, at most ``give_ups`` of
    them) is met as a user would: ``state_dict()``, a new loader, ``load_state_dict()``
    and on; the epoch's batches before and after it form one epoch."""
    out: list[list[str]] = []
    gave_up = 0
    loader = make()
    it = None
    try:
        batches: list[str] = []
        while len(out) < epochs:
            it = iter(loader)
            if killer is not None:
                killer.iterator = it
            try:
                for batch in it:
                    times.append(time.monotonic())
                    batches.append(fingerprint(batch))
                    if killer is not None:
                        killer.batches += 1
            except WorkerCrashedError as e:
                if gave_up >= give_ups or "state_dict() still resumes at this batch" not in str(e):
                    raise
                gave_up += 1
                state = loader.state_dict()
                it.close()
                loader = make()
                loader.load_state_dict(state)
                continue
            out.append(batches)
            batches = []
    finally:
        if killer is not None:
            killer.iterator = None
        if it is not None:
            it.close()
    return out, gave_up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="start no new run after this long")
    parser.add_argument("--kills", type=int, default=1_000_000, help="stop killing after this many kills")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--delay-ms", type=float, default=2.0, help="time to load one sample")
    parser.add_argument("--spawn-share", type=float, default=0.25, help="fraction of runs under spawn")
    parser.add_argument("--only", metavar="KIND,PERSISTENT,CONTEXT,WORKERS",
                        help="one configuration for every run, e.g. map,1,spawn,2")
    parser.add_argument("--quick", action="store_true", help="the short bounded CI variant")
    parser.add_argument("--storm", action="store_true", help="kill storms in every run")
    parser.add_argument("--storm-s", type=float, default=1.5,
                        help="how long a storm lasts in a fork run (four times that under spawn)")
    args = parser.parse_args()
    storm_from_s = 0.0 if args.storm else float("inf")  # runs started after this storm
    if args.quick:
        args.seconds, args.samples = 35.0, 96
        storm_from_s = min(storm_from_s, 22.0)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    faulthandler.dump_traceback_later(args.seconds + 900, exit=True)  # never hang CI
    print(f"kill_workers: seed={seed} seconds={args.seconds:g} samples={args.samples}", flush=True)

    log_dir = tempfile.mkdtemp(prefix="snaploader-kill-workers-")
    log_path = os.path.join(log_dir, "workers-stderr.log")
    multiprocessing.resource_tracker.ensure_running()  # a lifelong helper, not a leak
    baseline = LeakCheck()

    references: dict[tuple[str, bool, int], list[list[str]]] = {}
    normal_gaps: list[float] = []
    latency: dict[str, list[float]] = {"fork": [], "spawn": []}
    runs = kills = failures = respawns = storms = give_ups = 0
    started = time.monotonic()
    killer = Killer(rng, args.kills)
    killer.start()
    try:
        while time.monotonic() - started < args.seconds and kills < args.kills:
            # --quick: the spawn run and at least one ordinary fork run come first
            storm = time.monotonic() - started >= storm_from_s and (not args.quick or runs >= 2)
            spawn = (runs == 0) if args.quick else rng.random() < args.spawn_share
            cfg = Config(
                kind=rng.choice(KINDS),
                persistent=rng.random() < 0.5,
                context="spawn" if spawn else "fork",
                workers=2 if args.quick else rng.choice((2, 3)),
                pin=rng.random() < 0.5,  # the pinned stream against the unpinned reference
            )
            if args.only:
                kind, persistent, context, workers = args.only.split(",")
                cfg = Config(kind, persistent == "1", context, int(workers))
                spawn = context != "fork"
            key = (cfg.kind, cfg.persistent, cfg.workers)
            if key not in references:
                ref_times: list[float] = []
                reference_cfg = Config(cfg.kind, cfg.persistent, "fork", cfg.workers)
                references[key], _ = run_epochs(
                    functools.partial(make_loader, reference_cfg, args.samples, args.delay_ms / 1000, log_path),
                    _EPOCHS, None, ref_times)
                normal_gaps += [b - a for a, b in zip(ref_times, ref_times[1:]) if b > a]
            # A spawn respawn takes seconds: kill less often there.
            if storm:
                killer.gap_s = (1.0, 3.0) if spawn else (0.01, 0.08)
                killer.run_budget = 0
            else:
                killer.gap_s = (0.5, 3.0) if spawn else (0.02, 0.25)
                killer.run_budget = 2 if args.quick and spawn else args.kills
            before = killer.run_start = len(killer.kills)
            times: list[float] = []
            run_started = time.monotonic()
            if storm:
                storms += 1
                killer.storm_until = run_started + args.storm_s * (4 if spawn else 1)
            problem = ""
            run_give_ups = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    make = functools.partial(make_loader, cfg, args.samples, args.delay_ms / 1000, log_path, storm)
                    with fake_pinning() if cfg.pin else contextlib.nullcontext():
                        got, run_give_ups = run_epochs(make, _EPOCHS, killer, times, _STORM_GIVE_UPS if storm else 0)
                    give_ups += run_give_ups
                    for epoch, (a, b) in enumerate(zip(got, references[key])):
                        if a != b:
                            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                            problem = (f"epoch {epoch} differs at batch {k}: "
                                       f"{a[k] if k < len(a) else 'END'} vs {b[k] if k < len(b) else 'END'}")
                            break
                except Exception:
                    problem = traceback.format_exc()
            run_kills = killer.kills[before:]
            kills += len(run_kills)
            run_respawns = sum(issubclass(w.category, WorkerRespawnedWarning) for w in caught)
            respawns += run_respawns
            for t_kill, _, _ in run_kills:
                later = [t for t in times if t > t_kill]
                if later:
                    latency[cfg.context].append(later[0] - t_kill)
            runs += 1
            failures += bool(problem)
            status = "ok" if not problem else "FAIL " + problem
            killer.storm_until = 0.0
            print(f"run {runs:3}: {cfg}{'  storm' if storm else ''}  kills={len(run_kills):3} respawns={run_respawns:3} "
                  f"{f'give-ups={run_give_ups} ' if run_give_ups else ''}"
                  f"{time.monotonic() - run_started:5.1f}s  {status}", flush=True)
            if problem:
                for t_kill, pid, sig in run_kills:
                    print(f"  killed pid {pid} with {sig} at {t_kill - run_started:.2f}s")
                said = [str(w.message) for w in caught if issubclass(w.category, WorkerRespawnedWarning)]
                for message in said[:5] + (["..."] + said[-3:] if len(said) > 8 else said[5:]):
                    print(f"  warning: {message}")
    finally:
        killer.stopping.set()
        killer.join()
    leaks = baseline.leaks()
    for leak in leaks:
        print(f"leak: {leak}")

    def ms(values: list[float]) -> str:
        if not values:
            return "n/a"
        return f"{1000 * statistics.median(values):.0f}/{1000 * percentile(values, 0.9):.0f}"

    print(f"worker stderr: {log_path}")
    print(f"respawn latency = time from a kill to the next batch, median/p90 in ms; "
          f"normal batch = median time between batches of the uninterrupted runs")
    print(f"runs={runs} storms={storms} kills={kills} failures={failures} leaks={len(leaks)} respawns={respawns} "
          f"give_ups={give_ups} respawn_latency_ms=fork:{ms(latency['fork'])},spawn:{ms(latency['spawn'])} "
          f"normal_batch_ms={1000 * statistics.median(normal_gaps) if normal_gaps else float('nan'):.1f}",
          flush=True)
    return 1 if failures or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
