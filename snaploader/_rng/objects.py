"""Generator objects held by a worker's code: found by a bounded walk, snapshotted with
the global RNGs, restored by path.

A dataset, its transforms, ``collate_fn`` and ``worker_init_fn`` (and, searched in the
main process, the sampler: ``_epoch/sampler_rngs.py``) may hold their own
generators (``np.random.default_rng``, ``random.Random``, ``torch.Generator``,
albumentations' per-transform generators). A worker walks that object graph once when
it starts (after ``worker_init_fn``, which may create some) and again at every
``Resume`` (a new epoch makes a new iterator), never per batch. Each generator found is
known by the path it was first reached by (``dataset.transform.transforms[2].py_random``),
which is the same in a fresh process built the same way; a restore matches states to
objects by those paths, and a checkpoint from a different graph is an error that names
the first path that differs.

Per batch, :meth:`ObjectRngs.snapshot` reads every state (raw copies for Mersenne
Twisters) and compares it with the last one read: when nothing moved, the previous
encoding is reused as is. The first snapshot after a discovery carries an
:class:`RngReport` for the main process (:class:`RngCensus`): what was found, what could
not be captured, and, the first time each generator moves, a short hash of its state
at discovery; two workers whose generator started in the same state draw the same
"random" numbers, and the census warns about it once.

The walk is bounded (NOTE [ bounded walk ]): it never enters modules, classes,
functions' globals, tensors, arrays or sets, skips big containers whose first elements
are plain scalars (a list of 10^7 file names costs microseconds), and stops after
``MAX_VISITS`` objects with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from .._errors import CheckpointFormatError, user_stacklevel
from .kinds import KINDS, Access, access_for, encode_entries, encode_header, is_generator, parse

# NOTE [ bounded walk ]
# Worker start must not grow with the data: a dataset holding 10^7 file names, a big
# dict of labels or a pandas frame is mostly scalars. Containers larger than
# _SAMPLE_FROM are looked into only when one of their first _SAMPLE elements is not a
# plain scalar, and the whole walk stops after MAX_VISITS objects.
MAX_VISITS: Final = 100_000
_SAMPLE_FROM: Final = 32
_SAMPLE: Final = 8
_SCALARS: Final = (type(None), bool, int, float, complex, str, bytes)
_LEAVES: Final = (
    *_SCALARS, bytearray, memoryview, range, type, types.ModuleType, types.BuiltinFunctionType,
    types.CodeType, torch.Tensor, torch.dtype, torch.device, np.ndarray, np.generic, np.dtype,
    os.PathLike, set, frozenset,
)

Exclude = Callable[[str, Any], bool] | Iterable[str] | None
ExtraRngs = Callable[[], Any] | None


@dataclass(frozen=True)
class RngReport:
    """A worker's news about its generator objects, sent with a snapshot.

    ``found``: (path, kind) of each generator captured, after a discovery (else None);
    ``moved``: (path, hash of its state at discovery) for each that moved for the first
    time since; ``problems``: warnings to give once (an uncapturable generator, a walk
    cut short)."""

    found: tuple[tuple[str, str], ...] | None
    moved: tuple[tuple[str, bytes], ...]
    problems: tuple[str, ...]


def _excluded(path: str, exclude: Exclude) -> bool:
    if exclude is None or callable(exclude):
        return False
    return any(path == item or path.startswith((item + ".", item + "[")) for item in exclude)


def _children(path: str, obj: Any) -> list[tuple[str, Any]]:
    """The objects ``obj`` holds, with their paths, in a stable order."""
    if isinstance(obj, (list, tuple)):
        if len(obj) > _SAMPLE_FROM and all(isinstance(x, _SCALARS) for x in obj[:_SAMPLE]):
            return []
        return [(f"{path}[{i}]", item) for i, item in enumerate(obj)]
    if isinstance(obj, dict):
        if len(obj) > _SAMPLE_FROM:
            head = [value for _, value in zip(range(_SAMPLE), obj.values())]
            if all(isinstance(value, _SCALARS) for value in head):
                return []
        return [
            (f"{path}[{key!r}]" if isinstance(key, (str, int)) else f"{path}[<key {i}>]", value)
            for i, (key, value) in enumerate(list(obj.items()))
        ]
    if isinstance(obj, functools.partial):
        return [(f"{path}.func", obj.func), (f"{path}.args", obj.args), (f"{path}.keywords", obj.keywords)]
    if isinstance(obj, types.MethodType):
        return [(f"{path}.__self__", obj.__self__), (f"{path}.__func__", obj.__func__)]
    if isinstance(obj, types.FunctionType):
        out: list[tuple[str, Any]] = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                out.append((f"{path}.<closure {name}>", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        if obj.__defaults__:
            out.append((f"{path}.__defaults__", obj.__defaults__))
        if obj.__kwdefaults__:
            out.append((f"{path}.__kwdefaults__", obj.__kwdefaults__))
        return out
    if isinstance(obj, types.GeneratorType):
        frame = obj.gi_frame
        return [] if frame is None else [(f"{path}.<local {k}>", v) for k, v in frame.f_locals.items()]
    out = []
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        out.extend((f"{path}.{name}", value) for name, value in list(attributes.items()))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                out.append((f"{path}.{name}", object.__getattribute__(obj, name)))
            except AttributeError:
                pass
    return out


@dataclass(frozen=True)
class Found:
    path: str
    code: int
    access: Access
    alike: bool = False  # seeded alike in every worker on purpose (see discover)


def discover(
    roots: list[tuple[str, Any]], exclude: Exclude, alike: frozenset[int] = frozenset(),
    known: Iterable[Any] = (),
) -> tuple[list[Found], list[str]]:
    """The generators reachable from ``roots`` in depth-first order, and the problems
    met (uncapturable generators, the walk's bound). ``alike``: ids of generators that
    start alike in every worker on purpose (an IterDataPipe's shuffle, seeded from the
    epoch's shared seed), never reported as started in the same state. ``known``:
    generators whose states the checkpoint carries otherwise (the loader's own), left out."""
    found: list[Found] = []
    problems: list[str] = []
    seen: set[int] = {id(obj) for obj in known}
    stack = list(reversed(roots))
    visits = 0
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, _SCALARS) or id(obj) in seen or _excluded(path, exclude):
            continue
        seen.add(id(obj))
        visits += 1
        if visits > MAX_VISITS:
            problems.append(
                f"snaploader stopped looking for generator objects after {MAX_VISITS} objects "
                f"(at {path}); generators beyond it are not captured and will not resume "
                "exactly. Pass the objects that hold them with DataLoader(rng_objects=...) "
                "or leave big parts out with exclude_rngs=[...]"
            )
            break
        if is_generator(obj):
            if callable(exclude) and exclude(path, obj):
                continue
            answer = access_for(obj)
            if isinstance(answer, str):
                problems.append(
                    f"{path} is {answer}: snaploader cannot capture it, so what it draws "
                    "after a resume will differ. Use a CPU torch.Generator, random.Random or "
                    "a numpy Generator, or exclude it with DataLoader(exclude_rngs=[...]) to "
                    "silence this"
                )
            elif answer is not None:
                code, identity, access = answer
                if identity is not obj and id(identity) in seen:
                    continue  # a Generator over a bit generator already captured
                seen.add(id(identity))
                found.append(Found(path, code, access, id(obj) in alike))
            continue
        if isinstance(obj, _LEAVES):
            continue
        try:
            children = _children(path, obj)
        except Exception:  # an object that does not want to be looked into
            continue
        stack.extend(reversed(children))
    return found, problems


def described(found: list[Found]) -> list[tuple[str, str]]:
    """(path, kind) of each generator found, as ``DataLoader.captured_rngs()`` lists them."""
    return [(entry.path, KINDS[entry.code].name) for entry in found]


def _short_hash(state: bytes) -> bytes:
    return hashlib.blake2b(state, digest_size=8).digest()


class ObjectRngs:
    """The generator objects one worker captures: their paths, states and encoding."""

    def __init__(self, found: list[Found], problems: list[str]) -> None:
        self.paths = [entry.path for entry in found]
        self.codes = [entry.code for entry in found]
        self.access = [entry.access for entry in found]
        self.headers = [encode_header(entry.path, entry.code) for entry in found]
        self.last = [access.read() for access in self.access]
        self.initial = [_short_hash(state) for state in self.last]
        self.moved = [entry.alike for entry in found]  # an alike one is never reported as moved
        self.blob = encode_entries(self.headers, self.last) if found else None
        self.report: RngReport | None = RngReport(tuple(self.kinds()), (), tuple(problems))

    @staticmethod
    def find(
        roots: list[tuple[str, Any]], extra: ExtraRngs, exclude: Exclude, alike: frozenset[int] = frozenset(),
        known: Iterable[Any] = (),
    ) -> ObjectRngs:
        roots = list(roots)
        if extra is not None:
            roots.append(("rng_objects()", extra()))
        return ObjectRngs(*discover(roots, exclude, alike, known))

    def kinds(self) -> list[tuple[str, str]]:
        """(path, kind) of each generator captured."""
        return [(path, KINDS[code].name) for path, code in zip(self.paths, self.codes)]

    def read_all(self) -> list[bytes]:
        return [access.read() for access in self.access]

    def write_all(self, states: list[bytes]) -> None:
        for access, state in zip(self.access, states):
            access.write(state)

    def snapshot(self) -> tuple[bytes | None, RngReport | None]:
        """The encoded states now (the same object as last time when none moved), and
        the report due with it, if any."""
        moved = []
        changed = False
        for i, access in enumerate(self.access):
            state = access.read()
            if state != self.last[i]:
                self.last[i] = state
                changed = True
                if not self.moved[i]:
                    self.moved[i] = True
                    moved.append((self.paths[i], self.initial[i]))
        if changed:
            self.blob = encode_entries(self.headers, self.last)
        report = self.report
        if moved:
            base = report or RngReport(None, (), ())
            report = RngReport(base.found, tuple(moved), base.problems)
        self.report = None
        return self.blob, report

    def restore(self, blob: bytes | None, worker_id: int | str, skip_iterator: bool = False) -> None:
        """Write the states of ``blob`` into the objects found at the same paths;
        :class:`CheckpointFormatError` naming the first path that differs. ``worker_id``:
        the worker's index, or who else holds the objects ("the sampler")."""
        self.write(self.matched(blob, worker_id, skip_iterator))

    def matched(self, blob: bytes | None, worker_id: int | str, skip_iterator: bool = False) -> list[tuple[int, bytes]]:
        """The states of ``blob`` as (index of the object found at the same path, state),
        written by :meth:`write`; :class:`CheckpointFormatError` naming the first path that
        differs, before anything is written."""

        def keep(path: str) -> bool:
            return not (skip_iterator and path.startswith("iterator"))

        if blob is None:
            if any(keep(path) for path in self.paths):
                # A worker that holds generators writes their states into every
                # snapshot: one without them was edited, or comes from other code.
                raise CheckpointFormatError(
                    f"the checkpoint holds no generator-object states for {_who(worker_id)}, "
                    f"but its code holds generators ({', '.join(p for p in self.paths if keep(p))}); "
                    "load the checkpoint taken with this dataset and code"
                )
            return []
        try:
            # A checkpoint's blob was checked by its parse (_format/parse.py); any other
            # was made by this worker's code: split, not checked again.
            records = parse(blob, check=False)
        except ValueError as exc:
            raise CheckpointFormatError(f"the generator-object states for {_who(worker_id)}: {exc}") from None

        saved = [(path, code, state) for path, code, state in records if keep(path)]
        mine = [(i, path, code) for i, (path, code) in enumerate(zip(self.paths, self.codes)) if keep(path)]
        for position in range(max(len(saved), len(mine))):
            theirs = saved[position][:2] if position < len(saved) else None
            ours = mine[position][1:] if position < len(mine) else None
            if theirs != ours:
                raise CheckpointFormatError(_mismatch(worker_id, theirs, ours))
        return [(i, state) for (_, _, state), (i, _, _) in zip(saved, mine)]

    def write(self, states: Iterable[tuple[int, bytes]]) -> None:
        """Write states :meth:`matched` made into the objects found."""
        for i, state in states:
            self.access[i].write(state)


def _describe(entry: tuple[str, int] | None) -> str:
    return "nothing more" if entry is None else f"a {KINDS[entry[1]].name} at {entry[0]}"


def _who(worker_id: int | str) -> str:
    return f"worker {worker_id}" if isinstance(worker_id, int) else worker_id


def _mismatch(worker_id: int | str, theirs: tuple[str, int] | None, ours: tuple[str, int] | None) -> str:
    path = (theirs or ours or ("?", 0))[0]
    holders = "The dataset, its transforms, collate_fn or worker_init_fn hold" if isinstance(worker_id, int) else "The sampler (or batch sampler) holds"
    return (
        f"the checkpoint's generator objects for {_who(worker_id)} differ from this "
        f"loader's at {path}: the checkpoint has {_describe(theirs)}, this loader found "
        f"{_describe(ours)}. {holders} "
        "different generators than when the checkpoint was taken; build them the "
        "same way (and with the same rng_objects/exclude_rngs) to resume"
    )


def check_objects(blob: bytes) -> None:
    """Raise ValueError unless ``blob`` is an encoding :meth:`ObjectRngs.snapshot` made."""
    parse(blob)


class RngCensus:
    """The main process's view of the generator objects its workers captured; gives each
    warning once per loader."""

    def __init__(self, per_sample: bool = False) -> None:
        """``per_sample``: seed_per_sample is on, so workers that start a generator in the
        same state do not draw the same numbers (each sample sets its own state)."""
        self.per_sample = per_sample
        self.found: dict[int, tuple[tuple[str, str], ...]] = {}
        self.starts: dict[str, dict[bytes, int]] = {}
        self.warned: set[str] = set()

    def note(self, slot: int, report: RngReport) -> None:
        if report.found is not None:
            self.found[slot] = report.found
        for problem in report.problems:
            self._warn(problem)
        shared = []
        for path, start in report.moved:
            other = self.starts.setdefault(path, {}).setdefault(start, slot)
            if other != slot:
                shared.append(path)
                pair = (other, slot)
        if shared and not self.per_sample:
            self._warn(
                f"workers {pair[0]} and {pair[1]} both started with {', '.join(shared)} in "
                "the same state, so they draw the same 'random' numbers (the same "
                "augmentations for different samples). Seed it per worker in "
                "worker_init_fn, e.g. from torch.utils.data.get_worker_info().seed"
            )

    def _warn(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())

    def captured(self) -> list[tuple[str, str]]:
        """(path, kind) of every generator any worker reported, first-seen order."""
        out: dict[str, str] = {}
        for slot in sorted(self.found):
            for path, kind in self.found[slot]:
                out.setdefault(path, kind)
        return list(out.items())
