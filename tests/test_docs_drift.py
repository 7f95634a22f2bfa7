"""The docs keep up with the code: what the API reference lists is what the code has,
the messages the docs quote are the ones the code produces, and the checkpoint format
version the docs print is the one the code writes.

Quoted messages: a text fence (no language) that quotes an error, a warning or printed
output is preceded by an HTML comment

    <!-- message: what produces it
    python code that raises the exception, or prints the text
    -->

whose code is run (as a script, in a process of its own, like test_docs.py's blocks);
the quoted text must equal what it raised (``str(exception)``) or else printed to its
stdout, up to line wrapping and pids (``pid 8469`` reads ``pid N`` on both sides).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import snaploader
import snaploader.distributed
from snaploader import _errors
from snaploader._format.checkpoint import READABLE_VERSIONS, VERSION
from snaploader._format.fingerprint import CHECKED_KEYS, SAMPLER_CHECKED_KEYS

from .test_docs import DOCS, ROOT, _Runner, blocks

API = (ROOT / "docs" / "api.md").read_text()
DISTRIBUTED = (ROOT / "docs" / "distributed.md").read_text()


def _fragment_with(start: str) -> str:
    """The python fragment block of ``text`` whose code starts with ``start``."""
    for block in blocks(ROOT / "docs" / "api.md"):
        if block.code.startswith(start):
            return block.code
    raise AssertionError(f"docs/api.md has no code block starting {start!r}")


def _signature_text(function: Any) -> str:
    """``name(a, *, b=1)``: the parameters without annotations, as the docs write them."""
    parts, star = [], False
    for parameter in list(inspect.signature(function).parameters.values())[1:]:  # less self
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        default = parameter.default
        parts.append(parameter.name if default is inspect.Parameter.empty else f"{parameter.name}={default!r}")
    return f"{function.__name__}({', '.join(parts)})"


# -- the API reference lists what the code has ------------------------------------------


def test_the_documented_constructor_is_the_code_s() -> None:
    namespace: dict[str, Any] = {"torch": torch}
    exec(_fragment_with("class DataLoader("), namespace)
    documented = inspect.signature(namespace["DataLoader"].__init__).parameters
    actual = inspect.signature(snaploader.DataLoader.__init__).parameters
    assert list(documented) == list(actual), "docs/api.md's DataLoader signature lists other arguments"
    for name, parameter in actual.items():
        shown = documented[name]
        assert (shown.kind, shown.default) == (parameter.kind, parameter.default), (
            f"docs/api.md shows {name} as {shown}, the code has {parameter}"
        )


def test_every_snaploader_option_has_a_row_in_the_options_table() -> None:
    names = list(inspect.signature(snaploader.DataLoader.__init__).parameters)
    own = names[names.index("in_order") + 1 :]
    assert own, "snaploader's own options follow torch's in_order"
    missing = [name for name in own if f"\n| `{name}` |" not in API]
    assert not missing, f"docs/api.md's options table has no row for {missing}"


def test_every_allow_mismatch_name_has_a_row() -> None:
    section = API.split("### `allow_mismatch`", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    compared = list(CHECKED_KEYS) + list(SAMPLER_CHECKED_KEYS)
    assert rows == compared, f"docs/api.md's allow_mismatch table lists {rows}; load_state_dict compares {compared}"


def test_load_state_dict_is_documented_with_its_keywords() -> None:
    text = _signature_text(snaploader.DataLoader.load_state_dict)
    assert f"### `{text} -> None`" in API, f"docs/api.md has no heading for {text}"


def test_every_public_method_is_documented() -> None:
    own = [name for name, value in vars(snaploader.DataLoader).items()
           if callable(value) and not name.startswith("_")]
    assert {"state_dict", "load_state_dict", "batches_remaining", "captured_rngs"} <= set(own)
    missing = [name for name in own if f"`{name}(" not in API]
    assert not missing, f"docs/api.md does not document DataLoader.{missing}"
    resharded = [name for name, value in vars(snaploader.distributed.ReshardedLoader).items()
                 if callable(value) and not name.startswith("_")]
    missing = [name for name in resharded if f"`{name}(" not in DISTRIBUTED]
    assert not missing, f"docs/distributed.md does not document ReshardedLoader.{missing}"


def test_every_public_name_is_in_the_api_reference() -> None:
    names = [*snaploader.__all__, *snaploader.distributed.__all__]
    missing = [name for name in names if f"`{name}" not in API]
    assert not missing, f"docs/api.md does not name {missing}"
    missing = [name for name in snaploader.distributed.__all__ if f"## `{name}" not in DISTRIBUTED]
    assert not missing, f"docs/distributed.md has no section for {missing}"


def test_every_exception_and_warning_has_a_row() -> None:
    classes = [name for name, value in vars(_errors).items()
               if isinstance(value, type) and issubclass(value, (Exception, Warning))
               and value.__module__ == "snaploader"]  # defined there, shown under the public name
    assert len(classes) >= 7
    assert set(classes) <= set(snaploader.__all__), "every exception and warning is public"
    missing = [name for name in classes if f"| `{name}` |" not in API and f"`snaploader.{name}`" not in API]
    assert not missing, f"docs/api.md's exception and warning tables have no row for {missing}"


def test_readme_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [doc.name for doc in DOCS if doc.parent.name == "docs" and f"](docs/{doc.name})" not in readme]
    assert not missing, f"README.md's documentation list does not link {missing}"


# -- the checkpoint format version -------------------------------------------------------


def test_the_format_version_the_docs_print_is_the_current_one() -> None:
    found = []
    for doc in DOCS:
        for match in re.finditer(r"format (?:snaploader )?version (\d+)", doc.read_text()):
            found.append((doc.name, int(match[1])))
    assert found, "no doc prints the format version any more: this test would check nothing"
    stale = [(name, version) for name, version in found if version != VERSION]
    assert not stale, f"docs print format versions {stale}; the code writes {VERSION}"
    readable = " and ".join(map(str, READABLE_VERSIONS))
    compatibility = (ROOT / "docs" / "compatibility.md").read_text()
    assert f"reads versions {readable}" in " ".join(compatibility.split()), (
        f"docs/compatibility.md should say this snaploader reads versions {readable}"
    )


# -- quoted messages -----------------------------------------------------------------------


@dataclass(frozen=True)
class Quote:
    doc: Path
    line: int
    code: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def quotes(doc: Path) -> Iterator[Quote]:
    lines = doc.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("<!-- message:"):
            continue
        indent = len(line) - len(line.lstrip())
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->")
        fence = end + 1
        assert fence < len(lines) and lines[fence].strip() == "```", (
            f"{doc.name}:{i + 1}: a message comment must be followed by a text fence"
        )
        close = next(j for j in range(fence + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(text[indent:] for text in lines[i + 1 : end]) + "\n"
        yield Quote(doc, fence + 1, code, "\n".join(lines[fence + 1 : close]))


QUOTES = [quote for doc in DOCS for quote in quotes(doc)]

_WRAPPER = '''\
import contextlib as _contextlib
import io as _io
_code = {code!r}
_printed = _io.StringIO()
try:
    with _contextlib.redirect_stdout(_printed):
        exec(compile(_code, {where!r}, "exec"), {{"__name__": "__main__", "__file__": __file__}})
    _message = _printed.getvalue()
except BaseException as _exc:
    _message = str(_exc)
with open(__file__ + ".message", "w") as _file:
    _file.write(_message)
'''


def _normal(text: str) -> str:
    return re.sub(r"\bpid(\(s\))? \d+", r"pid\1 N", " ".join(text.split()))


@pytest.fixture(scope="module")
def runner() -> Iterator[_Runner]:
    started = _Runner()
    yield started
    started.close()


def test_the_docs_mark_their_quoted_messages() -> None:
    # The pages that quote an error or a warning mark each quote; a quote added without
    # a mark is not checked, so at least these must be.
    marked = {quote.doc.name for quote in QUOTES}
    assert {"api.md", "quickstart.md", "iterable.md", "fault-tolerance.md"} <= marked, marked


@pytest.mark.parametrize("quote", QUOTES, ids=lambda quote: quote.where)
def test_a_quoted_message_is_what_the_code_says(quote: Quote, tmp_path: Path, runner: _Runner) -> None:
    script = tmp_path / "message.py"
    script.write_text(_WRAPPER.format(code=quote.code, where=quote.where))
    status = runner.run(script)
    output = Path(f"{script}.out").read_text()
    assert status == 0, f"{quote.where}: the message comment's code failed:\n{output[-3000:]}"
    # Only what it raised or printed: workers' stderr (torch's segfault notice) goes elsewhere.
    produced = Path(f"{script}.message").read_text()
    assert _normal(produced) == _normal(quote.text), (
        f"{quote.where} quotes\n{quote.text}\nbut the code says\n{produced}"
    )


# -- the README's account of CI -------------------------------------------------------------


def test_ci_leaves_the_checkouts_venv_alone_and_the_readme_names_its_own() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    commands = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"(^|[\s\"'=/])\.venv\b", commands), (
        ".ci/run must not touch the checkout's .venv, which the README's commands make"
    )
    match = re.search(r"^venv=(\S+)$", script, re.MULTILINE)
    assert match, ".ci/run names its virtual environment in one variable, venv=DIR"
    assert f"rm -rf \"$venv\"" in script
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`{match[1]}/`" in readme, f"README.md's Development section should name {match[1]}/"


# -- what the pages cite exists --------------------------------------------------------------

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PACKAGE = ROOT / "snaploader"
SOURCES = sorted(PACKAGE.rglob("*.py"))
# What a page cites: a path from the repository root, a path inside the package
# (``_format/checkpoint.py``), a bare private module (``_errors.py``), a dotted name.
_ROOTED = re.compile(r"(?<![\w/.])((?:snaploader|tests|stress|examples)/[\w/]*\w\.py)\b")
_INSIDE = re.compile(r"(?<![\w/.])((?:_[a-z]\w*|distributed|integrations)/\w+\.py)\b")
_BARE = re.compile(r"(?<![\w/.])(_[a-z]\w*\.py)\b")
_DOTTED = re.compile(r"(?<![\w/.])(snaploader(?:\.\w+)+)")
_NOTE = re.compile(r"NOTE \[ ([^\]]+?) \]")
# Where a note is written: "NOTE [ name ]" starting a comment, a docstring line or a
# docstring bullet, alone or followed by a colon; anywhere else it is a citation.
_NOTE_DEFINED = re.compile(r"^\s*(?:# ?|- )?NOTE \[ ([^\]]+?) \](?::|\s*$)", re.MULTILINE)
# A citation that says where: "NOTE [ x ] in `_workers/messages.py`" (or ``...``).
_NOTE_WHERE = re.compile(r"NOTE \[ ([^\]]+?) \]`?\s+in\s+`*((?:snaploader/)?[\w/]+\.py)")


def _citing() -> list[Path]:
    """The pages, examples and package modules whose citations are checked."""
    return [*DOCS, ROOT / "CHANGELOG.md", *EXAMPLES, *SOURCES]


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _resolves(dotted: str) -> bool:
    """Whether ``snaploader.a.b`` names a module of the package or something in one. A
    module whose import needs an optional package that is absent (the integrations)
    counts by its file alone."""
    import importlib

    parts = dotted.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if _module_file(module) is None:
            continue
        if cut == len(parts):
            return True
        try:
            value: Any = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("snaploader"):
                return True  # its dependency is not installed here: the file is all we can check
            raise
        for name in parts[cut:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def _stale_paths(path: Path) -> list[str]:
    text = path.read_text()
    where = path.relative_to(ROOT)
    bare = {source.name for folder in ("snaploader", "tests", "stress") for source in (ROOT / folder).rglob("*.py")}
    stale = []
    for match in _ROOTED.finditer(text):
        if not (ROOT / match[1]).is_file():
            stale.append(f"{where}:{_line(text, match.start())}: {match[1]} does not exist")
    for match in _INSIDE.finditer(text):
        if text[max(0, match.start() - 11) : match.start()].endswith(("snaploader/", "tests/", "stress/")):
            continue
        if not (PACKAGE / match[1]).is_file():
            stale.append(f"{where}:{_line(text, match.start())}: snaploader/{match[1]} does not exist")
    for match in _BARE.finditer(text):
        if match[1] not in bare:
            stale.append(f"{where}:{_line(text, match.start())}: no module {match[1]} in snaploader/, tests/ or stress/")
    for match in _DOTTED.finditer(text):
        if not _resolves(match[1]):
            stale.append(f"{where}:{_line(text, match.start())}: {match[1]} names nothing")
    return stale


def test_every_path_and_module_a_page_cites_exists() -> None:
    stale = [line for path in _citing() for line in _stale_paths(path)]
    assert not stale, "pages cite paths and modules that are not there:\n" + "\n".join(stale)


_RELATIVE = re.compile(r"``(_[a-z]\w*)\.(\w+)``")


def test_a_module_named_in_a_docstring_by_its_dotted_name_is_there() -> None:
    # ``_ledger.first_due`` in a module of snaploader/_epoch/ names snaploader._epoch._ledger
    # (or a module of that name at the top): a module moved into a group leaves it stale.
    import importlib

    stale = []
    for source in SOURCES:
        text = source.read_text()
        package = ".".join(source.relative_to(ROOT).with_suffix("").parts[:-1])
        for match in _RELATIVE.finditer(text):
            if match[2] == "py":  # a file name, which the path check reads
                continue
            if not any(_resolves(f"{base}.{match[1]}.{match[2]}") for base in (package, "snaploader")):
                stale.append(f"{source.relative_to(ROOT)}:{_line(text, match.start())}: "
                             f"{match[0]} is in neither {package} nor snaploader")
    assert not stale, "docstrings name modules that are not there:\n" + "\n".join(stale)
    assert importlib.import_module("snaploader._format.checkpoint")  # the resolver's own base case


def _notes_defined() -> dict[str, set[Path]]:
    defined: dict[str, set[Path]] = {}
    for source in SOURCES:
        for name in _NOTE_DEFINED.findall(source.read_text()):
            defined.setdefault(name, set()).add(source.relative_to(PACKAGE))
    return defined


def test_every_note_a_page_cites_is_in_the_code_where_it_says() -> None:
    defined = _notes_defined()
    assert len(defined) >= 10, "the code's NOTE [ ... ] comments were not found: this would check nothing"
    stale = []
    for path in _citing():
        text = " ".join(path.read_text().split())  # a citation may wrap
        where = path.relative_to(ROOT)
        for name in _NOTE.findall(text):
            if name not in defined:
                stale.append(f"{where}: NOTE [ {name} ] is nowhere in snaploader/")
        for name, module in _NOTE_WHERE.findall(text):
            module = module.removeprefix("snaploader/")
            if name in defined and Path(module) not in defined[name]:
                stale.append(f"{where}: NOTE [ {name} ] is said to be in {module}; "
                             f"it is in {', '.join(map(str, sorted(defined[name])))}")
    assert not stale, "pages cite notes that are not there:\n" + "\n".join(stale)


# -- option lists --------------------------------------------------------------------------


def _own_options() -> list[str]:
    names = list(inspect.signature(snaploader.DataLoader.__init__).parameters)
    return names[names.index("in_order") + 1 :]


def _prose(doc: Path) -> str:
    """The page without its fenced blocks and HTML comments, lines joined."""
    text = re.sub(r"<!--.*?-->", " ", doc.read_text(), flags=re.DOTALL)
    text = re.sub(r"^ *```.*?^ *```", " ", text, flags=re.DOTALL | re.MULTILINE)
    return text


def test_every_list_of_snaploader_s_options_names_them_all() -> None:
    # A page lists the options in a sentence ("keyword-only options `a`, `b`, ..."): a
    # sentence that names four or more of them is a list, and a list names every one.
    own = _own_options()
    lists = []
    for doc in DOCS:
        for paragraph in re.split(r"\n\s*\n|\n\|", _prose(doc)):
            for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(`])", " ".join(paragraph.split())):
                named = {name for name in re.findall(r"`(\w+)`", sentence) if name in own}
                if len(named) >= 4:
                    lists.append((doc.name, sentence, set(own) - named))
    assert len(lists) >= 3, "the pages' option lists were not found: this would check nothing"
    incomplete = [f"{name}: lacks {sorted(missing)}: {sentence[:120]}..." for name, sentence, missing in lists if missing]
    assert not incomplete, "option lists that leave options out:\n" + "\n".join(incomplete)


# -- quoted messages are marked --------------------------------------------------------------

_MESSAGE_LIKE = re.compile(
    r"\b\w*(?:Error|Warning)\b|DataLoader worker \(pid|\bwas killed by SIG|\braised? \w+Error")


def test_every_quoted_error_or_warning_is_checked_against_the_code() -> None:
    # A text fence that reads like an error or a warning is a quote of one, and must be
    # preceded by a <!-- message: --> comment, or it can drift. Transcripts of a command
    # (a fence starting with "$ ") and diagrams are not quotes.
    marked = {(quote.doc, quote.line) for quote in QUOTES}
    unmarked = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = _FENCE_LINE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            body = "\n".join(lines[i + 1 : end])
            if (not fence["info"].strip() and (doc, i + 1) not in marked
                    and not body.lstrip().startswith("$ ") and _MESSAGE_LIKE.search(body)):
                unmarked.append(f"{doc.relative_to(ROOT)}:{i + 1}: {body.splitlines()[0][:100]}")
            i = end + 1
    assert not unmarked, ("text fences that quote an error or a warning without a "
                          "<!-- message: --> comment:\n" + "\n".join(unmarked))


_FENCE_LINE = re.compile(r"^ *```(?P<info>[^`]*)$")


# -- the performance figures say when and how -------------------------------------------------

_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
_COMMAND = re.compile(r"`(?:python )?stress/[\w/]+\.py[^`]*`")


def test_every_figure_in_performance_md_has_a_date_and_a_command() -> None:
    # A section whose tables hold measured figures says when they were measured and
    # what reproduces them: a date and a `python stress/...` command in the section.
    text = (ROOT / "docs" / "performance.md").read_text()
    sections = re.split(r"^(#{2,3} .*)$", text, flags=re.MULTILINE)
    figures = 0
    missing = []
    for heading, body in zip(sections[1::2], sections[2::2]):
        rows = [line for line in body.splitlines() if line.startswith("|") and not line.startswith("| ---")]
        measured = [row for row in rows[1:] if re.search(r"\d\.\d", row)]
        if not measured or heading.strip() in ("## Targets",):
            continue
        figures += 1
        lacks = [what for what, pattern in (("a date", _DATE), ("a stress/ command", _COMMAND))
                 if not pattern.search(body)]
        if lacks:
            missing.append(f"{heading.strip()}: lacks {' and '.join(lacks)}")
    assert figures >= 2, "performance.md's measured tables were not found: this would check nothing"
    assert not missing, "sections of docs/performance.md with figures but not:\n" + "\n".join(missing)
