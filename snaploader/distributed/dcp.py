"""A loader's state for ``torch.distributed.checkpoint`` (DCP): one opaque value per rank.

DCP does two things to a plain state dict that a loader's checkpoint cannot survive
(see ``docs/dcp.md``):

- it de-duplicates equal keys across ranks when it saves, keeping one rank's value, so
  ``dcp.save({"loader": loader})`` on N ranks keeps a single rank's loader state;
- it flattens nested dicts and lists of containers into one key per leaf and plans the
  load from the *target's* keys, so a fresh loader, whose checkpoint has another shape
  (no worker ledgers yet, ``None`` where a used one has a dict), cannot be loaded into.

:class:`DcpState` answers both: its state dict is ``{"rank<r>_of_<world>": json}``, one
key per rank (never de-duplicated) holding the whole checkpoint as one JSON string (a
single leaf, whatever the loader has done). The loader's own ``state_dict()`` is left
exactly as it is, so ``torch.save`` users and frameworks that call it see no change.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import torch.distributed as dist

from .._errors import CheckpointFormatError
from .._format.envelopes import loader_state_as_json, loader_state_from_json

if TYPE_CHECKING:
    from .._loader import DataLoader
    from .resharded import ReshardedLoader


def _rank_key() -> str:
    if dist.is_available() and dist.is_initialized():
        return f"rank{dist.get_rank()}_of_{dist.get_world_size()}"
    return "rank0_of_1"


class DcpState:
    """``loader``'s state as a ``torch.distributed.checkpoint`` Stateful, keyed by rank.

    Put it in the state dict given to ``dcp.save`` and ``dcp.load``::

        dcp.save({"model": model, "loader": snaploader.dcp_state(loader)}, checkpoint_id=path)
        dcp.load({"model": model, "loader": snaploader.dcp_state(loader)}, checkpoint_id=path)

    Each rank saves and restores its own loader state. The rank and world size are read
    when DCP calls :meth:`state_dict` / :meth:`load_state_dict`, so one object can be
    made before ``init_process_group``. Resuming needs the same world size: with
    another, DCP reports the rank's key (``loader.rank2_of_4``) as missing; change
    the world size with ``snaploader.distributed.reshard(dcp_states(path), ...)``.
    """

    def __init__(self, loader: DataLoader | ReshardedLoader, *, allow_mismatch: Iterable[str] = ()) -> None:
        from .._loader import DataLoader
        from .resharded import ReshardedLoader

        # A ReshardedLoader saves here too; it is resumed by reshard(dcp_states(path), ...).
        if not isinstance(loader, (DataLoader, ReshardedLoader)):
            raise TypeError(
                f"snaploader.dcp_state() takes a snaploader.DataLoader or a "
                f"snaploader.distributed.ReshardedLoader, got "
                f"{type(loader).__module__}.{type(loader).__qualname__}; build the loader "
                "with snaploader.DataLoader (same arguments as torch's)"
            )
        self.loader = loader
        self.allow_mismatch = tuple(allow_mismatch)

    def state_dict(self) -> dict[str, Any]:
        return {_rank_key(): loader_state_as_json(self.loader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Imported here: _errors is light, but keep this module free of import order.

        key = _rank_key()
        if not isinstance(state_dict, dict) or key not in state_dict:
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise CheckpointFormatError(
                f"the DCP entry for the loader has no state for {key} (it holds {found}); "
                "resume with the world size the checkpoint was saved with, and save with "
                "snaploader.dcp_state(loader), not the loader itself"
            )
        state = loader_state_from_json(state_dict[key], f"the DCP entry {key!r}", "snaploader.dcp_state(loader)")
        self.loader.load_state_dict(state, allow_mismatch=self.allow_mismatch)


def dcp_state(loader: DataLoader | ReshardedLoader, *, allow_mismatch: Iterable[str] = ()) -> DcpState:
    """``loader``'s state for ``torch.distributed.checkpoint``: a Stateful whose state
    is keyed by rank, so each rank saves and restores its own (see :class:`DcpState`).
    ``allow_mismatch`` is passed to :meth:`DataLoader.load_state_dict`."""
    return DcpState(loader, allow_mismatch=allow_mismatch)


# No leading zeros: the entry read back is named by its canonical key.
_RANK_KEY: Final = re.compile(r"rank(0|[1-9][0-9]*)_of_([1-9][0-9]*)")


def dcp_states(checkpoint_id: str, key: str = "loader") -> list[dict[str, Any]]:
    """Every rank's loader state in a filesystem DCP checkpoint saved with
    ``{key: snaploader.dcp_state(loader)}``, in rank order: what :func:`reshard` takes.
    Call it on every new rank (``dcp.load`` is collective within a process group).
    DCP reads its metadata with pickle: the directory must be trusted as a whole
    (docs/dcp.md); what the entries hold is checked here and by :func:`reshard`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    names = [
        name[len(key) + 1 :]
        for name in dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
        if name.startswith(key + ".")
    ]
    found = [match for name in names if (match := _RANK_KEY.fullmatch(name))]
    sizes = {int(match.group(2)) for match in found}
    ranks = sorted(int(match.group(1)) for match in found)
    if len(sizes) != 1 or len(found) != len(names) or ranks != list(range(len(ranks))) or len(ranks) not in sizes:
        raise CheckpointFormatError(
            f"the DCP checkpoint {checkpoint_id!r} holds under {key!r} the entries {sorted(names)}, "
            "not one 'rank<r>_of_<N>' per rank of one run; save each rank's loader with "
            f"{{{key!r}: snaploader.dcp_state(loader)}}"
        )
    target: dict[str, Any] = {key: {name: "" for name in names}}
    try:
        dcp.load(target, checkpoint_id=checkpoint_id)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointFormatError(
            f"the DCP checkpoint {checkpoint_id!r} cannot be read under {key!r} as snaploader's "
            f"JSON entries ({type(exc).__name__}: {str(exc)[:200]}); save each rank's loader "
            f"with {{{key!r}: snaploader.dcp_state(loader)}}"
        ) from None
    (size,) = sizes
    return [_entry(checkpoint_id, key, f"rank{rank}_of_{size}", target[key][f"rank{rank}_of_{size}"]) for rank in range(size)]


def _entry(checkpoint_id: str, key: str, name: str, text: Any) -> dict[str, Any]:
    where = f"the DCP checkpoint {checkpoint_id!r}'s entry {key}.{name}"
    return loader_state_from_json(text, where, "snaploader.dcp_state")
