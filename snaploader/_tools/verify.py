"""``snaploader verify MODULE:FACTORY``: does this pipeline resume exactly?

snaploader resumes exactly what it can see: the sampler, the three global RNGs in each
worker, a dataset's or iterator's ``state_dict()``. A pipeline can still hold state it
cannot see (a generator object, a global of another module, a C extension's RNG, time,
a file that changes). This command finds out, in fresh processes, as a restart would::

    reference run ──state_dict() at each cut──► state files (torch.save)
         │                                            │ one fresh process per cut:
         │ batch digests                              ▼ load, consume the rest
         ├──────────────── compare, batch by batch ◄──┘ (optionally kill a worker)
         └── compare ◄── a second uninterrupted run (PYTHONHASHSEED=0), beside them

    the second run differs from the first? two more (PYTHONHASHSEED=0 and 1):
      the one with the same hash seed differs   -> nondeterministic (time, OS entropy)
      only the one with another hash seed does  -> depends on the hash seed
      neither                                   -> the data changed
      (skipped when the resumed runs agree with the second run: the data changed)
    else a resumed run differs: in its sample indices -> the sampler's state is not
      captured; in its values -> randomness or state snaploader does not capture
    (--resume-batch-size/--resume-workers: resumed into another topology, compared
    sample by sample; _tools/verify_compare.py)

Every run is a child process (``_tools/verify_child.py``) in its own session, killed with its
workers when it outlives ``--timeout-s``; the state files live in a temporary folder
removed at the end. Exit status: 0 every cut resumed identically, 1 a difference (or a
resumed run failed), 2 a usage error or a pipeline that does not run at all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, TextIO

from . import verify_compare
from .verify_child import Cut
from .verify_compare import (
    CutResult,
    after,
    diagnose_source,
    first_difference,
    group_cuts,
    rerun_job,
)
from .verify_loader import Topology, UsageError

DEFAULT_CUTS: Final = "1,mid,end,boundary"
_STDERR_TAIL_CHARS: Final = 2000



@dataclass(frozen=True)
class VerifyOptions:
    """The command line of ``snaploader verify``, parsed."""

    target: str
    epochs: int
    max_batches: int
    cuts: tuple[str, ...]
    strict_cuts: bool  # cuts given on the command line: one that cannot be taken is an error
    kill_worker: bool
    jobs: int
    timeout_s: float
    topology: Topology | None = None  # --resume-batch-size/--resume-workers: compare samples


class Progress:
    """One line per step on stderr; a single line rewritten in place on a terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.lock = threading.Lock()
        self.width = 0

    def step(self, text: str) -> None:
        with self.lock:
            if self.tty:
                self.stream.write("\r" + text.ljust(self.width))
                self.width = len(text)
            else:
                self.stream.write(f"verify: {text}\n")
            self.stream.flush()

    def done(self) -> None:
        if self.tty and self.width:
            with self.lock:
                self.stream.write("\r" + " " * self.width + "\r")
                self.stream.flush()
                self.width = 0


# -- child processes ------------------------------------------------------------------


