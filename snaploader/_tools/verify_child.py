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
- The process's environment carries ``SNAPLOADER_VERIFY_PHASE`` (set by the parent:
  reference, resume or rerun) for factories that want to know.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
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
import torch.utils.data as torch_data

from .._errors import WorkerRespawnedWarning
from .._loader import DataLoader
from .verify_record import (
    RecordingCollate,
    leaf_digests,
    plain_index,
    record_indices,
    split_recorded,
)

CUT_NAMES: Final = ("first", "mid", "end", "boundary")


class UsageError(Exception):
    """The target, the factory or an option is wrong; the message says how to fix it."""


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


# -- the user's loader ----------------------------------------------------------------


def load_factory(target: str) -> Callable[[], Any]:
    """The FACTORY of ``MODULE:FACTORY``; MODULE a dotted name or a path to a .py file."""
    module_text, sep, name = target.rpartition(":")
    if not sep or not module_text or not name.isidentifier():
        raise UsageError(
            f"target {target!r} should be MODULE:FACTORY, e.g. mypackage.data:make_loader "
            "or path/to/pipeline.py:make_loader"
        )
    if module_text.endswith(".py"):
        path = Path(module_text).resolve()
        if not path.is_file():
            raise UsageError(f"{module_text}: no such file; give the path of the .py file that defines {name}")
        # Imported under its own name from its own folder, as `python file.py` would
        # find it, so that spawned workers can import it again by that name.
        sys.path.insert(0, str(path.parent))
        module_name = path.stem
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise UsageError(f"importing {module_text} failed: {exc}") from exc
        if Path(getattr(module, "__file__", "") or "").resolve() != path:
            raise UsageError(
                f"{module_text}: its name {module_name!r} is already taken by {module!r}; "
                "rename the file or pass it as a dotted module name"
            )
    else:
        try:
            found = importlib.util.find_spec(module_text)
        except (ImportError, ValueError) as exc:
            found = None
            reason = str(exc)
        else:
            reason = "not found"
        if found is None:
            raise UsageError(
                f"module {module_text!r}: {reason} (searched from {os.getcwd()}); run from the "
                "folder that contains it, add that folder to PYTHONPATH, or give a .py path"
            )
        module = importlib.import_module(module_text)
    factory = getattr(module, name, None)
    if factory is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise UsageError(f"{module_text} has no {name!r}; its callables are {public}")
    if not callable(factory):
        raise UsageError(f"{module_text}:{name} is a {type(factory).__name__}, not a function that returns a loader")
    return factory  # type: ignore[no-any-return]


def _torch_shuffle_and_sampler(loader: torch_data.DataLoader[Any]) -> tuple[bool | None, Any]:
    """(shuffle, sampler) arguments that rebuild ``loader``'s sampler."""
    sampler = loader.sampler
    if isinstance(loader.dataset, torch_data.IterableDataset):
        return None, None
    if type(sampler) is torch_data.RandomSampler and not sampler.replacement and (
        sampler._num_samples is None and sampler.generator is loader.generator
    ):
        return True, None
    if type(sampler) is torch_data.SequentialSampler:
        return None, None
    return None, sampler


def rebuild(loader: torch_data.DataLoader[Any], dataset: Any, collate_fn: Any) -> DataLoader:
    """A snaploader DataLoader with ``loader``'s arguments, ``dataset`` and ``collate_fn``."""
    custom_batches = loader.batch_size is None and loader.batch_sampler is not None
    shuffle, sampler = (None, None) if custom_batches else _torch_shuffle_and_sampler(loader)
    workers = loader.num_workers
    # snaploader's own options, all of them: a torch loader has none (the defaults).
    own = loader.options.arguments() if isinstance(loader, DataLoader) else {}
    return DataLoader(
        dataset,
        batch_size=1 if custom_batches else loader.batch_size,
        shuffle=shuffle,
        sampler=sampler,
        batch_sampler=loader.batch_sampler if custom_batches else None,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=False if custom_batches else loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers else None,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=getattr(loader, "pin_memory_device", ""),
        in_order=getattr(loader, "in_order", True),
        **own,
    )


@dataclass
class Built:
    loader: DataLoader
    kind: str  # "map" or "iterable"
    recorded: bool  # sample indices are recorded
    notes: list[str]


def build(target: str) -> Built:
    factory = load_factory(target)
    made = factory()
    if not isinstance(made, torch_data.DataLoader):
        raise UsageError(
            f"{target}() returned a {type(made).__module__}.{type(made).__qualname__}; it "
            "should return a snaploader.DataLoader (or a torch DataLoader, whose arguments "
            "verify reuses)"
        )
    notes = []
    if not isinstance(made, DataLoader):
        notes.append(
            f"{target}() returned a torch DataLoader: verify checks the snaploader "
            "DataLoader built with its arguments"
        )
    dataset = made.dataset
    iterable = isinstance(dataset, torch_data.IterableDataset)
    recorded = False
    collate_fn = made.collate_fn
    if not iterable:
        recorded = record_indices(dataset)
        if recorded:
            collate_fn = RecordingCollate(made.collate_fn)
        else:
            notes.append(f"sample indices not recorded: a {type(dataset).__qualname__} cannot be wrapped")
    loader = rebuild(made, dataset, collate_fn)
    return Built(loader, "iterable" if iterable else "map", recorded, notes)


# -- the runs -------------------------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.batches: list[dict[str, Any]] = []

    def add(self, epoch: int, k: int, batch: Any) -> None:
        indices, batch = split_recorded(batch)
        digest, leaves = leaf_digests(batch)
        self.batches.append({
            "epoch": epoch, "k": k, "digest": digest, "leaves": leaves,
            "indices": None if indices is None else [plain_index(i) for i in indices],
        })


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
    recorder = _Recorder()
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


def run_resume(job: dict[str, Any], built: Built) -> dict[str, Any]:
    loader, epochs, max_batches = built.loader, job["epochs"], job["max_batches"]
    if job["kill_worker"] and loader.num_workers == 0:
        raise UsageError("--kill-worker needs worker processes, and this loader has num_workers=0; drop --kill-worker")
    state = torch.load(job["state_path"], weights_only=True)
    loader.load_state_dict(state)
    start_epoch, start_k = job["start"]
    recorder = _Recorder()
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
        already = start_k if epoch == start_epoch and start_k is not None else 0
        _read_epoch(iterator, epoch, already, max_batches, recorder, maybe_kill)
        del iterator
    return {"batches": recorder.batches, "notes": notes}


def run(job: dict[str, Any]) -> dict[str, Any]:
    try:
        built = build(job["target"])
        built_notes, facts = built.notes, {
            "kind": built.kind, "num_workers": built.loader.num_workers, "recorded": built.recorded,
            "generator": built.loader.generator is not None,
        }
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
