"""The stress scripts run in a ``.[cpu]`` install (torch, numpy, cloudpickle, psutil):
each imports without pytest, hypothesis, mypy or the optional packages (torchdata
for the benchmark is optional: it says so and goes on without it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(path.name for path in (ROOT / "stress").glob("*.py") if not path.name.startswith("_"))
# What a `.[cpu]` install lacks: the test extra, the bench extra, the integrations.
ABSENT = ("pytest", "hypothesis", "mypy", "matplotlib", "torchdata", "lightning",
          "accelerate", "datasets", "albumentations")

# One process imports every script (torch is imported once: seconds), each under a name
# of its own, and reports the ones that failed.
_IMPORT = """
import importlib.util, json, sys, traceback
for name in {absent!r}:
    sys.modules[name] = None  # `import name` now raises ImportError, as if not installed
sys.path.insert(0, {root!r})
failed = {{}}
for script in {scripts!r}:
    name = "stress_" + script[:-3]
    spec = importlib.util.spec_from_file_location(name, {root!r} + "/stress/" + script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)  # the script's imports and definitions, not main()
    except BaseException:
        failed[script] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_every_stress_script_imports_in_a_cpu_install() -> None:
    assert {"fuzz_checkpoints.py", "kill_workers.py", "kill_trainer.py", "bench.py"} <= set(SCRIPTS)
    code = _IMPORT.format(absent=ABSENT, root=str(ROOT), scripts=SCRIPTS)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.splitlines()[-1])
    assert not failed, "these stress scripts need more than `.[cpu]`:\n" + "\n".join(
        f"{script}:\n{error}" for script, error in failed.items()
    )