def _exit_words(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ChildRuns:
    """Starts the child runs, each in its own session so that a run and its workers can
    be killed together, and hands back their JSON results."""

    def __init__(self, options: VerifyOptions, folder: Path) -> None:
        self.options = options
        self.folder = folder
        self.count = 0
        self.lock = threading.Lock()
        self.live: set[subprocess.Popen[str]] = set()

    def kill_all(self) -> None:
        """End every run in flight with its workers (verify was interrupted)."""
        with self.lock:
            for process in self.live:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def run(self, job: dict[str, Any], phase: str, hash_seed: str | None = None) -> dict[str, Any]:
        with self.lock:
            self.count += 1
            name = f"run-{self.count}"
        job_path, out_path = self.folder / f"{name}.job.json", self.folder / f"{name}.out.json"
        job_path.write_text(json.dumps({"target": self.options.target, "epochs": self.options.epochs,
                                        "max_batches": self.options.max_batches, **job}))
        env = dict(os.environ, SNAPLOADER_VERIFY_PHASE=phase)
        if hash_seed is not None:
            env["PYTHONHASHSEED"] = hash_seed
        process = subprocess.Popen(
            [sys.executable, "-m", "snaploader._tools.verify_child", str(job_path), str(out_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )
        with self.lock:
            self.live.add(process)
        try:
            _, stderr = process.communicate(timeout=self.options.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return {"ok": False, "error": {"kind": "timeout", "message": (
                f"the {phase} run did not finish within --timeout-s {self.options.timeout_s:g}; "
                "it was killed with its workers. Lower --max-batches or --epochs, or raise --timeout-s"
            )}}
        finally:
            with self.lock:
                self.live.discard(process)
            # Workers the run left behind (it was killed, or it crashed) go with it.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if process.poll() is None:
                process.kill()
                process.communicate()
        if out_path.exists():
            result: dict[str, Any] = json.loads(out_path.read_text())
            return result
        return {"ok": False, "error": {"kind": "crash", "message": (
            f"the {phase} run {_exit_words(process.returncode)} before it reported; "
            f"the end of its stderr:\n{stderr[-_STDERR_TAIL_CHARS:]}"
        )}}


# -- the command ----------------------------------------------------------------------


def _wrap(text: str, first: str, rest: str, width: int = 88) -> str:
    return textwrap.fill(text, width=width, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False)


def _table(cuts: list[CutResult]) -> list[str]:
    rows = [("cut", "checkpoint taken", "compared", "result")]
    rows += [(",".join(c.labels), c.where, str(c.compared), c.verdict) for c in cuts]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows]


def verify(options: VerifyOptions, out: TextIO, err: TextIO) -> int:
    """Run the check; print the report to ``out`` and progress to ``err``. Exit status."""
    progress = Progress(err)
    with tempfile.TemporaryDirectory(prefix="snaploader-verify-") as folder, \
            ThreadPoolExecutor(max_workers=options.jobs) as pool:
        runner = ChildRuns(options, Path(folder))
        try:
            return _verify_in(options, runner, pool, progress, out, err)
        except BaseException:
            # The runs sit in sessions of their own, out of reach of the terminal's
            # Ctrl-C: end them here, or the pool would wait for them to finish.
            runner.kill_all()
            raise


def _verify_in(
    options: VerifyOptions, runner: ChildRuns, pool: ThreadPoolExecutor, progress: Progress, out: TextIO, err: TextIO
) -> int:
    folder = str(runner.folder)
    epochs = f"{options.epochs} epoch{'s' if options.epochs != 1 else ''}"
    topology = options.topology
    into = {} if topology is None else {"topology": asdict(topology)}
    progress.step(f"reference run: {epochs}, at most {options.max_batches} batches each")
    reference = runner.run({"mode": "reference", "cuts": list(options.cuts), **into,
                            "strict_cuts": options.strict_cuts, "state_dir": folder,
                            "kill_worker": options.kill_worker}, "reference")
    if not reference["ok"]:
        progress.done()
        error = reference["error"]
        if error["kind"] == "usage":
            print(f"snaploader verify: {error['message']}", file=err)
        else:
            print(f"snaploader verify: the uninterrupted run of {options.target} failed, so there "
                  f"is nothing to compare; fix the pipeline first.\n{error['message']}", file=err)
        return 2
    workers = reference["num_workers"] if topology is None or topology.num_workers is None else topology.num_workers
    if options.kill_worker and workers == 0:
        progress.done()
        whose, other = ("this", "") if topology is None else ("the resumed", ", or give --resume-workers 1 or more")
        print(f"snaploader verify: --kill-worker needs worker processes, and {whose} loader has "
              f"num_workers=0; drop --kill-worker{other}", file=err)
        return 2
    cuts = group_cuts(reference)
    if not cuts:
        progress.done()
        print(f"snaploader verify: none of the cuts {','.join(options.cuts)} falls inside this "
              "run; raise --max-batches or --epochs, or pick other --cuts", file=err)
        return 2

    def resume(cut: CutResult) -> CutResult:
        expected = after(reference["batches"], cut.position)
        progress.step(f"resume from cut {','.join(cut.labels)} ({cut.where}) in a fresh process")
        plan = {} if topology is None else {"plan": verify_compare.plan(reference, cut, topology)}
        result = runner.run({"mode": "resume", "state_path": cut.state_path, "start": list(cut.position),
                             "kill_worker": options.kill_worker, "expected": len(expected), **into, **plan},
                            "resume")
        if not result["ok"]:
            cut.error = result["error"]["message"]
            return cut
        # A note every run makes (the factory returned a torch DataLoader) is the
        # reference's, shown once.
        cut.notes = tuple(f"cut {','.join(cut.labels)}: {note}" for note in result["notes"]
                          if note not in reference["notes"])
        if topology is not None:
            verify_compare.compare(reference, cut, result, topology)
            return cut
        cut.got = result["batches"]
        cut.difference = first_difference(expected, cut.got)
        cut.compared = len(expected) if cut.difference is None else cut.difference.index + 1
        return cut

    def again() -> dict[str, Any]:
        progress.step("a second uninterrupted run in a fresh process (PYTHONHASHSEED=0)")
        return runner.run(rerun_job(folder), "rerun", "0")

    # The second uninterrupted run shares the pool with the resumed runs: it checks
    # determinism when all goes well, and starts the diagnosis when it does not.
    rerun_future = pool.submit(again)
    results = list(pool.map(resume, cuts))
    rerun = rerun_future.result()
    stable = rerun["ok"] and first_difference(reference["batches"], rerun["batches"]) is None
    failed = [c for c in results if c.failed]
    if topology is not None and stable and failed:
        source = verify_compare.diagnose(reference, results, topology)
    else:
        source = "" if stable and not failed else diagnose_source(
            reference, rerun, results, lambda seed: runner.run(rerun_job(folder), "rerun", seed), progress.step, pool
        )
    progress.done()
    _report(options, reference, results, source, out)
    if source:
        return 1
    # A cut that compared nothing is not a pass: with no other, nothing was verified.
    return 2 if all(cut.empty for cut in results) else 0


def _skipped(options: VerifyOptions, reference: dict[str, Any]) -> list[str]:
    lines = []
    for text in options.cuts:
        cut = Cut.parse(text)
        if cut.label not in reference["saved"]:
            try:
                cut.resolve(reference["lengths"], reference["ended"], options.max_batches)
            except UsageError as exc:
                lines.append(f"skipped {exc}")
    return lines


def _report(options: VerifyOptions, reference: dict[str, Any], cuts: list[CutResult], source: str, out: TextIO) -> None:
    lengths = reference["lengths"]
    shape = f"{lengths[0]} batches" if len(set(lengths)) == 1 else "/".join(map(str, lengths)) + " batches"
    workers = reference["num_workers"]
    print(f"snaploader verify {options.target}", file=out)
    print(f"  {reference['kind']}-style dataset, {workers} worker{'s' if workers != 1 else ''}, "
          f"{len(lengths)} epoch{'s' if len(lengths) != 1 else ''} of {shape}"
          + (", a worker SIGKILLed in each resumed run" if options.kill_worker else ""), file=out)
    if options.topology is not None:
        print(f"  each cut resumed into {options.topology.words()}, compared sample by sample", file=out)
    print("", file=out)
    for line in _table(cuts):
        print(line, file=out)
    notes = list(dict.fromkeys(reference["notes"] + [n for c in cuts for n in c.notes] + _skipped(options, reference)))
    if notes:
        print("\nnotes:", file=out)
        for note in notes:
            print(_wrap(note, "  - ", "    "), file=out)
    failed = [c for c in cuts if c.failed]
    if not source:
        checked = [c for c in cuts if not c.empty]
        compared = sum(c.compared for c in checked)
        if checked and options.topology is not None:
            print("\n" + verify_compare.summary(cuts, options.topology), file=out)
        elif checked:
            print(f"\nresumes exactly: {compared} batches compared after {len(checked)} cut"
                  f"{'s' if len(checked) != 1 else ''}, every one identical to the uninterrupted run; "
                  "a second uninterrupted run in a fresh process is identical too.", file=out)
        empty = [",".join(c.labels) for c in cuts if c.empty]
        if empty:
            print("", file=out)
            why = " (see the notes)." if any(c.unchecked for c in cuts) else (
                ", because the run ends there; raise --epochs (or --max-batches) to check a resume from there.")
            print(_wrap(f"{'nothing checked' if not checked else 'not checked'}: cut"
                        f"{'s' if len(empty) != 1 else ''} {', '.join(empty)} compared nothing{why}", "", ""),
                  file=out)
        return
    print("\ndiagnosis:", file=out)
    for cut in failed:
        print(f"  cut {','.join(cut.labels)} ({cut.where}):", file=out)
        if cut.error is not None:
            for line in cut.error.rstrip().splitlines()[-12:]:
                print(f"    | {line}", file=out)
            continue
        if cut.samples is not None:
            lines = cut.samples.describe()
        else:
            assert cut.difference is not None
            lines = [f"first difference at {cut.difference.where}", *cut.difference.describe()]
        for line in lines:
            print(f"    {line}", file=out)
    print("", file=out)
    print(_wrap(source, "  => ", "     "), file=out)


def _add_topology_arguments(parser: argparse.ArgumentParser) -> None:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", metavar="MODULE:FACTORY",
                        help="a function that returns your loader (a snaploader or torch DataLoader); "
                             "MODULE is a dotted module name or a path to a .py file")
    parser.add_argument("--epochs", type=at_least(1), default=2, help="epochs in each run (default 2)")
    parser.add_argument("--max-batches", type=at_least(1), default=64,
                        help="at most this many batches per epoch (default 64)")
    parser.add_argument("--cuts", default=None,
                        help=f"where to checkpoint, comma-separated: a batch count, first, mid, end or "
                             f"boundary, each optionally @EPOCH (default {DEFAULT_CUTS})")
    parser.add_argument("--kill-worker", action="store_true",
                        help="SIGKILL a worker during each resumed run, after its first batch (needs num_workers >= 1)")
    parser.add_argument("--jobs", type=at_least(1), default=2, help="runs at a time (default 2)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="seconds one run may take before it is killed (default 600)")
    _add_topology_arguments(parser)


def options_from(args: argparse.Namespace) -> VerifyOptions:
    """Validated options; raises UsageError with what to change."""
    if args.timeout_s <= 0:
        raise UsageError(f"--timeout-s should be a positive number of seconds, got {args.timeout_s:g}")
    texts = tuple(t.strip() for t in (args.cuts or DEFAULT_CUTS).split(",") if t.strip())
    if not texts:
        raise UsageError(f"--cuts is empty; give at least one cut, e.g. --cuts {DEFAULT_CUTS}")
    for text in texts:
        cut = Cut.parse(text)
        if cut.epoch >= args.epochs:
            raise UsageError(f"cut {text}: the run has {args.epochs} epoch(s), 0..{args.epochs - 1}; "
                             f"raise --epochs to {cut.epoch + 1} or pick an earlier epoch")
    if ":" not in args.target:
        raise UsageError(f"target {args.target!r} should be MODULE:FACTORY, e.g. mypackage.data:make_loader "
                         "or path/to/pipeline.py:make_loader")
    return VerifyOptions(args.target, args.epochs, args.max_batches, texts, args.cuts is not None,
                         args.kill_worker, args.jobs, args.timeout_s, topology_from(args))


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    parser = argparse.ArgumentParser(prog="snaploader verify", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run_parsed(parser.parse_args(argv), out or sys.stdout, err or sys.stderr)


def run_parsed(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        options = options_from(args)
    except UsageError as exc:
        print(f"snaploader verify: {exc}", file=err)
        return 2
    return verify(options, out, err)
