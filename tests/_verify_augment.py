"""A module-level generator that a test dataset draws from (see ``_verify_pipelines``).

snaploader captures Python's, NumPy's and torch's global RNGs in each worker, not a
``random.Random`` instance kept in some module: a resumed worker finds it back at its
seed, so the augmentations after a resume differ from the uninterrupted run's.
"""

from __future__ import annotations

import random

JITTER = random.Random(1234)
