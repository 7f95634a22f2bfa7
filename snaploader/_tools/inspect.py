"""``snaploader inspect CKPT``: what a checkpoint file holds about a loader.

The file is read with ``torch.load(weights_only=True)``, so inspecting an untrusted
checkpoint runs no code. A loader state is found at the top level, under ``--key`` (a
dotted path; list items by number: ``loaders.0``), or by its format marker
(``state["format"] == "snaploader"``) anywhere in nested dicts and lists.

:func:`summarize` reads the checkpoint through the loader's own parse
(``_format/parse.py``), so inspect and ``load_state_dict`` agree on what is valid;
everything else here prints what it returns. Every problem is one line on stderr and
exit status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import zipfile
from collections.abc import Iterator, Sequence
from typing import Any, Final, TextIO

import torch

from .._errors import CheckpointFormatError
from .._format.consumed import consumed_of
from .._format.checkpoint import FORMAT, READABLE_VERSIONS, Checkpoint
from .._format.plain import MAX_DEPTH, check_depth
from .._format.parse import parse
from .._state.ledger import WorkerLedger
from ..mixture.mixture import consumed_by_source

_RNG_NAMES: Final = ("python random", "numpy", "torch")


class InspectError(Exception):
    """The file, the key or the state cannot be shown; the message says what to do."""


# -- what a parsed checkpoint says ------------------------------------------------------


def _worker(slot: int, ledger: WorkerLedger) -> dict[str, Any]:
    yielded, complete = ledger.yielded, ledger.yielded_complete
    at = yielded if yielded is not None else ledger.epoch_start
    replay = 0
    if yielded is not None and not yielded.complete and not yielded.exhausted:
        replay = yielded.produced - (complete.produced if complete is not None else 0)
    # The first byte of the RNG bytes flags the generators still at their seed state
    # (bit 0 Python's random, bit 1 NumPy, bit 2 torch); no snapshot yet: all at it.
    flags = 0b111 if at is None or not isinstance(at.rng, bytes) else at.rng[0]
    return {
        "worker": slot,
        "batches_produced": 0 if yielded is None else yielded.produced,
        "exhausted": ledger.exhausted,
        "data_state": None if at is None or at.data is None else at.data_owner,
        "replay_batches": replay,
        "rng_moved": [name for bit, name in enumerate(_RNG_NAMES) if not flags & (1 << bit)],
    }


def _parsed(state: dict[str, Any]) -> tuple[Checkpoint, str]:
    """The state parsed, and its integrity: an edit that leaves every field valid is
    shown, marked; anything else is an :class:`InspectError`."""
    version = state.get("version")
    if version not in READABLE_VERSIONS:
        raise InspectError(
            f"this loader state has format version {version!r:.20}; this snaploader reads "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}. Inspect it with the "
            "snaploader release that wrote it"
        )
    try:
        return parse(state), "digest matches, fields valid"
    except CheckpointFormatError as exc:
        problem = str(exc)
    try:
        return parse(state, verify_digest=False), f"INVALID: {problem}"
    except CheckpointFormatError as exc:
        more = "" if str(exc) == problem else f"; {exc}"
        raise InspectError(
            f"this loader state (version {version}) is malformed: {problem}{more}. It was "
            "edited or not written by snaploader's DataLoader.state_dict()"
        ) from None


def summarize(state: dict[str, Any]) -> dict[str, Any]:
    """What a person (or a script) wants to know about a loader state: plain data,
    read from the parsed checkpoint (``_format/parse.py``).

    Keys: format, version, fingerprint (the arguments it was taken with), epoch,
    batches_consumed, epoch_ended, next (what the next ``iter()`` does), rng_kind,
    base_seed, sampler_state (held or not), workers (per worker: batches_produced,
    exhausted, data_state (None, "dataset" or "iterator": whose ``state_dict()`` is
    held), replay_batches (read again on resume), rng_moved (global RNGs no longer in
    their seed state)), integrity, self_check_batches, logical_workers. Raises
    :class:`InspectError` for a version it cannot read or a malformed state."""
    checkpoint, integrity = _parsed(state)
    epoch, ended, yielded = checkpoint.epoch, checkpoint.ended, checkpoint.yielded
    if epoch < 0:
        next_step = "the next iter() starts epoch 0"
    elif ended:
        next_step = f"the next iter() starts epoch {epoch + 1}"
    else:
        # batch indices count from 0, as load_state_dict(skip_to=) takes them
        next_step = f"the next iter() continues epoch {epoch} at batch {yielded}"
    return {
        "format": FORMAT,
        "version": checkpoint.version,
        "fingerprint": dict(checkpoint.fingerprint),
        "epoch": epoch,
        "batches_consumed": yielded,
        "epoch_ended": ended,
        "next": next_step,
        "rng_kind": checkpoint.rng_kind,
        "base_seed": checkpoint.base_seed,
        "sampler_state": checkpoint.sampler_state is not None,
        "workers": [_worker(i, ledger) for i, ledger in enumerate(checkpoint.workers)],
        "integrity": integrity,
        "self_check_batches": sum(entry is not None for entry in checkpoint.next_batches),
        "logical_workers": checkpoint.logical_workers,
    }


# -- finding loader states in a checkpoint ----------------------------------------------


def _is_state(value: Any) -> bool:
    return isinstance(value, dict) and value.get("format") == FORMAT


def find_states(value: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted key path, loader state) for every loader state in ``value``, in order.
    Iterative, and no deeper than a checkpoint nests (NOTE [ checkpoint limits ])."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if _is_state(item):
            yield path, item
            continue
        if depth > MAX_DEPTH:
            raise InspectError(
                f"the file nests dicts and lists more than {MAX_DEPTH} deep at "
                f"{path[:60]}...; it holds no loader state snaploader wrote there"
            )
        if isinstance(item, dict):
            children: list[tuple[Any, Any]] = list(item.items())
        elif isinstance(item, (list, tuple)):
            children = list(enumerate(item))
        else:
            continue
        for key, child in reversed(children):
            stack.append((f"{path}.{key}" if path else str(key), child, depth + 1))


def follow(value: Any, key: str) -> Any:
    """``value`` at the dotted path ``key`` (numbers index lists)."""
    here: Any = value
    walked: list[str] = []
    for part in key.split("."):
        if isinstance(here, dict):
            matches = [k for k in here if str(k) == part]
            if not matches:
                shown = ", ".join(repr(str(k)) for k in list(here)[:12])
                where = ".".join(walked) or "the top level"
                raise InspectError(f"--key {key}: no {part!r} at {where}; the keys there are {shown}")
            here = here[matches[0]]
        elif isinstance(here, (list, tuple)) and part.isdigit() and int(part) < len(here):
            here = here[int(part)]
        else:
            where = ".".join(walked) or "the top level"
            raise InspectError(
                f"--key {key}: {where} is a {type(here).__name__}"
                + (f" of {len(here)} items" if isinstance(here, (list, tuple)) else "")
                + f", which has no {part!r}"
            )
        walked.append(part)
    return here


def size_bytes(state: dict[str, Any]) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


def load(path: str) -> Any:
    if os.path.isdir(path):
        raise InspectError(f"{path} is a folder; give the checkpoint file")
    if not os.path.exists(path):
        raise InspectError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as file:
            legacy = file.read(1) == b"\x80"  # torch.save's old, pickle-first format
        if not legacy:
            raise InspectError(f"{path} was not written by torch.save (it is no zip archive); give a checkpoint file")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        refused = [line.strip() for line in lines if "Unsupported global" in line]
        if refused:
            raise InspectError(
                f"{path} holds objects that torch.load(weights_only=True) refuses to build "
                f"({refused[0]:.200}); inspect runs no code from a checkpoint. Save the "
                "loader state with the rest as plain data (loader.state_dict() always is)"
            ) from None
        raise InspectError(f"{path} could not be read with torch.load(weights_only=True): {lines[0]:.300}") from None


def consumed(state: dict[str, Any]) -> dict[str, Any]:
    """What the state's epoch has consumed (``_format/consumed.py``), a Mixture's
    per-source ledger included, as ``loader.consumed()`` gives it."""
    checkpoint, _ = _parsed(state)
    by_source = consumed_by_source if checkpoint.fingerprint["sampler"] == "MixtureSampler" else None
    try:
        return consumed_of(checkpoint, by_source)
    except CheckpointFormatError as exc:
        raise InspectError(f"the loader state's Mixture sampler state is malformed: {exc}") from None


def inspect(path: str, key: str | None, with_consumed: bool = False) -> list[dict[str, Any]]:
    """One entry per loader state found: {key, size_bytes, **summarize(state)}, and
    ``consumed`` (:func:`consumed`) when asked."""
    checkpoint = load(path)
    if key:
        found = follow(checkpoint, key)
        if not _is_state(found):
            raise InspectError(
                f"--key {key} holds a {type(found).__name__}, not a snaploader loader state "
                "(a dict whose 'format' is 'snaploader'); omit --key to search the whole file"
            )
        states = [(key, found)]
    else:
        states = list(find_states(checkpoint))
    if not states:
        top = ""
        if isinstance(checkpoint, dict):
            top = f" (its top-level keys: {', '.join(repr(str(k)) for k in list(checkpoint)[:12])})"
        raise InspectError(
            f"{path} holds no snaploader loader state{top}: no dict whose 'format' is "
            "'snaploader' anywhere in it. Save loader.state_dict() in the checkpoint"
        )
    entries = []
    for where, state in states:
        try:
            check_depth(state)
        except CheckpointFormatError as exc:
            raise InspectError(str(exc)) from None
        entry = {"key": where, "size_bytes": size_bytes(state), **summarize(state)}
        if with_consumed:
            entry["consumed"] = consumed(state)
        entries.append(entry)
    return entries


# -- printing -------------------------------------------------------------------------


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def render(entry: dict[str, Any]) -> list[str]:
    f = entry["fingerprint"]
    key = entry["key"] or "(top level)"
    length = "unknown length" if f.get("dataset_length") is None else f"{f['dataset_length']} items"
    lines = [
        f"loader state at {key}: format {entry['format']} version {entry['version']}, "
        f"{entry['size_bytes']:,} bytes when torch.save'd",
        f"  taken from   {f.get('dataset_kind')}-style dataset ({length}), batch_size {f.get('batch_size')}, "
        f"num_workers {f.get('num_workers')}, drop_last {f.get('drop_last')},",
        f"               sampler {f.get('sampler')}, batch_sampler {f.get('batch_sampler')}, "
        f"persistent_workers {f.get('persistent_workers')}, generator {f.get('generator')}",
    ]
    if entry["epoch"] < 0:
        lines.append("  position     no epoch started yet")
    else:
        lines.append(
            f"  position     epoch {entry['epoch']}, {entry['batches_consumed']} batches consumed, "
            f"epoch {'ended' if entry['epoch_ended'] else 'not ended'}: {entry['next']}"
        )
    if "integrity" in entry:
        # only an older release's checkpoint holds prefetched batches' digests
        held = entry["self_check_batches"]
        lines.append(f"  integrity    {entry['integrity']}" + (f"; self-check digests of {held} prefetched batch(es)" if held else ""))
    source = "the loader's generator" if entry["rng_kind"] == "generator" else "torch's global RNG"
    lines.append(
        f"  sampling     drawn from {source}; worker base seed {entry['base_seed']}; "
        f"sampler state {'held' if entry['sampler_state'] else 'none (built-in sampler)'}"
    )
    if entry["workers"]:
        rows = [("worker", "batches produced", "exhausted", "dataset state", "replays", "RNGs moved from seed")]
        for w in entry["workers"]:
            rows.append((
                str(w["worker"]), str(w["batches_produced"]), _yes(w["exhausted"]),
                f"held ({w['data_state']})" if w["data_state"] else "none",
                str(w["replay_batches"]), ", ".join(w["rng_moved"]) or "none",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines.append("  workers")
        for row in rows:
            cells = [f"{cell:<{width}}" for cell, width in zip(row, widths)]
            lines.append("    " + "  ".join(cells + [row[-1]]))
    if "consumed" in entry:
        lines += _render_consumed(entry["consumed"])
    return lines


def _shown(items: list[int], most: int = 12) -> str:
    head = ", ".join(map(str, items[:most]))
    return f"[{head}{', ...' if len(items) > most else ''}]"


def _render_consumed(done: dict[str, Any]) -> list[str]:
    lines = [f"  consumed     epoch {done['epoch']}: {done['batches']} batches behind the position "
             f"({done['skipped']} of them skipped)"]
    if done["indices"] is not None:
        lines.append(f"               indices ({len(done['indices'])}): {_shown(done['indices'])}")
    else:
        lines.append(f"               indices not rebuilt: {done['indices_unknown']}")
    for name, source in (done["sources"] or {}).items():
        passes = "; ".join(f"pass {p}: {len(items)} items {_shown(items, 6)}" for p, items in source["passes"].items())
        lines.append(f"               source {name}: {source['samples']} samples; {passes}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="a file written by torch.save")
    parser.add_argument("--key", default=None,
                        help="dotted path of the loader state in the checkpoint (e.g. loader, "
                             "state.loaders.0); by default every loader state in the file is shown")
    parser.add_argument("--json", action="store_true", help="print JSON, for scripts")
    parser.add_argument("--consumed", action="store_true",
                        help="also what the epoch consumed: the dataset indices behind the position, and a "
                             "Mixture's items per source and pass (JSON: in full)")


def run_parsed(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        entries = inspect(args.checkpoint, args.key, args.consumed)
    except InspectError as exc:
        print(f"snaploader inspect: {' '.join(str(exc).split())}", file=err)
        return 2
    try:
        if args.json:
            print(json.dumps({"file": args.checkpoint, "states": entries}, indent=2), file=out)
            return _status(entries)
        for i, entry in enumerate(entries):
            if i:
                print("", file=out)
            for line in render(entry):
                print(line, file=out)
        out.flush()
    except BrokenPipeError:
        # The reader (``| head``) has what it wanted; the interpreter's own flush at
        # exit must not write into the closed pipe either.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return _status(entries)


def _status(entries: list[dict[str, Any]]) -> int:
    """The exit status (docs/verify.md, "snaploader inspect"): 0 when every loader state
    shown is intact, 1 when one is not (its integrity INVALID), so that a script can
    validate a checkpoint by it; 2 (above) when no state could be read at all."""
    return 1 if any(str(entry.get("integrity", "")).startswith("INVALID") for entry in entries) else 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="snaploader inspect", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_parsed(parser.parse_args(argv), out or sys.stdout, err or sys.stderr)
