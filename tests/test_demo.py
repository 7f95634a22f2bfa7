"""The README's first command runs ``python -m snaploader.demo``: a trainer SIGKILLed
mid-epoch and resumed from its checkpoint, a worker killed after the restart. It must
keep saying what it says: snaploader's stream identical, torch's resume not."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from snaploader.demo import _progress, _Restart


@pytest.mark.slow
def test_the_demo_shows_an_identical_stream_after_the_kills() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "snaploader.demo"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "!! SIGKILL to worker 1" in out  # the worker kill happened, after the restart
    # The progress never jumps back after the restart: the bar stays where the killed run
    # had taken it, and the steps between the checkpoint and the kill are marked redone.
    snaploader_part = out[: out.index("== torch ==")]
    bars = [bar.count("#") for bar in re.findall(r"\[([#.]+)\]", snaploader_part)]
    assert bars and bars == sorted(bars), bars
    progress = r"epoch (\d) step\s+(\d+)/12(?! \(redone)"
    shown = [(int(e), int(s)) for e, s in re.findall(progress, snaploader_part)]
    assert shown and shown == sorted(shown), shown
    assert "(redone: it came after the checkpoint)" in snaploader_part
    summary = out[out.index("summary:"):]
    ours = re.search(r"snaploader\s+(\d+)/(\d+) batches identical", summary)
    theirs = re.search(r"torch\s+(\d+)/(\d+) batches identical", summary)
    assert ours and theirs, summary
    assert ours.group(1) == ours.group(2) and int(ours.group(2)) > 0
    # the point of the demo: torch's own resume does not give the same stream
    assert int(theirs.group(1)) < int(theirs.group(2))


def test_the_progress_after_a_restart_never_goes_back() -> None:
    # The killed run logged 8 steps of epoch 1 (20 lines in all); its checkpoint covers 18.
    log = [f"{e} {s} digest" for e in range(2) for s in range(12)]
    killed = _Restart(covered=18, reached=20)
    assert _progress(log[:20], None) == (20, "epoch 1 step  8/12")
    assert _progress(log[:18], killed) == (20, "resuming from the checkpoint")
    assert _progress(log[:19], killed) == (20, "epoch 1 step  7/12 (redone: it came after the checkpoint)")
    assert _progress(log[:20], killed) == (20, "epoch 1 step  8/12 (redone: it came after the checkpoint)")
    assert _progress(log[:21], killed) == (21, "epoch 1 step  9/12")
    assert _progress([], None) == (0, "starting")
