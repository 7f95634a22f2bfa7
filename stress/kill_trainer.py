#!/usr/bin/env python
"""SIGKILL a training process at random moments, resume it from its last checkpoint,
again and again; check that the batches it consumed, stitched together, are exactly
the uninterrupted stream: no batch lost, none repeated.

    python stress/kill_trainer.py --seconds 300      # a long run, for people
    python stress/kill_trainer.py --quick            # the CI variant (under a minute)

The *trainer* (this script with ``--child``) iterates a loader for a few epochs. After
each batch it appends the batch's fingerprint (sample ids and a digest of every tensor
byte) to its own log file, one line per batch, written unbuffered. Every few batches,
and at each epoch's end, it saves ``{"loader": loader.state_dict(), "lines": N, "epoch":
e}`` with ``torch.save`` to a temporary file and renames it over the checkpoint (an
atomic replace), where N is the number of batches consumed so far. Started again, it
loads the checkpoint (``torch.load(weights_only=True)``) and goes on.

The *parent* runs one trainer after another in a fresh work directory per run (a
drawn configuration: dataset kind, persistent workers, start method, worker count).
It waits until the trainer has logged a batch, then SIGKILLs it at a random moment,
checks that the trainer's workers exit on their own (no orphan left after
``_ORPHAN_LIMIT_S``), and starts the next trainer. A trainer that finishes all
epochs ends the run. The parent then stitches the stream: each trainer's log begins
with the N of the checkpoint it resumed from, so the stream so far is cut to N lines
(what that checkpoint covered) and the trainer's complete lines are appended. The
result must equal the uninterrupted stream, computed first in this process.

Summary line (the last line of output):

    runs=N kills=N failures=N leaks=N restarts=N

A failure is a stitched stream that differs from the reference, a checkpoint that
claims more batches than were logged, or a trainer that exits with an error; a leak
is a worker left running after its trainer was killed, or a child process, fd or
/dev/shm entry of the parent left at the end. Exit status 1 on either.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from snaploader import DataLoader
from stress._datasets import KINDS, LeakCheck, alive, fingerprint, make_dataset  # noqa: E402

# torch's advice when num_workers exceeds the CPU count: 3 workers on 2 cores is the point.
warnings.filterwarnings("ignore", message="This DataLoader will create")

_BATCH = 4
_CHECKPOINT_EVERY = 3  # batches
_ORPHAN_LIMIT_S = 15.0
_TRAINER_LIMIT_S = 600.0  # a trainer that runs this long without being killed is stuck


def make_loader(cfg: dict[str, Any]) -> DataLoader:
    return DataLoader(
        make_dataset(cfg["kind"], cfg["samples"], cfg["delay_ms"] / 1000),
        batch_size=_BATCH,
        shuffle=cfg["kind"] == "map",
        num_workers=cfg["workers"],
        multiprocessing_context=cfg["context"],
        generator=torch.Generator().manual_seed(99),
        persistent_workers=cfg["persistent"],
        replay="allow",
    )


# -- the trainer (child process) -----------------------------------------------------------


def trainer(workdir: Path, cfg: dict[str, Any], segment: int) -> int:
    checkpoint = workdir / "checkpoint.pt"
    loader = make_loader(cfg)
    lines, epoch = 0, 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        loader.load_state_dict(saved["loader"])
        lines, epoch = saved["lines"], saved["epoch"]
    log = os.open(workdir / f"log-{segment:05}.txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(log, f"START {lines}\n".encode())

    def save(next_epoch: int) -> None:
        tmp = workdir / "checkpoint.tmp"
        torch.save({"loader": loader.state_dict(), "lines": lines, "epoch": next_epoch}, tmp)
        os.replace(tmp, checkpoint)

    for e in range(epoch, cfg["epochs"]):
        for batch in loader:
            os.write(log, f"{e} {fingerprint(batch)}\n".encode())
            lines += 1
            if lines % _CHECKPOINT_EVERY == 0:
                save(e)
        save(e + 1)  # the loader's state after an epoch says: next iter() is epoch e+1
    os.write(log, b"DONE\n")
    os.close(log)
    return 0


# -- the parent ------------------------------------------------------------------------------


def reference(cfg: dict[str, Any]) -> list[str]:
    loader = make_loader({**cfg, "context": "fork"})
    out = []
    for e in range(cfg["epochs"]):
        for batch in loader:
            out.append(f"{e} {fingerprint(batch)}")
    del loader
    return out


def read_segment(path: Path) -> tuple[int, list[str], bool]:
    """(lines the checkpoint it resumed from covered, its complete lines, finished)."""
    text = path.read_text()
    complete = text.split("\n")[:-1]  # a line cut by the kill has no newline: dropped
    if not complete or not complete[0].startswith("START "):
        return -1, [], False  # killed before it wrote its first line
    done = complete[-1] == "DONE"
    body = complete[1:-1] if done else complete[1:]
    return int(complete[0].split()[1]), body, done


def wait_for_progress(path: Path, proc: subprocess.Popen[bytes], limit_s: float) -> bool:
    """True once the trainer has logged a batch; False if it ended or stalled."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if path.read_text().count("\n") >= 2:
                return True
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="start no new run after this long")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--delay-ms", type=float, default=8.0, help="time to load one sample")
    parser.add_argument("--max-kill-after", type=float, default=1.5, help="kill within this long after the first batch")
    parser.add_argument("--spawn-share", type=float, default=0.2, help="fraction of runs under spawn")
    parser.add_argument("--quick", action="store_true", help="the short bounded CI variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # workdir of a trainer
    parser.add_argument("--segment", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        workdir = Path(args.child)
        return trainer(workdir, json.loads((workdir / "config.json").read_text()), args.segment)

    if args.quick:
        args.seconds, args.epochs, args.samples = 30.0, 2, 96
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    rng = random.Random(seed)
    faulthandler.dump_traceback_later(args.seconds + 1200, exit=True)  # never hang CI
    print(f"kill_trainer: seed={seed} seconds={args.seconds:g} epochs={args.epochs} "
          f"samples={args.samples}", flush=True)
    baseline = LeakCheck()
    root = Path(tempfile.mkdtemp(prefix="snaploader-kill-trainer-"))
    runs = kills = failures = restarts = orphans = 0
    started = time.monotonic()
    while time.monotonic() - started < args.seconds:
        cfg = {
            "kind": rng.choice(KINDS),
            "persistent": rng.random() < 0.5,
            "context": "spawn" if (not args.quick and rng.random() < args.spawn_share) else "fork",
            "workers": rng.choice((1, 2, 3)),
            "epochs": args.epochs,
            "samples": args.samples,
            "delay_ms": args.delay_ms,
        }
        workdir = root / f"run-{runs:04}"
        workdir.mkdir()
        (workdir / "config.json").write_text(json.dumps(cfg))
        want = reference(cfg)
        stream: list[str] = []
        problem = ""
        segment = run_kills = 0
        run_started = time.monotonic()
        while not problem:
            log = workdir / f"log-{segment:05}.txt"
            with open(workdir / f"stderr-{segment:05}.txt", "wb") as stderr:
                proc = subprocess.Popen(
                    [sys.executable, __file__, "--child", str(workdir), "--segment", str(segment)],
                    stderr=stderr,
                )
            # Kill only after it logged a batch, but not always: the last segment of
            # every run is allowed to finish (a run ends when a trainer completes).
            if wait_for_progress(log, proc, _TRAINER_LIMIT_S):
                time.sleep(rng.uniform(0.0, args.max_kill_after))
            if log.exists() and log.read_text().endswith("DONE\n"):
                proc.wait(_TRAINER_LIMIT_S)  # it finished: let it exit on its own
            if proc.poll() is None:
                try:
                    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    family = []
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                if proc.returncode == -signal.SIGKILL:
                    kills += 1
                    run_kills += 1
                deadline = time.monotonic() + _ORPHAN_LIMIT_S
                while any(alive(p) for p in family) and time.monotonic() < deadline:
                    time.sleep(0.05)
                left = [p for p in family if alive(p)]
                if left:
                    orphans += len(left)
                    print(f"  orphaned workers of killed trainer {proc.pid}: {left}", flush=True)
                    for pid in left:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            elif proc.returncode != 0:
                problem = f"trainer exited with code {proc.returncode}: see {workdir}/stderr-{segment:05}.txt"
            covered, body, done = read_segment(log)
            segment += 1
            if covered < 0:
                continue  # killed before it began: the next one starts from the same place
            if covered > len(stream):
                problem = f"segment {segment - 1}: the checkpoint covers {covered} batches, only {len(stream)} were logged"
                break
            stream = stream[:covered] + body
            if done:
                break
            restarts += 1
        if not problem and stream != want:
            k = next((k for k, (a, b) in enumerate(zip(stream, want)) if a != b), min(len(stream), len(want)))
            problem = (f"stitched stream differs at batch {k} of {len(want)}: "
                       f"{stream[k] if k < len(stream) else 'END'} vs {want[k] if k < len(want) else 'END'}")
        runs += 1
        failures += bool(problem)
        label = f"{cfg['kind']:13} persistent={int(cfg['persistent'])} {cfg['context']:5} W={cfg['workers']}"
        print(f"run {runs:3}: {label}  kills={run_kills:3} batches={len(want)} "
              f"{time.monotonic() - run_started:5.1f}s  {'ok' if not problem else 'FAIL ' + problem}", flush=True)
    leaks = baseline.leaks()
    for leak in leaks:
        print(f"leak: {leak}")
    print(f"work directories: {root}")
    print(f"runs={runs} kills={kills} failures={failures} leaks={len(leaks) + orphans} restarts={restarts}", flush=True)
    return 1 if failures or leaks or orphans else 0


if __name__ == "__main__":
    sys.exit(main())
