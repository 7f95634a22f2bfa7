#!/usr/bin/env python
"""Launcher of the benchmark package ``stress/bench/`` (its docstring says what is
measured and how to read the results):

    python stress/bench.py            # the full run
    python stress/bench.py --quick    # the CI smoke test
    python stress/bench.py --out DIR  # where results go (default: bench-results/)

``python -m stress.bench`` from the repository root does the same. The package, not
this file, is what ``import stress.bench`` finds.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stress.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
