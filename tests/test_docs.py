"""Every code block in README.md and docs/*.md runs, so the docs stay true.

The conventions, for whoever writes a doc:

- A fenced ```` ```python ```` block is a program. It runs as a script, in a process
  of its own, with a timeout: ``tests/_doc_runner.py`` (started once with
  ``sys.executable``, after importing torch, which takes seconds) forks a child per
  block that runs it with ``__name__ == "__main__"`` and ``__file__`` set, so spawn
  workers re-import it as they would a user's script.
  The blocks of one document run in their order, each in its own process, in one
  temporary directory: a later block may read a file an earlier one wrote (a
  checkpoint saved by one block and resumed by the next, as in a new process).
- Scaffolding the reader does not need to see goes in an HTML comment right before the
  block, ``<!-- setup: why`` on its first line, then Python, then ``-->``; it runs
  before the block, in the same script. An HTML comment right after the block,
  ``<!-- check: why`` ... ``-->``, runs after it: it asserts what the prose claims
  (for example that a resume was exact). Keep their data tiny: the whole of this test
  should take well under a minute.
- A block that is intentionally not a whole program (a method shown out of its class, a
  loop with elided parts) is marked ```` ```python fragment ````: it is only compiled.
  An unmarked block that fails fails this test.
- A block that the reader saves as a module (``pipeline.py``) is marked
  ```` ```python file=pipeline.py ````: it is written under that name in the document's
  temporary directory, where later blocks import it, and run too.
- A block that needs an optional package (the ``integrations`` extra) is marked
  ```` ```python requires=PACKAGE ````: it runs where ``PACKAGE`` imports, and is
  reported as not run (and only compiled) where it does not.
- ```` ```bash ```` blocks install packages, build virtual environments or start long
  runs (the demo, the test suite, the benchmark, the stress scripts); running them here
  would download or take minutes, so such a block is skipped, and the reason is
  reported. Any other bash block runs, in the repository root. Fences without a
  language (messages, diagrams) are text and are not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

_BLOCK_TIMEOUT_S = 60.0
_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
_PYTHON = {"python", "py"}
_SHELL = {"bash", "sh", "shell", "console"}
# Why a bash block is not run here: the first pattern that matches it.
_SKIP_BASH = (
    (re.compile(r"pip install|-m venv"), "installs packages"),
    (re.compile(r"snaploader\.demo|-m pytest|stress/|snaploader verify"), "starts a long run"),
)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    language: str
    marks: tuple[str, ...]
    code: str
    setup: str = ""
    check: str = ""

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def _comment(lines: list[str], start: int, kind: str) -> tuple[str, int] | None:
    """The code of a ``<!-- kind: ...`` comment starting at ``lines[start]`` and the
    index of its closing line, or None when there is none there."""
    if start < 0 or start >= len(lines) or not lines[start].startswith(f"<!-- {kind}:"):
        return None
    for end in range(start + 1, len(lines)):
        if lines[end].strip() == "-->":
            return "\n".join(lines[start + 1 : end]) + "\n", end
    raise AssertionError(f"the <!-- {kind}: comment at line {start + 1} is never closed")


def blocks(doc: Path) -> list[Block]:
    """The fenced code blocks of ``doc``, with their setup and check comments."""
    lines = doc.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match or not match["info"].strip():
            i += 1
            if match:  # a text fence: skip to its end
                while i < len(lines) and lines[i].strip() != "```":
                    i += 1
                i += 1
            continue
        indent = len(match["indent"])
        language, *marks = match["info"].split()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{doc.name}:{i + 1}: the code block is never closed"
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        setup = ""
        if i > 0 and lines[i - 1].strip() == "-->":  # a comment ends right before the fence
            start = i - 2
            while start >= 0 and not lines[start].startswith("<!--"):
                start -= 1
            comment = _comment(lines, start, "setup")
            setup = comment[0] if comment else ""
        check_comment = _comment(lines, end + 1, "check")
        check = check_comment[0] if check_comment else ""
        found.append(Block(doc, i + 1, language, tuple(marks), code, setup, check))
        i = end + 1 if check_comment is None else check_comment[1] + 1
    return found


def _skip_reason(block: Block) -> str | None:
    for pattern, reason in _SKIP_BASH:
        if pattern.search(block.code):
            return reason
    return None


class _Runner:
    """The ``_doc_runner.py`` process, restarted after a block that timed out."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_doc_runner.py"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )

    def run(self, script: Path) -> int | None:
        """The script's exit status, or None when it timed out."""
        if self.proc is None:
            self.start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{script}\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], _BLOCK_TIMEOUT_S)
        if ready:
            return int(self.proc.stdout.readline())
        self.close()  # the block's process and its workers are in the runner's session
        return None

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc = None


