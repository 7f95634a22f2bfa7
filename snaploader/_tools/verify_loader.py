"""``snaploader verify``'s loader: the user's ``MODULE:FACTORY`` imported, and the
snaploader DataLoader built with its arguments, tagged to record sample indices
(``_tools/verify_record.py``), in the loader's own topology or, for a resume into another
one (``--resume-batch-size``/``--resume-workers``), with another batch size or worker count.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.utils.data as torch_data

from .._loader import DataLoader
from .._rebuild import rebuilt
from .verify_record import RecordingCollate, record_indices


class UsageError(Exception):
    """The target, the factory or an option is wrong; the message says how to fix it."""



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


@dataclass(frozen=True)
class Topology:
    """The batch size and worker count a resumed run is rebuilt with (None: the loader's own)."""

    batch_size: int | None = None
    num_workers: int | None = None

    def words(self) -> str:
        parts = [f"batch_size {self.batch_size}" if self.batch_size is not None else "",
                 f"num_workers {self.num_workers}" if self.num_workers is not None else ""]
        return " and ".join(p for p in parts if p)


def rebuild(
    loader: torch_data.DataLoader[Any], dataset: Any, collate_fn: Any, topology: Topology = Topology()
) -> DataLoader:
    """A snaploader DataLoader with ``loader``'s arguments, ``dataset`` and ``collate_fn``,
    and ``topology``'s batch size and worker count where it gives them."""
    changes: dict[str, Any] = {"collate_fn": collate_fn}
    if topology.num_workers is not None:
        changes["num_workers"] = topology.num_workers
    if topology.batch_size is not None and loader.batch_size is not None:
        changes["batch_size"] = topology.batch_size
    return rebuilt(loader, dataset, **changes)


@dataclass
class Built:
    loader: DataLoader
    kind: str  # "map" or "iterable"
    recorded: bool  # sample indices are recorded
    notes: list[str]


def build(target: str, topology: Topology | None = None, *, resumed: bool = False) -> Built:
    """The loader ``target`` makes, rebuilt as snaploader's with sample indices recorded.
    With ``topology``: a UsageError for a loader that cannot be resumed into it and
    compared sample by sample, and, for the ``resumed`` run, rebuilt in it."""
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
    if topology is not None:
        _check_resizable(made, iterable, topology)
    recorded = False
    collate_fn = made.collate_fn
    if not iterable:
        recorded = record_indices(dataset)
        if recorded:
            collate_fn = RecordingCollate(made.collate_fn)
        elif topology is not None:
            raise UsageError(
                f"--resume-batch-size/--resume-workers compare sample indices, and a "
                f"{type(dataset).__qualname__} cannot be given the subclass that records them "
                "(its __class__ cannot be assigned); wrap it in a plain Python Dataset class, "
                "or verify without --resume-batch-size/--resume-workers"
            )
        else:
            notes.append(f"sample indices not recorded: a {type(dataset).__qualname__} cannot be wrapped")
    loader = rebuild(made, dataset, collate_fn, topology if topology is not None and resumed else Topology())
    return Built(loader, "iterable" if iterable else "map", recorded, notes)


def _check_resizable(made: torch_data.DataLoader[Any], iterable: bool, topology: Topology) -> None:
    """What a resume into another topology, compared sample by sample, cannot check."""
    flags = "--resume-batch-size/--resume-workers"
    if iterable:
        raise UsageError(
            f"{flags} need a map-style dataset, and this one is a {type(made.dataset).__qualname__} "
            "(an IterableDataset): a new batch size at resume is map-style only (an iterable's "
            "workers go on where they stood, batching by the new size, so the order of the "
            "samples changes), and its samples have no index to compare. Verify it without "
            f"{flags}"
        )
    if made.batch_sampler is None or made.batch_size is None:
        what = "batch_size=None (no automatic batching)" if made.batch_sampler is None else (
            f"batch_sampler={type(made.batch_sampler).__qualname__}")
        raise UsageError(
            f"{flags} resume into a loader batched by batch_size= (torch's BatchSampler), and "
            f"this one has {what}: its batches are not cut by a batch size, so they cannot be "
            "cut by another one. Build it with batch_size= (and sampler= for the order), or "
            f"verify it without {flags}"
        )
    size = made.batch_size if topology.batch_size is None else topology.batch_size
    workers = made.num_workers if topology.num_workers is None else topology.num_workers
    if (size, workers) == (made.batch_size, made.num_workers):
        # name only the flags given: the other one is the loader's own by default
        given = [f"--resume-batch-size {size}"] * (topology.batch_size is not None)
        given += [f"--resume-workers {workers}"] * (topology.num_workers is not None)
        own = [f"batch_size={made.batch_size}"] * (topology.batch_size is not None)
        own += [f"num_workers={made.num_workers}"] * (topology.num_workers is not None)
        raise UsageError(
            f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} the loader's own "
            f"({', '.join(own)}): nothing changes at resume. Give another value, or drop "
            f"{'it' if len(given) == 1 else 'them'} for the batch-by-batch check"
        )
    if size != made.batch_size and not getattr(made, "in_order", True):
        raise UsageError(
            "the loader has in_order=False, and a checkpoint taken mid-epoch with it cannot "
            "resume into another batch_size (its yielded batches are not the first ones of the "
            "epoch; load_state_dict refuses it). Build it with in_order=True to check this, or "
            "give only --resume-workers"
        )
