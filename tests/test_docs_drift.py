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
