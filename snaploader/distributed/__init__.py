"""Changing the world size at resume (``docs/elastic.md``, "Changing the world size"):
the checkpoints of an N-rank run with torch's ``DistributedSampler``, resumed on M ranks,
and a loader's state for ``torch.distributed.checkpoint``.

- ``rules.py``: the bookkeeping, pure (which old ranks a new rank hosts, which samples
  each new rank reads for the rest of an interrupted epoch).
- ``resharded.py``: the loaders built from those rules (:func:`reshard`).
- ``dcp.py``: one opaque value per rank for DCP (:func:`snaploader.dcp_state`,
  :func:`dcp_states`).
"""

from .dcp import dcp_states
from .resharded import RemainderSampler, ReshardedLoader, concat, reshard

__all__ = ["RemainderSampler", "ReshardedLoader", "concat", "dcp_states", "reshard"]
