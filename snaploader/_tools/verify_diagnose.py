"""``snaploader verify``: comparing a resumed run with the reference, and saying
which part diverged and why (see ``_tools/verify.py``'s docstring for the runs it makes)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from .verify_samples import SampleDifference

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
    samples: SampleDifference | None = None  # compared sample by sample (_tools/verify_samples.py)
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
# ORDER_DIFFERS, NOT_CAPTURED and RESUME_FAILED are verify_samples.py's wording too.
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
