"""The epoch's record (``_state/epoch_record.py``): one frozen record of what a
checkpoint keeps of an epoch beside its position. The checkpoint's field table is
derived from it, the parse makes it whole and the build writes it whole, so a field of
the record is read, checked, carried through a restore and written back without a line
for it anywhere else."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

import snaploader
from snaploader._format.build import loaded_state, record_fields
from snaploader._format.checkpoint import ADDED_TOP, TOP_FIELDS, resign
from snaploader._format.parse import parse
from snaploader._format.restore import _expanded
from snaploader._rng.capture import RngSource
from snaploader._state.epoch_record import COLUMNS, EpochRecord

from ._datasets import Augmented
from ._support import generator

# A value other than the default for each field, that a state may hold.
_OTHER: dict[str, Any] = {
    "shared_seed": None, "sampler_epoch": 3, "in_order": False, "item_offset": 6, "epoch_length": 40, "sample_root": 5,
}


def _loader(**kwargs: Any) -> snaploader.DataLoader[Any]:
    return snaploader.DataLoader(Augmented(48), batch_size=3, shuffle=True, generator=generator(7), **kwargs)


def _mid_epoch(batches: int = 2, **kwargs: Any) -> dict[str, Any]:
    loader = _loader(**kwargs)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return json.loads(json.dumps(loader.state_dict()))


def test_the_field_table_is_the_records() -> None:
    names = [field.name for field in dataclasses.fields(EpochRecord)]
    assert [name for name, _, _ in COLUMNS] == names == list(_OTHER)
    for name, default, column in COLUMNS:
        assert TOP_FIELDS[name] == column.kinds
        assert isinstance(default, column.kinds)
        # an older file may lack a field exactly when it is not required; its absence
        # then means the default
        assert (name in ADDED_TOP) == (not column.required)
        if not column.required:
            assert ADDED_TOP[name] == default


def test_a_fresh_epoch_writes_the_records_defaults_and_no_sparse_field() -> None:
    state = _mid_epoch()
    written = {name for name, _, column in COLUMNS if not column.sparse}
    assert written <= set(state) and not {name for name, _, column in COLUMNS if column.sparse} & set(state)
    assert parse(state).record == EpochRecord()
    unbegun = snaploader.DataLoader(Augmented(48), batch_size=3).state_dict()
    assert {name: unbegun[name] for name in written} == record_fields(EpochRecord())


@pytest.mark.parametrize("name", [name for name in _OTHER if _OTHER[name] is not None])
def test_every_field_is_parsed_whole_and_written_back_as_it_was(name: str) -> None:
    # The record goes from the parse to the state a load publishes without a line of its
    # own: a field set in the file comes back out of loaded_state unchanged.
    state = _mid_epoch()
    value = _OTHER[name]
    if name == "sample_root":
        value = state["base_seed"]
    edited = resign({**state, name: value})
    checkpoint = parse(edited)
    assert getattr(checkpoint.record, name) == value
    assert checkpoint.record == dataclasses.replace(EpochRecord(), **{name: value})
    out = loaded_state(checkpoint, _expanded(checkpoint), checkpoint.skip, RngSource(generator(0)))
    assert out[name] == value
    assert {key: out[key] for key in state if key != "digest"} == {key: edited[key] for key in state if key != "digest"}


@pytest.mark.parametrize(("name", "value"), [
    ("item_offset", -1), ("epoch_length", -2), ("sampler_epoch", -1), ("item_offset", 2**62), ("shared_seed", 2**63),
])
def test_each_fields_range_is_its_columns(name: str, value: int) -> None:
    with pytest.raises(snaploader.CheckpointFormatError, match=rf"loader state\['{name}'\] is {value}"):
        parse(resign({**_mid_epoch(), name: value}))


def test_a_field_of_the_wrong_type_is_named() -> None:
    with pytest.raises(snaploader.CheckpointFormatError, match=r"loader state\['in_order'\] should be bool"):
        parse(resign({**_mid_epoch(), "in_order": 1}))


def test_an_older_file_without_an_added_field_loads_it_as_its_default() -> None:
    state = _mid_epoch()
    for name, default, column in COLUMNS:
        if column.required:
            with pytest.raises(snaploader.CheckpointFormatError, match=f"has no '{name}' key"):
                parse(resign({key: value for key, value in state.items() if key != name}))
        else:
            older = resign({key: value for key, value in state.items() if key != name})
            assert getattr(parse(older).record, name) == default


def test_a_restored_epoch_carries_the_record_into_its_next_checkpoint() -> None:
    # seed_per_sample's root comes through the restore into the next checkpoint, whose
    # record (and whole state) is the fresh run's at that position.
    kwargs: dict[str, Any] = {"seed_per_sample": True}
    state = _mid_epoch(2, **kwargs)
    fresh = _loader(**kwargs)
    iterator = iter(fresh)
    for _ in range(3):
        next(iterator)
    restored = _loader(**kwargs)
    restored.load_state_dict(state)
    resumed = iter(restored)
    next(resumed)
    after, expected = restored.state_dict(), fresh.state_dict()
    assert parse(after).record == parse(expected).record
    assert parse(after).record.sample_root == state["base_seed"]
    assert after == expected


def test_the_next_epoch_keeps_only_the_per_sample_root() -> None:
    record = EpochRecord(shared_seed=4, sampler_epoch=2, in_order=False, item_offset=6, epoch_length=40, sample_root=9)
    assert record.next_epoch() == EpochRecord(sample_root=9)
