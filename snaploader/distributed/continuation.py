"""How the old run's next epoch begins, for the loaders a re-partitioning ``reshard``
builds anew (``distributed/resharded.py``): a loader made by ``make_loader`` starts
as a new loader would (epoch 0, its generator as built), and would repeat the old
run's epoch-0 draws. :class:`Continuation` is what the old run's checkpoints say of
the epoch after their own, applied to each such loader before its first ``iter()``:

- the loader's epoch counter, which names the epoch of each per-sample seed
  (``seed_per_sample``) and of the run's per-sample root (NOTE [ per-sample root ]
  in ``_rng/per_sample.py``);
- its generator's state, as the old run's would stand at that epoch's start (for the
  loader reading the rest of the interrupted epoch, that epoch's ``rng_start``: its
  base seed is then the old run's for the epoch): the
  checkpoint's ``rng_next`` between epochs, or mid-epoch its ``rng_start`` with the
  epoch's own draws from it replayed (the base seed; torch's DistributedSampler draws
  nothing from the loader's generator). So the next epoch's base seed is the old
  run's when it drew one (not with persistent workers, whose epochs after the first
  draw none and carry RNG states no new worker has). New rank j continues old rank
  ``j mod N``'s generator; they are all one when every rank's generator had the same
  seed. With no generator (torch's global RNG), the training loop's RNG draws as
  always and nothing is set.

Plain data (``to_plain``/``from_plain``), part of a re-partition's source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CheckpointFormatError
from .._format import plain as _plain
from .._format.checkpoint import Checkpoint
from .._loader import DataLoader
from .._rng.capture import RngSource
from .._state.epoch_record import EpochRecord
from .._state.ledger import EpochStart


@dataclass(frozen=True)
class Continuation:
    """The old run's next epoch: after its epoch ``epoch`` (-1: none begun), with the
    run's per-sample root, from the generator states ``rngs`` (one per old rank, or
    one for all; empty: torch's global RNG)."""

    epoch: int
    sample_root: int | None
    rngs: tuple[bytes, ...]
    # during an epoch: each old rank's generator state at its start (rng_start), which
    # the loader reading the rest of it starts from, as rngs are (empty: none)
    starts: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, checkpoints: Sequence[Checkpoint]) -> Continuation:
        """What the N checkpoints of one world (one step, one epoch) say of the epoch after theirs."""
        first = checkpoints[0]
        roots = {c.base_seed if c.record.sample_root is None else c.record.sample_root for c in checkpoints}
        root = roots.pop() if first.epoch >= 0 and first.fingerprint.get("seed_per_sample", False) and len(roots) == 1 else None
        under_way = first.epoch >= 0 and not first.ended
        starts = _one_each([c.rng_start if c.rng_kind == "generator" else None for c in checkpoints]) if under_way else ()
        return cls(first.epoch, root, _one_each([_next_state(c) for c in checkpoints]), starts)

    def apply(self, loader: DataLoader[Any], rank: int, *, rest: bool = False) -> None:
        """Make ``loader``'s next ``iter()`` the old run's next epoch, for new rank
        ``rank``; with ``rest``, the interrupted epoch itself (its rest, read anew)."""
        # What load_state_dict() of a checkpoint taken between epochs sets; the loader's
        # own record of a next epoch (``_pending``), set here rather than through a
        # checkpoint: none of this loader's can say "after epoch E of another run".
        states = self.starts if rest else self.rngs
        if states and loader.generator is not None:
            RngSource(loader.generator).set_state(states[rank % len(states)])
        epoch = self.epoch if rest else self.epoch + 1
        root = self.sample_root if loader._snaploader_options.seed_per_sample else None
        loader._pending = EpochStart(epoch=max(0, epoch), record=EpochRecord(sample_root=root))

    def to_plain(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "sample_root": self.sample_root,
            "rngs": [_plain.b64(state) for state in self.rngs], "starts": [_plain.b64(state) for state in self.starts],
        }

    @classmethod
    def from_plain(cls, plain: Any, where: str, ranks: int) -> Continuation:
        """The continuation ``plain`` describes, every field checked (``ranks``: the old world's size)."""
        if not isinstance(plain, dict) or set(plain) != {"epoch", "sample_root", "rngs", "starts"}:
            raise CheckpointFormatError(f"{where} should be a dict of 'epoch', 'sample_root', 'rngs' and 'starts'")
        epoch, root = plain["epoch"], plain["sample_root"]
        if type(epoch) is not int or not -1 <= epoch < 2**62:
            raise CheckpointFormatError(f"{where}['epoch'] should be an int from -1 to 2**62, got {epoch!r:.60}")
        if root is not None and (type(root) is not int or not 0 <= root < 2**63):
            raise CheckpointFormatError(f"{where}['sample_root'] should be None or an int in [0, 2**63), got {root!r:.60}")
        return cls(epoch, root, _states(plain["rngs"], f"{where}['rngs']", ranks), _states(plain["starts"], f"{where}['starts']", ranks))


def _one_each(states: Sequence[bytes | None]) -> tuple[bytes, ...]:
    """One generator state per old rank, or one for all when they agree; none when
    some rank has none (torch's global RNG)."""
    if not states or any(state is None for state in states):
        return ()
    out = tuple(state for state in states if state is not None)
    return out[:1] if len(set(out)) == 1 else out


def _states(texts: Any, where: str, ranks: int) -> tuple[bytes, ...]:
    if not isinstance(texts, list) or len(texts) not in (0, 1, ranks):
        raise CheckpointFormatError(f"{where} should be a list of 0, 1 or {ranks} generator states")
    states = []
    for i, text in enumerate(texts):
        inner = f"{where}[{i}]"
        try:
            if type(text) is not str:
                raise ValueError(f"{inner} is not a str")
            state = _plain.unb64(text, inner)
            RngSource.check_state(state)
        except ValueError as exc:
            raise CheckpointFormatError(f"{inner} is not a generator state: {exc}") from None
        states.append(state)
    return tuple(states)


def continued(loader: DataLoader[Any], after: Continuation | None, rank: int, *, rest: bool = False) -> DataLoader[Any]:
    """``loader``, made to start the old run's next epoch (``rest``: the rest of the
    interrupted one); None: a source that predates the record, left as a new loader."""
    if after is not None:
        after.apply(loader, rank, rest=rest)
    return loader


def read_to_end(loader: DataLoader[Any]) -> bool:
    """Whether ``loader``, reading the rest of an interrupted epoch, has yielded all of
    it (its next ``iter()`` would be an epoch of its own, not the old run's next)."""
    state = loader.state_dict()
    return bool(state["ended"]) and state["epoch"] >= 0


def _next_state(checkpoint: Checkpoint) -> bytes | None:
    """The state the old rank's generator starts the epoch after the checkpoint's from."""
    if checkpoint.rng_kind != "generator":
        return None
    if checkpoint.ended or checkpoint.rng_start is None:
        return checkpoint.rng_next
    source = RngSource(torch.Generator())
    source.set_state(checkpoint.rng_start)
    if checkpoint.drew_base_seed:
        source.draw_base_seed()
    return source.get_state()
