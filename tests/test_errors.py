"""Public exceptions and warnings go by their public name, in tracebacks and pickles."""

from __future__ import annotations

import pickle
import traceback

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
