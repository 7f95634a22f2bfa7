"""The README's first command runs ``python -m snaploader.demo``: a trainer SIGKILLed
mid-epoch and resumed from its checkpoint, a worker killed after the restart. It must
keep saying what it says: snaploader's stream identical, torch's resume not."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_demo_shows_an_identical_stream_after_the_kills() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "snaploader.demo"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "!! SIGKILL to worker 1" in out  # the worker kill happened, after the restart
    summary = out[out.index("summary:"):]
    ours = re.search(r"snaploader\s+(\d+)/(\d+) batches identical", summary)
    theirs = re.search(r"torch\s+(\d+)/(\d+) batches identical", summary)
    assert ours and theirs, summary
    assert ours.group(1) == ours.group(2) and int(ours.group(2)) > 0
    # the point of the demo: torch's own resume does not give the same stream
    assert int(theirs.group(1)) < int(theirs.group(2))
