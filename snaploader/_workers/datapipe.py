"""What torch's DataLoader does to a DataPipe dataset, done the same way.

torch treats ``IterDataPipe`` (and, for sharding, ``MapDataPipe``) datasets specially:

- at every ``iter()`` (and every epoch of persistent workers) the main process draws a
  *shared seed* from the loader's generator, before the workers' base seed, and under
  torch.distributed broadcasts rank 0's to every rank (:class:`SharedSeeds`);
- each worker, and at ``num_workers=0`` the main process, seeds the pipe's random parts
  (``shuffle``) from that seed (:func:`seed_graph`), so all workers shuffle alike;
- each worker shards the pipe's ``sharding_filter`` by its global worker id among
  ``num_workers * world_size`` (:func:`shard_graph`); at ``num_workers=0`` by rank
  among world size.

A pipe without ``sharding_filter`` is not sharded: every worker yields all of it, in
torch too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings

from .._format.schema import shared_seed_error
from .._rng.capture import RngSource
from .._rng.kinds import is_generator
from .._state.ledger import EpochStart


def is_iter_datapipe(dataset: Any) -> bool:
    """True when torch draws a shared seed for ``dataset`` at every ``iter()``."""
    return isinstance(dataset, IterDataPipe)


def world() -> tuple[int, int]:
    """(world size, rank) as torch's DataLoader reads them for sharding."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def seed_group() -> Any:
    """The process group the shared seed is broadcast in (None: not distributed). Made
    once per iterator, as torch does: a collective call, every rank makes it."""
    if dist.is_available() and dist.is_initialized():
        return dist.new_group(backend="gloo")
    return None


class SharedSeeds:
    """The shared seeds of one iterator's epochs (nothing for a dataset that is not an
    IterDataPipe): the draws from the loader's generator, in torch's order around the
    base seed, and the broadcast of rank 0's under torch.distributed."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.datapipe = is_iter_datapipe(dataset)
        # torch makes the group the seed is broadcast in once per iterator, a collective
        # call: every rank's loader makes one here too.
        self.group = seed_group() if self.datapipe else None

    def draw(self, source: RngSource, start: EpochStart, restoring: bool) -> int | None:
        """The epoch's seed: torch's first draw of the epoch, before the base seed. A
        restore makes the same draw, so the generator ends where it did, but keeps the
        checkpoint's seed: under torch.distributed it is rank 0's, which this rank cannot
        draw again."""
        if restoring and self.datapipe != (start.record.shared_seed is not None):
            # load_state_dict() refuses it first (_format/restore.py); an EpochStart made otherwise is held to it too
            raise shared_seed_error(start.epoch, start.record.shared_seed is not None, self.dataset)
        if not self.datapipe:
            return None
        drawn = source.draw_base_seed()  # the same draw as torch's _share_dist_seed
        if restoring and start.record.shared_seed is not None:
            return start.record.shared_seed
        if self.group is None:
            return drawn
        tensor = torch.tensor(drawn, dtype=torch.int64)
        dist.broadcast(tensor, src=0, group=self.group)
        return int(tensor.item())

    def after_base_seed(self, source: RngSource, logical: int, drew_base_seed: bool) -> None:
        """torch's worker iterator draws a second shared seed right after starting its
        workers (``_reset(first_iter=True)``) and uses it for nothing they see; the draw
        still moves the generator. Decided by the epoch's logical worker count, not
        num_workers, so that a resume with another num_workers draws as the run did.
        (Not broadcast: every rank skips the same unused collective.)"""
        if self.datapipe and logical > 0 and drew_base_seed:
            source.draw_base_seed()


def seed_graph(dataset: Any, shared_seed: int) -> None:
    """Seed the random parts of the pipe ``dataset`` from the epoch's shared seed."""
    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    graph_settings.apply_random_seed(dataset, rng)


def shard_graph(dataset: Any, worker_id: int, workers: int, world_size: int, rank: int) -> None:
    """Shard the pipe ``dataset`` for worker ``worker_id`` of ``workers`` on ``rank`` of
    ``world_size`` (``workers`` 0: the main process, sharded by rank alone). No-op for
    a dataset that is not a DataPipe."""
    if not isinstance(dataset, (IterDataPipe, MapDataPipe)):
        return
    # Distributed ranks are sharded first, then workers (torch's _sharding_worker_init_fn),
    # with the default sharding priority, as torch passes none.
    instances = max(1, workers) * world_size
    graph_settings.apply_sharding(dataset, instances, worker_id * world_size + rank)


def seeded_generators(dataset: Any) -> frozenset[int]:
    """Ids of the generators the random parts of the pipe ``dataset`` hold: seeded from
    the shared seed, they start alike in every worker by design (``_rng/objects.py``
    would otherwise warn that two workers draw the same numbers)."""
    if not is_iter_datapipe(dataset):
        return frozenset()
    graph = graph_settings.traverse_dps(dataset)
    pipes = graph_settings.get_all_graph_pipes(graph)
    return frozenset(
        id(value)
        for pipe in pipes
        if graph_settings._is_random_datapipe(pipe)
        for value in vars(pipe).values()
        if is_generator(value)
    )
