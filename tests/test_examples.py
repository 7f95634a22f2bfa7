"""Every script in examples/ runs as its docstring says and reports the resumed stream
identical to the uninterrupted one (each example checks itself and exits 1 on a
difference). Each takes a minute or more (torchrun's restarts, fresh processes per
run), so they are integration tests; the Lightning and Hugging Face ones skip where
their package is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.integration

# Each example, the package it needs beyond torch, and the lines it prints when every
# case resumed exactly.
_CASES = {
    "torchrun_ddp.py": (None, 4),
    "lightning_resume.py": ("lightning", 2),
    "hf_trainer_resume.py": ("transformers", 2),
}


def test_every_example_is_run_here() -> None:
    assert sorted(_CASES) == sorted(path.name for path in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("name", sorted(_CASES))
def test_an_example_resumes_exactly(name: str, tmp_path: Path) -> None:
    package, cases = _CASES[name]
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{name} needs {package} (pip install -e '.[integrations]')")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{output[-5000:]}"
    verdicts = [line for line in done.stdout.splitlines() if "identical" in line or "DIFFER" in line]
    assert len(verdicts) == cases, f"{name} printed:\n{done.stdout}"
    assert not any("DIFFER" in line for line in verdicts), "\n".join(verdicts)