@pytest.fixture(scope="module")
def runner() -> Iterator[_Runner]:
    # Module-scoped, so it exists before each test's leak check starts counting.
    started = _Runner()
    yield started
    started.close()


def _run_python(block: Block, workdir: Path, runner: _Runner) -> str | None:
    """Run one block as a script; the failure, or None."""
    script = workdir / (re.sub(r"[^A-Za-z0-9]+", "_", block.where) + ".py")
    script.write_text(block.setup + block.code + block.check)
    status = runner.run(script)
    if status is None:
        return f"{block.where}: did not finish in {_BLOCK_TIMEOUT_S:g} s"
    if status != 0:
        output = Path(f"{script}.out").read_text()
        return (f"{block.where}: exit status {status}\n--- script {script}\n"
                f"{script.read_text()}--- output\n{output[-4000:]}")
    return None


def _run_bash(block: Block) -> str | None:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, capture_output=True,
        text=True, timeout=_BLOCK_TIMEOUT_S,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    if done.returncode != 0:
        return f"{block.where}: exit status {done.returncode}\n{done.stderr[-4000:]}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_code_blocks_run(doc: Path, tmp_path: Path, runner: _Runner) -> None:
    failures = []
    skipped = []
    for block in blocks(doc):
        if block.language in _PYTHON:
            if "fragment" in block.marks:
                assert not (block.setup or block.check), f"{block.where}: a fragment has no setup or check"
                try:
                    compile(block.code, block.where, "exec")
                except SyntaxError as exc:
                    failures.append(f"{block.where}: a fragment that does not compile: {exc}")
                continue
            files = [mark.removeprefix("file=") for mark in block.marks if mark.startswith("file=")]
            needs = [mark.removeprefix("requires=") for mark in block.marks if mark.startswith("requires=")]
            unknown = [mark for mark in block.marks if not mark.startswith(("file=", "requires="))]
            assert not unknown, f"{block.where}: unknown mark {unknown}; only 'fragment', 'file=NAME' or 'requires=PACKAGE'"
            missing = [name for name in needs if importlib.util.find_spec(name) is None]
            if missing:
                compile(block.setup + "\n" + block.code + "\n" + block.check, block.where, "exec")
                skipped.append(f"{block.where} (needs {', '.join(missing)})")
                continue
            for name in files:
                (tmp_path / name).write_text(block.code)
            failure = _run_python(block, tmp_path, runner)
        elif block.language in _SHELL:
            reason = _skip_reason(block)
            if reason is not None:
                skipped.append(f"{block.where} ({reason})")
                continue
            failure = _run_bash(block)
        else:
            continue
        if failure is not None:
            failures.append(failure)
    assert not failures, "\n\n".join(failures)
    if skipped:
        print("blocks not run: " + "; ".join(skipped))


def test_setup_and_check_comments_are_attached_to_a_block() -> None:
    """A setup or check comment not next to a python block would silently not run."""
    for doc in DOCS:
        attached = sum(bool(b.setup) + bool(b.check) for b in blocks(doc))
        written = sum(1 for line in doc.read_text().splitlines()
                      if line.startswith(("<!-- setup:", "<!-- check:")))
        assert attached == written, f"{doc.name}: {written - attached} setup/check comment(s) not next to a code block"
