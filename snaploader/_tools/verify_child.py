"""One run of ``snaploader verify``, in a fresh process.

``python -m snaploader._tools.verify_child JOB OUT`` reads JOB (JSON), imports the user's
``MODULE:FACTORY``, builds the loader and writes what it saw to OUT (JSON). The parent
(``_tools/verify.py``) starts one such process per run, so that every run begins as a
training job does after a restart: nothing imported, nothing seeded.

Protocol (JOB -> OUT):

- JOB ``mode`` is ``"reference"`` (an uninterrupted run: ``epochs`` epochs of at most
  ``max_batches`` batches, saving ``state_dict()`` at the positions that ``cuts`` name
  to ``state_dir``) or ``"resume"`` (load the state file ``state_path``, written at
  ``start``, and consume the rest of the same run; with ``kill_worker``, SIGKILL one
  worker process after the first resumed batch, while it has work in flight).
- Both modes read every epoch the same way: up to ``max_batches`` batches, then one
  more ``next()`` to learn whether the epoch ended; a batch that answer yields is
  dropped and the epoch abandoned. The runs make the same calls, so they compare.
- OUT always holds ``ok``; on failure ``error`` = {``kind``: ``"usage"`` (the target,
  the factory or the options are wrong) or ``"pipeline"`` (the user's code raised),
  ``message``}. On success: ``batches`` (one record per batch: epoch, k, digest, leaf
  digests and, for map-style datasets, the sample indices), ``epochs`` (batches read
  and whether it ended, per epoch), ``saved`` (cut label -> state file), ``notes``.
- With ``topology`` (``{"batch_size", "num_workers"}``, None for the loader's own; see
  ``_tools/verify_compare.py``): the reference run checks that the loader can be
  resumed into it and compared sample by sample (a usage error if not), and both modes
  add to each batch record ``samples``, the digests of each of its samples. The resume
  builds the loader in that topology, loads with ``allow_mismatch=("batch_size",)``,
  and reads each epoch as ``plan`` says (``want`` samples, or to the epoch's end).
  OUT also holds the loader's ``batch_size``, ``drop_last``, ``seed_per_sample``,
  ``logical_workers`` and sampler ``items`` per epoch.
- The process's environment carries ``SNAPLOADER_VERIFY_PHASE`` (set by the parent:
  reference, resume or rerun) for factories that want to know.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil
import torch

from .._errors import WorkerRespawnedWarning
from .verify_loader import Built, Topology, UsageError, build
from .verify_record import Unsplittable, leaf_digests, plain_index, sample_digests, split_recorded

CUT_NAMES: Final = ("first", "mid", "end", "boundary")



# -- cut points -----------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """Where a checkpoint is taken: after ``k`` batches of ``epoch`` (``k`` a number
    or one of first, mid, end), or after that epoch ended (``boundary``)."""

    label: str
    epoch: int
    at: str  # "first", "mid", "end", "boundary" or a positive number

    @staticmethod
    def parse(text: str) -> Cut:
        where, _, epoch_text = text.strip().partition("@")
        hint = (
            "a cut is a batch count (5), first, mid, end or boundary, optionally "
            "followed by @EPOCH (mid@1); e.g. --cuts 1,mid,end,boundary"
        )
        if epoch_text and not (epoch_text.isdigit()):
            raise UsageError(f"cut {text!r}: the epoch after '@' should be a number >= 0; {hint}")
        if where not in CUT_NAMES and not (where.isdigit() and int(where) >= 1):
            raise UsageError(f"cut {text!r} is not understood; {hint}")
        return Cut(text.strip(), int(epoch_text or 0), where)

    def resolve(self, lengths: list[int], ended: list[bool], max_batches: int) -> tuple[int, int | None]:
        """(epoch, batches consumed) of this cut; None batches for the epoch boundary.
        ``lengths``/``ended``: per epoch of the reference run, batches read and
        whether the epoch ended."""
        if self.epoch >= len(lengths):
            raise UsageError(
                f"cut {self.label}: the run has epochs 0..{len(lengths) - 1}; raise "
                f"--epochs to {self.epoch + 1} or pick an earlier epoch"
            )
        n = lengths[self.epoch]
        if n == 0:
            raise UsageError(f"cut {self.label}: epoch {self.epoch} yielded no batch")
        if self.at == "boundary":
            if not ended[self.epoch]:
                raise UsageError(
                    f"cut {self.label}: epoch {self.epoch} has more than --max-batches "
                    f"{max_batches} batches, so the run never reaches its end; raise "
                    "--max-batches or drop this cut"
                )
            return self.epoch, None
        k = {"first": 1, "mid": max(1, n // 2), "end": n}.get(self.at)
        if k is None:
            k = int(self.at)
        if k > n:
            raise UsageError(
                f"cut {self.label}: epoch {self.epoch} has {n} batches in this run "
                f"(at most --max-batches {max_batches}); pick a cut between 1 and {n}"
            )
        return self.epoch, k


# -- the runs -------------------------------------------------------------------------


class _Recorder:
    def __init__(self, samples: bool = False) -> None:
        self.batches: list[dict[str, Any]] = []
        self.samples = samples  # also record each sample's digests (a resume into another topology)

    def add(self, epoch: int, k: int, batch: Any) -> None:
        indices, batch = split_recorded(batch)
        digest, leaves = leaf_digests(batch)
        record = {
            "epoch": epoch, "k": k, "digest": digest, "leaves": leaves,
            "indices": None if indices is None else [plain_index(i) for i in indices],
        }
        if self.samples and indices is not None:
            try:
                record["samples"] = sample_digests(batch, len(indices))
            except Unsplittable as exc:
                raise UsageError(
                    f"--resume-batch-size/--resume-workers compare samples, and verify cannot cut "
                    f"batch {k - 1} of epoch {epoch} into its {len(indices)} samples: {exc}. Have "
                    "collate_fn return tensors, arrays, dicts, lists or tuples of them whose first "
                    "dimension is the batch (pad variable lengths), or verify without these options"
                ) from None
        self.batches.append(record)


def _read_epoch(
    iterator: Iterator[Any], epoch: int, first_k: int, max_batches: int,
    recorder: _Recorder, after_batch: Callable[[int, int], None],
) -> tuple[int, bool]:
    """Read batches first_k+1.. of ``epoch`` (up to ``max_batches`` in all), then probe
    once for its end. Returns (batches read in the epoch, whether it ended)."""
    k = first_k
    while k < max_batches:
        try:
            batch = next(iterator)
        except StopIteration:
            return k, True
        k += 1
        recorder.add(epoch, k, batch)
        after_batch(epoch, k)
    try:
        next(iterator)
    except StopIteration:
        return k, True
    return k, False


def _worker_pids() -> list[int]:
    """The loader's worker processes: this process's descendants, less the helper
    processes multiprocessing starts (the forkserver, whose children are the workers
    under forkserver, and the resource tracker)."""
    me = psutil.Process()
    helpers = set()
    for child in me.children():
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "forkserver" in line or "resource_tracker" in line:
            helpers.add(child.pid)
    pids = []
    for process in me.children(recursive=True):
        if process.pid not in helpers:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    pids.append(process.pid)
            except psutil.Error:
                continue
    return sorted(pids)


def run_reference(job: dict[str, Any], built: Built) -> dict[str, Any]:
    loader, epochs, max_batches = built.loader, job["epochs"], job["max_batches"]
    recorder = _Recorder(samples="topology" in job)
    states: dict[tuple[int, int | None], dict[str, Any]] = {}

    def keep(epoch: int, k: int) -> None:
        states[(epoch, k)] = loader.state_dict()

    lengths, ended = [], []
    for epoch in range(epochs):
        iterator = iter(loader)
        n, done = _read_epoch(iterator, epoch, 0, max_batches, recorder, keep)
        del iterator
        lengths.append(n)
        ended.append(done)
        if done:
            states[(epoch, None)] = loader.state_dict()
    saved: dict[str, dict[str, Any]] = {}
    for text in job["cuts"]:
        cut = Cut.parse(text)
        try:
            position = cut.resolve(lengths, ended, max_batches)
        except UsageError:
            if job["strict_cuts"]:
                raise
            continue
        path = Path(job["state_dir"]) / f"state-{len(saved)}.pt"
        torch.save(states[position], path)
        saved[cut.label] = {"path": str(path), "epoch": position[0], "k": position[1]}
    return {"batches": recorder.batches, "lengths": lengths, "ended": ended, "saved": saved}


def _read_samples(
    iterator: Iterator[Any], epoch: int, read: dict[str, Any], recorder: _Recorder,
    after_batch: Callable[[int, int], None],
) -> None:
    """Read batches of ``epoch`` until they hold ``read["want"]`` samples (None: until the
    epoch ends), or ``read["cap"]`` batches were read (then the comparison finds too many);
    the first is numbered ``read["first_k"]`` (from 0)."""
    got, k = 0, read["first_k"]
    while k - read["first_k"] < read["cap"] and (read["want"] is None or got < read["want"]):
        try:
            batch = next(iterator)
        except StopIteration:
            return
        k += 1
        recorder.add(epoch, k, batch)
        got += len(recorder.batches[-1]["indices"])
        after_batch(epoch, k)


def run_resume(job: dict[str, Any], built: Built) -> dict[str, Any]:
    loader, epochs, max_batches = built.loader, job["epochs"], job["max_batches"]
    if job["kill_worker"] and loader.num_workers == 0:
        raise UsageError("--kill-worker needs worker processes, and this loader has num_workers=0; drop --kill-worker")
    state = torch.load(job["state_path"], weights_only=True)
    topology = job.get("topology")
    loader.load_state_dict(state, allow_mismatch=("batch_size",) if topology and topology["batch_size"] else ())
    start_epoch, start_k = job["start"]
    recorder = _Recorder(samples=topology is not None)
    notes: list[str] = []
    # Right after the first batch, while the workers still have prefetched work ahead:
    # half-way through a short run, the worker may have produced all it ever will.
    kill_after = 1

    def maybe_kill(epoch: int, k: int) -> None:
        if not job["kill_worker"] or len(recorder.batches) != kill_after:
            return
        pids = _worker_pids()
        if not pids:
            notes.append(f"--kill-worker: no worker process was running after batch {k - 1} of epoch {epoch}")
            return
        os.kill(pids[0], signal.SIGKILL)
        notes.append(f"--kill-worker: SIGKILLed worker pid {pids[0]} after batch {k - 1} of epoch {epoch}")

    first = start_epoch if start_k is not None else start_epoch + 1
    for epoch in range(first, epochs):
        iterator = iter(loader)
        if topology is not None:
            if epoch - first == len(job["plan"]):
                break  # the epochs after one left part-way are not compared
            _read_samples(iterator, epoch, job["plan"][epoch - first], recorder, maybe_kill)
        else:
            already = start_k if epoch == start_epoch and start_k is not None else 0
            _read_epoch(iterator, epoch, already, max_batches, recorder, maybe_kill)
        del iterator
    return {"batches": recorder.batches, "notes": notes}


def _items(loader: Any) -> int | None:
    """Sampler items per epoch, when the loader's sampler knows."""
    try:
        return len(loader.sampler)
    except TypeError:
        return None


