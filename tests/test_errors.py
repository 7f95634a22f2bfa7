"""Public exceptions and warnings go by their public name, in tracebacks and pickles."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

import pytest

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
