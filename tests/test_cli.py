"""The ``snaploader`` command's own options: ``--version``, and help text a terminal shows
as written (no reStructuredText markup from the docstrings it is taken from)."""

from __future__ import annotations

import configparser
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import snaploader
from snaploader.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_python_dash_m_snaploader_prints_the_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "snaploader", "--version"], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"snaploader {snaploader.__version__}\n"


def test_the_installed_command_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    # The `snaploader` command is setup.cfg's console script: call what it names.
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    scripts = dict(line.split(" = ") for line in config["options.entry_points"]["console_scripts"].split("\n") if line)
    module, function = scripts["snaploader"].split(":")
    with pytest.raises(SystemExit) as exited:
        getattr(importlib.import_module(module), function)(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"snaploader {snaploader.__version__}\n"


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_help_shows_no_restructuredtext_markup(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    shown = capsys.readouterr().out
    assert f"snaploader {command}" in shown
    assert "``" not in shown, shown
