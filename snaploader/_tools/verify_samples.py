"""``snaploader verify --resume-batch-size N --resume-workers N``: each cut resumed into
another topology, compared sample by sample.

A resume into another batch size yields other batches, so batches cannot be compared;
what must stay is the stream of *samples*. The child runs cut every batch into its
samples (``sample_digests`` in ``_tools/verify_record.py``: dim 0 of each tensor or
array, per key, per field), each with its sample index, so nothing here depends on where
the batches were cut:

- **positions**: sample p of epoch e is the p-th sample the epoch yields, in both runs
  (the resumed run's count starts at the samples the reference yielded before the cut).
- **how much the resumed run reads** (``plan``): an epoch the reference read to its end
  is read to its end; one it abandoned after ``--max-batches`` is read until it holds as
  many samples as the reference's after the cut (then abandoned, as the reference did).
  The next epochs start afresh in the new topology, with the new batch size.
- **comparing**: the indices first (a difference is lost, repeated or reordered samples:
  an order failure), then the digests of samples with the same index (values). An epoch
  the reference ended holds as many samples after the cut in both runs; with
  ``drop_last=True`` and another batch size, the resumed epoch holds the sampler items
  left, cut to a multiple of the new batch size, and samples the reference dropped are
  counted, not compared.
- **the diagnosis** (when the second uninterrupted run matched the first): order ->
  state snaploader does not capture (a sampler's); values without ``seed_per_sample``,
  where the new topology changes the draws (any new batch size; a new worker count from
  the next epoch on) -> expected, use ``seed_per_sample=True``; else -> randomness
  snaploader does not capture (``_tools/verify_diagnose.py``'s wording).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from .verify_diagnose import NOT_CAPTURED, ORDER_DIFFERS, RESUME_FAILED, CutResult, short, after
from .verify_loader import Topology


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume-batch-size", type=at_least(1), default=None, metavar="N",
                        help="resume each cut into a loader with this batch_size and compare sample by sample")
    parser.add_argument("--resume-workers", type=at_least(0), default=None, metavar="N",
                        help="resume each cut into a loader with this num_workers and compare sample by sample")


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number, ``least`` or more."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} should be {least} or more")
        return value
    return parse


def topology_from(args: argparse.Namespace) -> Topology | None:
    if args.resume_batch_size is None and args.resume_workers is None:
        return None
    return Topology(args.resume_batch_size, args.resume_workers)


@dataclass(frozen=True)
class Sample:
    epoch: int
    position: int  # in the epoch, from 0, the same in both runs
    index: Any
    digest: str
    leaves: list[tuple[str, str]]
    batch: int  # the batch of its run it came in, from 0 (in the resumed run: after the cut)


def _samples(batches: list[dict[str, Any]], offsets: dict[int, int]) -> dict[int, list[Sample]]:
    """The samples of ``batches`` per epoch; an epoch's first one at ``offsets[epoch]``."""
    found: dict[int, list[Sample]] = {}
    for record in batches:
        epoch = record["epoch"]
        rows = found.setdefault(epoch, [])
        for index, (digest, leaves) in zip(record["indices"], record["samples"]):
            rows.append(Sample(epoch, offsets.get(epoch, 0) + len(rows), index, digest,
                               [tuple(leaf) for leaf in leaves], record["k"] - 1))
    return found


def _before_cut(reference: dict[str, Any], cut: CutResult) -> dict[int, int]:
    epoch, k = cut.position
    if k is None:
        return {}
    return {epoch: sum(len(b["indices"]) for b in reference["batches"] if b["epoch"] == epoch and b["k"] <= k)}


def _logical(reference: dict[str, Any], topology: Topology) -> int:
    """The resumed loader's logical worker count (``_tools/verify_loader.py``'s rebuild:
    the default follows ``num_workers``, another value is kept)."""
    if reference["logical_workers"] != reference["num_workers"] or topology.num_workers is None:
        return int(reference["logical_workers"])
    return topology.num_workers


