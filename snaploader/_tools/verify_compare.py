"""``snaploader verify``: comparing a resumed run with the reference, batch by batch or (a
resume into another topology) sample by sample, and saying which part diverged and
why (see ``_tools/verify.py``'s docstring for the runs it makes).

Sample by sample (``--resume-batch-size N --resume-workers N``). A resume into another batch size yields other batches, so batches cannot be compared;
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
  snaploader does not capture (``NOT_CAPTURED``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final

from .verify_loader import Topology

Position = tuple[int, int | None]  # (epoch, batches consumed); None: the epoch ended


# -- comparing ------------------------------------------------------------------------


def _key(record: dict[str, Any]) -> tuple[int, int]:
    return record["epoch"], record["k"]


def after(batches: list[dict[str, Any]], position: Position) -> list[dict[str, Any]]:
    """The reference batches a run resumed at ``position`` should yield."""
    epoch, k = position
    if k is None:
        return [b for b in batches if b["epoch"] > epoch]
    return [b for b in batches if _key(b) > (epoch, k)]


@dataclass(frozen=True)
class Difference:
    """The first batch where two runs part: what each had there (None: no batch)."""

    index: int  # batches after the cut up to this one, minus one
    expected: dict[str, Any] | None
    got: dict[str, Any] | None

    @property
    def where(self) -> str:
        record = self.expected or self.got
        assert record is not None
        # Records count batches from 1 (k: batches read); messages name a batch by its
        # index from 0, as load_state_dict(skip_to=) and the warnings do.
        return f"epoch {record['epoch']} batch {record['k'] - 1}"

    def describe(self) -> list[str]:
        if self.got is None:
            return [f"{self.where}: the uninterrupted run yielded it, the resumed run had ended"]
        if self.expected is None:
            return [f"{self.where}: the resumed run yielded it, the uninterrupted run had ended"]
        lines = []
        a, b = self.expected["indices"], self.got["indices"]
        if a is not None and b is not None:
            if a == b:
                lines.append(f"sample indices: the same in both runs {short(a)}, so the values differ, not the order")
            else:
                lines.append(f"sample indices: {short(a)} uninterrupted, {short(b)} resumed: the order differs")
        leaves_a, leaves_b = dict(map(tuple, self.expected["leaves"])), dict(map(tuple, self.got["leaves"]))
        if list(leaves_a) == list(leaves_b):
            differing = [p for p in leaves_a if leaves_a[p] != leaves_b[p]]
            same = [p for p in leaves_a if leaves_a[p] == leaves_b[p]]
            text = f"differing parts: {short(differing)}"
            lines.append(text + (f"; identical parts: {short(same)}" if same else ""))
        else:
            lines.append(f"the batch structure differs: {short(list(leaves_a))} vs {short(list(leaves_b))}")
        return lines

    @property
    def where_epoch(self) -> int:
        record = self.expected or self.got
        assert record is not None
        return int(record["epoch"])

    @property
    def order_differs(self) -> bool:
        return bool(self.expected and self.got and self.expected["indices"] is not None
                    and self.expected["indices"] != self.got["indices"])


def short(items: list[Any], limit: int = 6) -> str:
    shown = ", ".join(str(x) for x in items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


def first_difference(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> Difference | None:
    for i, (a, b) in enumerate(zip(expected, got)):
        if _key(a) != _key(b) or a["digest"] != b["digest"]:
            return Difference(i, a, b)
    if len(expected) > len(got):
        return Difference(len(got), expected[len(got)], None)
    if len(got) > len(expected):
        return Difference(len(expected), None, got[len(expected)])
    return None


@dataclass
class CutResult:
    labels: list[str]
    position: Position
    state_path: str
    compared: int = 0  # batches compared, up to the first difference
    got: list[dict[str, Any]] = field(default_factory=list)  # what the resumed run yielded
    difference: Difference | None = None
    error: str | None = None
    notes: tuple[str, ...] = ()
    samples: SampleDifference | None = None  # compared sample by sample (below)
    unchecked: str = ""  # why nothing was compared, where the run goes on (the notes say more)

    @property
    def where(self) -> str:
        epoch, k = self.position
        if k is None:
            return f"epoch {epoch} ended"
        return f"epoch {epoch}, after {k} batch{'es' if k != 1 else ''}"

    @property
    def failed(self) -> bool:
        return self.error is not None or self.difference is not None or self.samples is not None

    @property
    def empty(self) -> bool:
        """Nothing was compared: the run ends at this cut, so it checks nothing."""
        return not self.failed and not self.compared

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "resumed run failed"
        if self.difference is not None:
            return f"DIFFERS from {self.difference.where}"
        if self.samples is not None:
            return self.samples.verdict
        if self.empty:
            return self.unchecked or "nothing to compare: the run ends here"
        return "identical"


def group_cuts(reference: dict[str, Any]) -> list[CutResult]:
    """One resume per distinct position (1, mid and end coincide in a short epoch)."""
    by_position: dict[Position, CutResult] = {}
    for label, saved in reference["saved"].items():
        position = (saved["epoch"], saved["k"])
        if position in by_position:
            by_position[position].labels.append(label)
        else:
            by_position[position] = CutResult([label], position, saved["path"])
    return list(by_position.values())


# -- the diagnosis --------------------------------------------------------------------

_NONDETERMINISTIC: Final = (
    "not a resume problem: the pipeline is nondeterministic. Two uninterrupted runs in "
    "fresh processes, with the same PYTHONHASHSEED, differ from each other (first at {where}). "
    "Something draws from time, OS entropy or thread timing (time.time_ns(), os.urandom, an "
    "unseeded random.Random() or np.random.default_rng()). No checkpoint can resume that: seed "
    "it from the worker's seed (torch.initial_seed() inside a worker), or draw from Python's "
    "random, numpy.random or torch's global RNG, which snaploader seeds and captures."
)
_HASH_SEED: Final = (
    "not a resume problem: the pipeline depends on Python's hash seed. Uninterrupted runs "
    "with PYTHONHASHSEED=0 agree with each other and differ from one with PYTHONHASHSEED=1 "
    "(first at {where}): something uses hash() of a str or bytes, or iterates a set of them. "
    "Sort it, use a stable hash (zlib.crc32, hashlib), or set PYTHONHASHSEED to the same "
    "value for training and resume."
)
_RESUMED_AGREE: Final = "a second uninterrupted run and the resumed runs agree with each other"
_RERUNS_AGREE: Final = "uninterrupted runs made now agree with each other, whatever the hash seed,"
_DATA_CHANGED: Final = (
    "the data changed while verify ran: {evidence} but differ from the first run (first at "
    "{where}{same_indices}), with or without a resume. Something "
    "the dataset reads (files, a database, a global another process or run changes) is not "
    "the same as before, so resume cannot be judged against it. Verify again once the data "
    "stays put."
)
# ORDER_DIFFERS, NOT_CAPTURED and RESUME_FAILED are the sample comparison's wording too.
ORDER_DIFFERS: Final = (
    "the sample order after resume differs, and the pipeline is deterministic (two "
    "uninterrupted runs in fresh processes agree). snaploader restores the built-in samplers "
    "and any sampler with state_dict()/load_state_dict(); a custom sampler or batch_sampler "
    "that draws from anything else (Python's random in the main process, a generator of its "
    "own) is not captured. Give it state_dict()/load_state_dict(), or have it draw from the "
    "loader's generator."
)
NOT_CAPTURED: Final = (
    "randomness or state that snaploader does not capture: the pipeline is deterministic "
    "(two uninterrupted runs in fresh processes, with different hash seeds, agree){order}, "
    "yet after resume the "
    "values differ. The workers draw from something snaploader does not reach, or keep a "
    "position of their own: a generator in a global of another module, one created inside "
    "__getitem__, a C extension's own RNG{iterator}. Keep the generator on the dataset (or "
    "pass it with DataLoader(rng_objects=...)), draw from the global RNGs, or give the "
    "dataset (or its iterator) state_dict()/load_state_dict() that saves and restores that "
    "state; loader.captured_rngs() lists what is captured."
)
_NO_GENERATOR: Final = (
    " Here the loader has no generator=, so its sample order and worker seeds come from "
    "torch's global RNG, which torch seeds from OS entropy in every new process: pass "
    "generator=torch.Generator().manual_seed(SEED)."
)
_NO_GENERATOR_LATER: Final = (
    "the loader has no generator=, and the difference starts in an epoch after the cut: "
    "after a restore, later epochs draw their order and worker seeds from torch's global "
    "RNG of the new process, as in torch. Pass generator=torch.Generator().manual_seed(SEED), "
    "or save and restore torch.get_rng_state() with the checkpoint. Otherwise: "
)
RESUME_FAILED: Final = (
    "a resumed run failed where the uninterrupted run did not: the loader the factory builds "
    "in a new process cannot take the checkpoint, or the pipeline fails after a restore. The "
    "error is shown above."
)


def rerun_job(state_dir: str) -> dict[str, Any]:
    """The job of an uninterrupted rerun (``_tools/verify_child.py``) that saves nothing."""
    return {"mode": "reference", "cuts": [], "strict_cuts": False, "state_dir": state_dir,
            "kill_worker": False}


def _agree_now(rerun: dict[str, Any], cuts: list[CutResult]) -> bool:
    """The resumed runs yielded what the second uninterrupted run did, at the same
    positions (at least one batch): the pipeline is consistent now, whatever the hash
    seed and across a resume; only the first run stands apart."""
    resumed = [c for c in cuts if c.got]
    return bool(resumed) and all(
        first_difference(after(rerun["batches"], c.position), c.got) is None for c in resumed
    )


def _indices_note(changed: Difference) -> str:
    if not (changed.expected and changed.got and changed.expected["indices"] is not None):
        return ""
    return ", with other sample indices" if changed.order_differs else ", with the same sample indices"


def diagnose_source(
    reference: dict[str, Any], rerun: dict[str, Any], cuts: list[CutResult],
    run_again: Callable[[str], dict[str, Any]], step: Callable[[str], None], pool: ThreadPoolExecutor,
) -> str:
    """Where a difference comes from. ``rerun`` is a second uninterrupted run (made
    beside the resumed runs, with PYTHONHASHSEED=0); when it differs from the first,
    two more (``run_again(hash_seed)``, run on ``pool``) tell nondeterminism, hash-seed
    dependence and changed data apart. ``step`` reports progress."""
    if not rerun["ok"]:
        return f"an uninterrupted rerun failed, where the first did not:\n{rerun['error']['message']}"
    changed = first_difference(reference["batches"], rerun["batches"])
    if changed is not None and _agree_now(rerun, cuts):
        return _DATA_CHANGED.format(where=changed.where, same_indices=_indices_note(changed),
                                    evidence=_RESUMED_AGREE)
    if changed is not None:
        step("diagnosis: two more uninterrupted runs (PYTHONHASHSEED=0 and 1)")
        same_seed, other_seed = pool.map(run_again, ["0", "1"])
        for run in (same_seed, other_seed):
            if not run["ok"]:
                return f"an uninterrupted rerun failed, where the first did not:\n{run['error']['message']}"
        drift = first_difference(rerun["batches"], same_seed["batches"])
        if drift is not None:
            return _NONDETERMINISTIC.format(where=drift.where) + ("" if reference["generator"] else _NO_GENERATOR)
        hashed = first_difference(rerun["batches"], other_seed["batches"])
        if hashed is not None:
            return _HASH_SEED.format(where=hashed.where)
        return _DATA_CHANGED.format(where=changed.where, same_indices=_indices_note(changed),
                                    evidence=_RERUNS_AGREE)
    if all(c.difference is None for c in cuts):
        return RESUME_FAILED
    if any(c.difference is not None and c.difference.order_differs for c in cuts):
        return ORDER_DIFFERS
    recorded = any(c.difference is not None and c.difference.expected is not None
                   and c.difference.expected["indices"] is not None for c in cuts)
    later = any(c.difference is not None and c.difference.where_epoch > c.position[0] for c in cuts)
    hint = _NO_GENERATOR_LATER if later and not reference["generator"] else ""
    return hint + NOT_CAPTURED.format(
        order=" and the resumed run asks for the same samples" if recorded else "",
        iterator=", or an iterator's position (an iterable dataset restarted at its beginning)"
        if reference["kind"] == "iterable" else "",
    )


# -- sample by sample: a resume into another topology ------------------------------


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

