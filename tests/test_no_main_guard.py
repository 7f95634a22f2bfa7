"""A script without the ``__main__`` guard under spawn: the reason comes first, and the
whole output fits a screen (each spawned worker says why in one line instead of
multiprocessing's 70-line traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_GUARDLESS = '''\
import multiprocessing
from snaploader import DataLoader

multiprocessing.set_start_method("spawn", force=True)
loader = DataLoader(list(range(8)), batch_size=2, num_workers=2)
print(sum(len(batch) for batch in loader))
'''


def test_a_guardless_script_under_spawn_says_why_first_and_briefly(tmp_path: Path) -> None:
    script = tmp_path / "guardless.py"
    script.write_text(_GUARDLESS)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 1, done.stderr[-3000:]
    assert 'no if __name__ == "__main__": guard' in lines[0], lines[:5]
    assert len(lines) <= 25, f"{len(lines)} lines:\n" + "\n".join(lines)
    assert "WorkerCrashedError" in lines[-1] and "not respawned" in lines[-1], lines[-1]
    assert not any("bootstrapping phase" in line for line in lines), "multiprocessing's traceback is back"