def _epochs(reference: dict[str, Any], cut: CutResult, topology: Topology) -> tuple[range, str]:
    """The epochs compared after ``cut``, and why the later ones are not ("": all are)."""
    first = cut.position[0] + (cut.position[1] is None)
    ended = reference["ended"]
    other_count = topology.num_workers == 0 or _logical(reference, topology) != reference["logical_workers"]
    if reference["persistent_workers"] and other_count and cut.position[0] + 1 < len(ended):
        # The interrupted epoch is exact. Persistent workers carry their states into the
        # next epoch, and a base seed drawn once; workers of another count cannot, so the
        # resumed loader's next epoch starts as a new loader's: another stream.
        return range(first, cut.position[0] + 1), (
            "the loader has persistent workers, and the resumed one "
            f"has {'none (num_workers=0)' if topology.num_workers == 0 else 'another worker count'}, "
            "so its epochs after the interrupted one start as a new loader's (which draws a base "
            "seed each epoch, where persistent workers drew one once): another stream "
            "(docs/elastic.md)")
    # Where an epoch left part-way leaves the loader's generator depends on how many
    # sampler items were pulled (torch's RandomSampler draws a new permutation when it
    # runs out), which the batch size and the prefetching change: so does the order of
    # the epoch after it, in torch as here. After a whole epoch it does not.
    last = next((e for e in range(first, len(ended)) if not ended[e]), len(ended) - 1)
    return range(first, last + 1), "" if last == len(ended) - 1 else (
        f"the uninterrupted run left epoch {last} after --max-batches, and the order of the epoch "
        "after one left part-way depends on how many sampler items were pulled (torch's "
        "RandomSampler draws anew when it runs out), which the batch size and the worker count "
        "change; raise --max-batches to read whole epochs")


