"""Public exceptions and warnings go by their public name, in tracebacks and pickles."""

from __future__ import annotations

import pickle
import random
import sys
import traceback
import warnings
from typing import Any

import pytest
import torch

import snaploader

_PUBLIC = [
    snaploader.CheckpointFormatError, snaploader.CheckpointMismatchError, snaploader.WorkerCrashedError,
    snaploader.ReplayRefusedError, snaploader.StateNotPlainDataError, snaploader.ResumeMismatchWarning,
    snaploader.WorkerRespawnedWarning,
]


@pytest.mark.parametrize("kind", _PUBLIC, ids=lambda kind: kind.__name__)
def test_named_by_the_public_module_and_pickled_across_processes(kind: type[Exception]) -> None:
    assert kind.__module__ == "snaploader"
    assert getattr(snaploader, kind.__name__) is kind
    error = kind("what happened")
    shown = "".join(traceback.format_exception_only(kind, error))
    assert shown.startswith(f"snaploader.{kind.__name__}: what happened"), shown
    assert "_errors" not in shown
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is kind and str(again) == "what happened"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda s: s.pop("yielded"), r"loader state has no 'yielded' key"),
        (lambda s: s.update(yielded="x"), r"loader state\['yielded'\] should be int, got str"),
        (lambda s: s["workers"][0].update(skipped=-1), r"loader state\['workers'\]\[0\]\['skipped'\] is -1"),
    ],
    ids=["yielded-dropped", "yielded-str", "skipped-negative"],
)
def test_an_unsigned_edit_that_breaks_a_field_is_named_beside_the_digest(workers: int, edit: Any, named: str) -> None:
    # The digest alone can only say that something changed; load_state_dict names the
    # field, as snaploader inspect does, and says the digest does not match too.
    loader = snaploader.DataLoader(list(range(8)), batch_size=2, num_workers=workers)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    del iterator
    edit(state)
    with pytest.raises(snaploader.CheckpointFormatError, match=named) as caught:
        snaploader.DataLoader(list(range(8)), batch_size=2, num_workers=workers).load_state_dict(state)
    assert "['digest'] does not match" in str(caught.value)


class _SharedRng(torch.utils.data.Dataset[int]):
    """Every worker starts with the same generator object: the loader warns once both
    workers' first batches came."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return self.rng.randrange(100) + index


class _Wrapped(snaploader.DataLoader):  # type: ignore[type-arg]
    """A user's subclass whose __iter__ calls snaploader's."""

    def __iter__(self) -> Any:
        return super().__iter__()


def _warned(caught: list[warnings.WarningMessage], text: str) -> warnings.WarningMessage:
    found = [w for w in caught if text in str(w.message)]
    assert found, [str(w.message) for w in caught]
    return found[0]


def test_a_warning_points_at_the_users_next_and_iter() -> None:
    # The census's warning comes while next() takes a batch, the pin-memory one at
    # iter(): each names the line that called snaploader, however deep it arose.
    loader = snaploader.DataLoader(_SharedRng(), batch_size=2, num_workers=2, pin_memory=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iterator = iter(loader); line_iter = sys._getframe().f_lineno  # noqa: E702
        list(iterator); line_next = sys._getframe().f_lineno  # noqa: E702
    shared = _warned(caught, "in the same state")
    assert (shared.filename, shared.lineno) == (__file__, line_next)
    if not torch.accelerator.is_available():
        pinned = _warned(caught, "'pin_memory' argument is set as true")
        assert (pinned.filename, pinned.lineno) == (__file__, line_iter)


def test_a_subclass_calling_the_loader_is_the_place_warned() -> None:
    loader = _Wrapped(_SharedRng(), batch_size=2, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(iter(loader))
    assert _warned(caught, "in the same state").filename == __file__
