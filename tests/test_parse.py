"""The one-pass parse of a checkpoint (``_format/parse.py``): a typed, frozen
``Checkpoint``; version 2 upgraded in one place; and the bounds on a load's work
(NOTE [ checkpoint limits ]): nesting depth, logical workers, twists to replay."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import numpy as np
import pytest

import snaploader
from snaploader._format import checkpoint as _checkpoint
from snaploader._format.fingerprint import FINGERPRINT_KEYS
from snaploader._format.checkpoint import FINGERPRINT_FIELDS
from snaploader._format.parse import parse
from snaploader._rng import twist as _twist

from .test_rng_encoding import _as_older_checkpoint  # checkpoints as they were written with twist codes

from ._datasets import Augmented, Range
from ._support import generator


def _loader(logical: int | None = None, **kwargs: Any) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        Augmented(48), batch_size=3, shuffle=True, num_workers=0, generator=generator(7),
        logical_workers=logical, **kwargs,
    )


def _mid_epoch(loader: snaploader.DataLoader, batches: int) -> dict[str, Any]:
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    return state


def test_parse_gives_a_frozen_typed_checkpoint() -> None:
    state = _mid_epoch(_loader(2), 3)
    checkpoint = parse(state)
    assert (checkpoint.epoch, checkpoint.yielded, checkpoint.logical_workers, checkpoint.skip) == (0, 3, 2, 0)
    assert isinstance(checkpoint.rng_start, bytes) and checkpoint.record.in_order is True
    ledger = checkpoint.workers[0]
    assert ledger.yielded is not None and isinstance(ledger.yielded.rng, bytes)
    assert ledger.yielded_complete is ledger.yielded  # "same as yielded" is the same object
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.yielded = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        checkpoint.fingerprint["batch_size"] = 4  # type: ignore[index]


def test_every_fingerprint_key_has_a_type() -> None:
    assert set(FINGERPRINT_FIELDS) == set(FINGERPRINT_KEYS)


def test_version_2_is_upgraded_in_the_parse() -> None:
    state = _mid_epoch(_loader(), 2)
    state["version"] = 2
    del state["logical_workers"], state["skip"], state["in_order"]
    for ledger in state["workers"]:
        del ledger["worker"], ledger["skipped"]
    checkpoint = parse(_checkpoint.resign(state))
    assert (checkpoint.version, checkpoint.logical_workers, checkpoint.skip, checkpoint.record.in_order) == (2, 0, 0, True)
    assert [ledger.skipped for ledger in checkpoint.workers] == [0]


def test_a_state_nested_20000_deep_is_a_format_error_not_a_recursion_error() -> None:
    state = _mid_epoch(_loader(), 2)
    deep: Any = 0
    for _ in range(20_000):
        deep = [deep]
    state["workers"][0]["yielded"]["data"] = deep
    # checked first, so signing it (which would need the recursion) changes nothing
    with pytest.raises(snaploader.CheckpointFormatError, match="more than 100 deep"):
        _loader().load_state_dict(state)


def test_a_user_state_too_deep_to_load_is_refused_when_the_checkpoint_is_made() -> None:
    class Deep(Range):
        def state_dict(self) -> Any:
            value: Any = 0
            for _ in range(200):
                value = [value]
            return {"at": value}

        def load_state_dict(self, state: Any) -> None:
            pass

    loader = snaploader.DataLoader(Deep(8), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(snaploader.StateNotPlainDataError, match="flatten the state"):
        loader.state_dict()
    del iterator


def test_more_logical_workers_than_the_bound_are_refused_before_their_ledgers_are_read() -> None:
    state = _mid_epoch(_loader(), 1)
    state["logical_workers"] = 5000
    state["workers"] = state["workers"] * 5000
    state["next_batches"] = [None] * 5000
    with pytest.raises(snaploader.CheckpointFormatError, match=r"\['logical_workers'\] is 5000; snaploader runs at most 1024"):
        parse(_checkpoint.resign(state))
    with pytest.raises(ValueError, match="logical_workers should be an int from 0 to 1024"):
        _loader(1025)


def _twisted_to_the_bound(state: dict[str, Any]) -> dict[str, Any]:
    # every coded state of every ledger set to the most twists one code may hold
    for ledger in state["workers"]:
        blob = bytearray(base64.b64decode(ledger["yielded"]["rng"]))
        flags, at = blob[0], 1
        for part, size in enumerate(_twist.part_sizes(flags)):
            if size is None:
                continue
            if flags & (8 << part):
                blob[at : at + 4] = _twist.MAX_TWISTS.to_bytes(4, "little")
            at = len(blob) if size < 0 else at + size
        ledger["yielded"]["rng"] = base64.b64encode(bytes(blob)).decode()
    return _checkpoint.resign(state)


def test_the_twists_a_load_replays_are_bounded_in_all_before_any_is_replayed() -> None:
    # 8 logical workers x 3 codes at 2**16 twists: 1.6 million, about 2 s of replay,
    # each code within its own bound; refused by the parse, before any replay
    state = _as_older_checkpoint(_mid_epoch(_loader(8), 8))
    assert all(base64.b64decode(w["yielded"]["rng"])[0] == 0b111000 for w in state["workers"])
    with pytest.raises(snaploader.CheckpointFormatError, match=r"\['workers'\] hold RNG states 1572864 twists"):
        _loader(8).load_state_dict(_twisted_to_the_bound(state))


def test_a_torchdata_checkpoint_is_named_and_points_to_the_migration_guide() -> None:
    # the keys of torchdata's StatefulDataLoader.state_dict() (single-process iterator)
    state = {
        "_sampler_iter_state": None, "_sampler_iter_yielded": 3, "_num_yielded": 3,
        "_IterableDataset_len_called": None, "_shared_seed": None, "_index_sampler_state": None,
        "_dataset_state": None, "_iterator_finished": False,
    }
    with pytest.raises(snaploader.CheckpointFormatError, match="torchdata StatefulDataLoader.*docs/migration.md"):
        _loader().load_state_dict(state)