def plan(reference: dict[str, Any], cut: CutResult, topology: Topology) -> list[dict[str, Any]]:
    """How much of each epoch from the cut on the resumed run reads."""
    old = reference["batch_size"]
    new = topology.batch_size or old
    expected = _samples(after(reference["batches"], cut.position), _before_cut(reference, cut))
    steps = []
    for epoch in _epochs(reference, cut, topology)[0]:
        count = len(expected.get(epoch, []))
        # Batches are named as snaploader names them: an epoch resumed with another batch
        # size goes on as an epoch part, whose batch 0 is the first new batch.
        first_k = (cut.position[1] or 0) if epoch == cut.position[0] and new == old else 0
        steps.append({"epoch": epoch, "want": None if reference["ended"][epoch] else count,
                      "cap": -(-(count + old) // new) + 1, "first_k": first_k})
    return steps


@dataclass(frozen=True)
class SampleDifference:
    """The first sample where the resumed run parts from the reference."""

    kind: str  # "order" (indices or counts) or "values"
    epoch: int
    position: int
    expected: Sample | None
    got: Sample | None
    detail: str = ""  # for a count: what each run yielded
    # Without per-sample seeds the new topology draws other augmentations here.
    topology_draws: bool = False

    @property
    def verdict(self) -> str:
        if self.kind == "values":
            return f"VALUES DIFFER from epoch {self.epoch} sample {self.position}"
        return f"ORDER DIFFERS from epoch {self.epoch} sample {self.position}"

    def describe(self) -> list[str]:
        where = f"epoch {self.epoch} sample {self.position} (counted from 0 in the epoch)"
        if self.detail:
            return [f"first difference at {where}: {self.detail}"]
        a, b = self.expected, self.got
        assert a is not None and b is not None
        if self.kind == "order":
            return [f"first difference at {where}: index {a.index} uninterrupted (its batch {a.batch}), "
                    f"{b.index} resumed: samples lost, repeated or reordered"]
        parts_a, parts_b = dict(a.leaves), dict(b.leaves)
        lines = [f"first difference at {where}: index {a.index} in both runs, so the values differ, not the order"]
        if list(parts_a) == list(parts_b):
            same = [p for p in parts_a if parts_a[p] == parts_b[p]]
            lines.append(f"differing parts: {short([p for p in parts_a if parts_a[p] != parts_b[p]])}"
                         + (f"; identical parts: {short(same)}" if same else ""))
        else:
            lines.append(f"the sample structure differs: {short(list(parts_a))} vs {short(list(parts_b))}")
        return lines


def compare(reference: dict[str, Any], cut: CutResult, got: dict[str, Any], topology: Topology) -> None:
    """Set ``cut``'s compared count and first difference from the resumed run ``got``."""
    offsets = _before_cut(reference, cut)
    expected = _samples(after(reference["batches"], cut.position), offsets)
    resumed = _samples(got["batches"], offsets)
    old, drop_last, items = reference["batch_size"], reference["drop_last"], reference["items"]
    new = topology.batch_size or old
    # Draws follow the topology without per-sample seeds: in every batch of a new batch
    # size, and from the next epoch on with a new logical worker count.
    changed_from = cut.position[0] if new != old else (
        cut.position[0] + 1 if _logical(reference, topology) != reference["logical_workers"] else None)
    compared = 0
    values: SampleDifference | None = None
    epochs, why = _epochs(reference, cut, topology)
    if why:
        after_epoch = f"after epoch {epochs.stop - 1}" if epochs else f"from epoch {epochs.start} on"
        cut.notes += (f"cut {','.join(cut.labels)}: epochs {after_epoch} not compared: {why}",)
    for epoch in epochs:
        want, have = expected.get(epoch, []), resumed.get(epoch, [])
        for a, b in zip(want, have):
            if a.index != b.index:
                cut.samples, cut.compared = SampleDifference("order", epoch, a.position, a, b), compared + 1
                return
            if values is None and a.digest != b.digest:
                later = changed_from is not None and epoch >= changed_from
                values = SampleDifference("values", epoch, a.position, a, b, topology_draws=later)
            compared += values is None
        start = offsets.get(epoch, 0)
        if not reference["ended"][epoch]:
            # Abandoned after --max-batches: the resumed run reads at least as far.
            target, because, short = len(want), "", len(have) < len(want)
        elif drop_last and new != old:
            # The sampler's items left, cut into whole batches of the new size.
            target = len(have) if items is None else (items - start) // new * new
            because = f"batches of {new} with drop_last=True leave {target}"
            short = len(have) != target
        else:
            target, because = len(want), "every one the epoch had left"
            short = len(have) != target
        if short:
            detail = (f"the resumed run yielded {len(have)} samples of epoch {epoch} after the cut, "
                      f"the uninterrupted run {len(want)}{f' ({because})' if because else ''}: samples "
                      f"{'lost' if len(have) < target else 'repeated'}")
            position = start + min(len(have), len(want))
            cut.samples, cut.compared = SampleDifference("order", epoch, position, None, None, detail), compared + 1
            return
        if reference["ended"][epoch] and len(have) != len(want):
            more = len(have) > len(want)
            cut.notes += (f"cut {','.join(cut.labels)}: epoch {epoch}: drop_last=True at batch size {new} "
                          f"{'reads' if more else 'drops'} {abs(len(have) - len(want))} sample(s) that at "
                          f"batch size {old} it {'dropped' if more else 'read'}; not compared",)
    cut.samples, cut.compared = values, compared + (values is not None)
    if why and not cut.compared:
        cut.unchecked = "nothing compared (see the notes)"


_TOPOLOGY_DRAWS: Final = (
    "order exact, values differ: after a resume into {into} every sample comes in the "
    "interrupted run's order, none lost or repeated, but their values differ{where}. Without "
    "per-sample seeds this is expected: the random draws inside workers follow the "
    "topology ({why}). Build the loader with "
    "seed_per_sample=True to make every sample bit for bit the interrupted run's in any "
    "batch size and worker count (docs/elastic.md){logical}."
)
_PER_SAMPLE_NOT_CAPTURED: Final = (
    "the loader has seed_per_sample=True, so every sample should be bit for bit the "
    "interrupted run's in any batch size and worker count{collate}. Otherwise: "
)


def diagnose(reference: dict[str, Any], cuts: list[CutResult], topology: Topology) -> str:
    """Where a difference comes from, the pipeline being deterministic (the second
    uninterrupted run matched the first)."""
    if any(c.error is not None for c in cuts):
        return RESUME_FAILED
    found = [c.samples for c in cuts if c.samples is not None]
    if any(d.kind == "order" for d in found):
        return ORDER_DIFFERS
    not_captured = NOT_CAPTURED.format(order=" and the resumed run reads the same samples", iterator="")
    if reference["seed_per_sample"]:
        collate = (": only draws made in collate_fn (seeded per batch) follow the batch size; move "
                   "them into the dataset" if topology.batch_size not in (None, reference["batch_size"]) else "")
        return _PER_SAMPLE_NOT_CAPTURED.format(collate=collate) + not_captured
    if all(d.topology_draws for d in found):
        first = min(found, key=lambda d: (d.epoch, d.position))
        if topology.batch_size not in (None, reference["batch_size"]):
            logical, why = "", (
                "each logical worker goes on from its snapshot, drawing for other samples than "
                "before, and the epochs after the resumed one are the new batch size's stream")
        else:
            logical = (f", or build it with logical_workers={reference['logical_workers']} to keep "
                       "the interrupted run's worker count for good")
            why = ("the interrupted epoch is exact, its logical workers kept, but the epochs after "
                   "it are the new worker count's stream: batch k goes to worker k mod the new count")
        return _TOPOLOGY_DRAWS.format(into=topology.words(), logical=logical, why=why,
                                      where=f" (first at epoch {first.epoch} sample {first.position})")
    return not_captured


def summary(cuts: list[CutResult], topology: Topology) -> str:
    checked = [c for c in cuts if not c.empty]
    return (f"resumes exactly into {topology.words()}: {sum(c.compared for c in checked)} samples "
            f"compared after {len(checked)} cut{'s' if len(checked) != 1 else ''}, every one identical "
            "to the uninterrupted run's, in the same order; a second uninterrupted run in a fresh "
            "process is identical too.")

