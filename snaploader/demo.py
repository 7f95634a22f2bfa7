"""Demo: kill a training process mid-epoch, resume it, and compare the batch streams.

Run ``python -m snaploader.demo``. It trains (pretends to) on a small dataset whose
items get random augmentations inside 2 workers (Python ``random``, NumPy and torch
draws), checkpointing the loader every few steps. The trainer process is SIGKILLed in
the middle of the second epoch and restarted from its last checkpoint; after the
restart one of its workers is SIGKILLed too. The batches it consumed are compared,
digest by digest, with an uninterrupted run. The same scenario is then played with
torch's DataLoader, resumed the usual way (rebuild, re-seed, fast-forward through the
batches already consumed this epoch).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ._errors import WorkerRespawnedWarning

_ITEMS = 96
_BATCH = 8
_EPOCHS = 2
_STEPS = _ITEMS // _BATCH
_CHECKPOINT_EVERY = 3
_STEP_S = 0.08  # pretend training time per step
_KILL_AT = (1, 7)  # (epoch, step) after which the trainer is SIGKILLed
_WORKER_KILL_AT = (1, 9)  # after the restart, a worker is SIGKILLed here


class AugmentedImages(Dataset[torch.Tensor]):
    """Item i: a fixed 3x8x8 pattern plus augmentations drawn in the worker."""

    def __len__(self) -> int:
        return _ITEMS

    def __getitem__(self, index: int) -> torch.Tensor:
        base = torch.full((3, 8, 8), float(index))
        if random.random() < 0.5:  # random horizontal flip
            base = base.flip(-1)
        jitter = torch.from_numpy(np.random.normal(0.0, 0.1, size=(3, 8, 8))).float()
        return base + jitter + torch.rand(3, 8, 8) * 0.05  # noise


def make_loader(kind: str) -> Any:
    from . import DataLoader

    cls = DataLoader if kind == "snaploader" else torch.utils.data.DataLoader
    return cls(
        AugmentedImages(),
        batch_size=_BATCH,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
        multiprocessing_context="fork",
    )


def digest(batch: torch.Tensor) -> str:
    return hashlib.sha1(batch.numpy().tobytes()).hexdigest()[:10]


# -- the trainer (a child process) ------------------------------------------------------


def trainer(kind: str, workdir: Path, kill_worker: bool) -> None:
    """Train, logging each batch digest; checkpoint every few steps; resume if a
    checkpoint exists (the parent has cut the log back to what it covers)."""
    warnings.simplefilter("ignore", UserWarning)
    ckpt_path, log_path = workdir / f"{kind}.ckpt", workdir / f"{kind}.log"
    loader = make_loader(kind)
    start_epoch, start_step, logged = 0, 0, 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=True)
        start_epoch, start_step, logged = ckpt["epoch"], ckpt["step"], ckpt["logged"]
        if kind == "snaploader":
            loader.load_state_dict(ckpt["loader"])
    log = log_path.open("a")
    catcher = warnings.catch_warnings(record=True)
    caught = catcher.__enter__()
    warnings.simplefilter("always", WorkerRespawnedWarning)
    for epoch in range(start_epoch, _EPOCHS):
        iterator = iter(loader)
        first = start_step if epoch == start_epoch else 0
        if kind == "torch" and first:
            # the usual torch recipe: re-read and drop the batches already consumed
            for _ in range(first):
                next(iterator)
            print(f"TORCH-FAST-FORWARD {first}", flush=True)
        for step in range(first, _STEPS):
            batch = next(iterator)
            time.sleep(_STEP_S)
            log.write(f"{epoch} {step} {digest(batch)}\n")
            log.flush()
            logged += 1
            done = step + 1
            if kill_worker and kind == "snaploader" and (epoch, step) == _WORKER_KILL_AT:
                pid = iterator.worker_pids[1]
                os.kill(pid, signal.SIGKILL)
                print(f"WORKER-KILLED {pid}", flush=True)
            for warning in caught:
                print(f"RESPAWNED {warning.message}", flush=True)
            caught.clear()
            if done % _CHECKPOINT_EVERY == 0:
                state = {"epoch": epoch, "step": done, "logged": logged}
                if done == _STEPS:
                    state.update(epoch=epoch + 1, step=0)
                if kind == "snaploader":
                    state["loader"] = loader.state_dict()
                tmp = ckpt_path.with_suffix(".tmp")
                torch.save(state, tmp)
                os.replace(tmp, ckpt_path)
        list(iterator)  # end the epoch (nothing left)
    catcher.__exit__(None, None, None)
    log.close()


# -- the parent: reference, kill, resume, compare -------------------------------------


def reference(kind: str) -> list[str]:
    loader = make_loader(kind)
    return [digest(b) for _ in range(_EPOCHS) for b in loader]


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "#" * filled + "." * (width - filled)


@dataclass(frozen=True)
class _Restart:
    """Where the restarted trainer stands against the killed one: the log lines its
    checkpoint covers, and the log lines the killed run had reached."""

    covered: int
    reached: int


def _progress(lines: list[str], restart: _Restart | None) -> tuple[int, str]:
    """(batches for the bar, the text) for a log of ``lines``. After a restart the
    display never goes back: the steps between the checkpoint and the kill are shown
    as redone, and the bar stays where the killed run had taken it."""
    done = len(lines) if restart is None else max(len(lines), restart.reached)
    if restart is not None and len(lines) <= restart.covered:
        return done, "resuming from the checkpoint"
    if not lines:
        return done, "starting"
    epoch, step = lines[-1].split()[:2]
    text = f"epoch {epoch} step {int(step) + 1:2d}/{_STEPS}"
    if restart is not None and len(lines) <= restart.reached:
        text += " (redone: it came after the checkpoint)"
    return done, text


def _watch(
    proc: subprocess.Popen[str], log_path: Path, label: str, stop_at: tuple[int, int] | None,
    restart: _Restart | None = None,
) -> list[str]:
    """Show progress from the log; SIGKILL the trainer once it logs ``stop_at``."""
    notes: list[str] = []
    total = _EPOCHS * _STEPS
    tty = sys.stdout.isatty()
    shown_before = ""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        lines = log_path.read_text().splitlines() if log_path.exists() else []
        last = lines[-1].split() if lines else None
        done, shown = _progress(lines, restart)
        if shown != shown_before:
            line = f"  {label:<14} [{_bar(done, total)}] {shown}"
            print(f"\r{line}   " if tty else line, end="" if tty else "\n", flush=True)
            shown_before = shown
        for out in iter(proc.stdout.readline, ""):
            notes.append(out.strip())
        if stop_at is not None and last and (int(last[0]), int(last[1])) >= stop_at:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            print(f"{chr(10) if tty else ''}  !! SIGKILL to the training process (pid {proc.pid}) at epoch {last[0]} step {int(last[1]) + 1}")
            return notes
        if proc.poll() is not None:
            for out in iter(proc.stdout.readline, ""):
                notes.append(out.strip())
            if tty:
                print()
            if proc.returncode != 0:
                raise SystemExit(f"the trainer failed with exit code {proc.returncode}")
            return notes
        time.sleep(0.05)


def scenario(kind: str, workdir: Path) -> tuple[int, int, list[str]]:
    """Run, kill, resume. Returns (batches differing from reference, total, notes)."""
    command = [sys.executable, "-m", "snaploader.demo", "--trainer", kind, "--workdir", str(workdir)]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    notes = _watch(first, workdir / f"{kind}.log", "first run", _KILL_AT)
    ckpt = torch.load(workdir / f"{kind}.ckpt", weights_only=True)
    log_path = workdir / f"{kind}.log"
    lines = log_path.read_text().splitlines()
    restart = _Restart(covered=ckpt["logged"], reached=len(lines))
    # What the checkpoint does not cover is lost with the killed process.
    log_path.write_text("".join(line + "\n" for line in lines[: restart.covered]))
    print(f"  restarting from the checkpoint at epoch {ckpt['epoch']} step {ckpt['step']}: "
          f"the {restart.reached - restart.covered} step(s) after it are redone")
    second = subprocess.Popen(command + ["--kill-worker"], stdout=subprocess.PIPE, text=True)
    notes += _watch(second, log_path, "after restart", None, restart)
    got = [line.split()[2] for line in (workdir / f"{kind}.log").read_text().splitlines()]
    want = reference(kind)
    differing = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
    return differing, len(want), notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", choices=["snaploader", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer:
        trainer(args.trainer, args.workdir, args.kill_worker)
        return
    print(f"snaploader demo: {_EPOCHS} epochs x {_STEPS} batches of {_BATCH}, 2 workers, "
          "random augmentations drawn inside the workers")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("snaploader", "torch"):
            print(f"\n== {kind} ==")
            differing, total, notes = scenario(kind, Path(tmp))
            for note in notes:
                if note.startswith("WORKER-KILLED"):
                    print(f"  !! SIGKILL to worker 1 (pid {note.split()[1]}) after the restart")
                if note.startswith("RESPAWNED"):
                    print(f"  warning: {note.split(' ', 1)[1]}")
                if note.startswith("TORCH-FAST-FORWARD"):
                    print(f"  torch resume re-read and dropped {note.split()[1]} batches to fast-forward")
            results[kind] = (differing, total)
            verdict = "IDENTICAL to the uninterrupted run" if differing == 0 else (
                f"{differing} of {total} batches DIFFER from the uninterrupted run")
            print(f"  consumed stream vs uninterrupted run: {verdict}")
    print("\nsummary:")
    for kind, (differing, total) in results.items():
        print(f"  {kind:<10} {total - differing:3d}/{total} batches identical after a process kill"
              + (" and a worker kill" if kind == "snaploader" else ""))
    if results["snaploader"][0] != 0:
        raise SystemExit("snaploader's resumed stream differs: this is a bug")


if __name__ == "__main__":
    main()