def run(job: dict[str, Any]) -> dict[str, Any]:
    try:
        topology = job.get("topology")
        built = build(job["target"], None if topology is None else Topology(**topology),
                      resumed=job["mode"] == "resume")
        loader = built.loader
        built_notes, facts = built.notes, {
            "kind": built.kind, "num_workers": loader.num_workers, "recorded": built.recorded,
            "generator": loader.generator is not None, "batch_size": loader.batch_size,
            "drop_last": loader.drop_last, "seed_per_sample": loader._snaploader_options.seed_per_sample,
            "logical_workers": loader._snaploader_options.logical_workers, "persistent_workers": loader.persistent_workers,
            "items": None if built.kind == "iterable" else _items(loader),
        }
        del loader
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if job["mode"] == "reference":
                result = run_reference(job, built)
            else:
                result = run_resume(job, built)
        del built
        gc.collect()
    except UsageError as exc:
        return {"ok": False, "error": {"kind": "usage", "message": str(exc)}}
    except Exception as exc:
        text = "".join(traceback.format_exception(exc))
        return {"ok": False, "error": {"kind": "pipeline", "message": text}}
    notes = built_notes + result.pop("notes", [])
    if not any(issubclass(w.category, WorkerRespawnedWarning) for w in caught):
        notes = [n + " (it had no work left in this run: nothing to respawn)" if n.startswith("--kill-worker: SIGKILLed")
                 else n for n in notes]
    for warning in caught:
        line = f"{warning.category.__name__}: {str(warning.message).splitlines()[0]}"
        # WorkerRespawnedWarning (a RuntimeWarning) and the replay notice (a UserWarning)
        # say what the run did; deprecations and the like are not verify's business.
        if issubclass(warning.category, (UserWarning, RuntimeWarning)) and line not in notes:
            notes.append(line)
    return {"ok": True, **facts, **result, "notes": notes}


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    result = run(job)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
