"""_epoch/sampler_rngs.py: a sampler's (or batch sampler's) own generator resumes
exactly, the rest of its epoch and every later one (issue 32, item 2)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import RandomSampler, Sampler

import snaploader
from snaploader import DataLoader
from snaploader._format.checkpoint import resign

from ._datasets import Augmented
from ._object_datasets import TorchShuffled
from ._support import assert_same_stream, generator, take, through_bytes

N = 24
_TOPOLOGIES = [(0, False), (2, False), (2, True)]


class NumpyShuffled(TorchShuffled):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.g = np.random.default_rng(5)  # type: ignore[assignment]

    def __iter__(self) -> Iterator[int]:
        return iter(int(i) for i in self.g.permutation(self.n))  # type: ignore[attr-defined]


class PythonShuffled(TorchShuffled):
    """Draws lazily, one index at a time, as it is iterated."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.g = random.Random(5)  # type: ignore[assignment]

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.n):
            yield self.g.randrange(self.n)  # type: ignore[attr-defined]


class Bucketed(Sampler[list[int]]):
    """A batch sampler holding a numpy Generator: buckets of 4 in a shuffled order."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rng = np.random.default_rng(11)

    def __iter__(self) -> Iterator[list[int]]:
        buckets = [list(range(at, min(at + 4, self.n))) for at in range(0, self.n, 4)]
        for b in self.rng.permutation(len(buckets)):
            yield buckets[int(b)]

    def __len__(self) -> int:
        return -(-self.n // 4)


def _by_sampler(kind: str, workers: int, persistent: bool) -> DataLoader:
    common: dict[str, Any] = {"num_workers": workers, "persistent_workers": persistent, "generator": generator(3)}
    if kind == "batch_sampler":
        return DataLoader(Augmented(N), batch_sampler=Bucketed(N), **common)
    if kind == "torch RandomSampler":
        own = RandomSampler(range(N), generator=torch.Generator().manual_seed(9))
        return DataLoader(Augmented(N), batch_size=3, sampler=own, **common)
    sampler = {"torch": TorchShuffled, "numpy": NumpyShuffled, "python": PythonShuffled}[kind](N)
    return DataLoader(Augmented(N), batch_size=3, sampler=sampler, **common)


def _epochs(loader: DataLoader, count: int) -> list[list[Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 2-core worker-count warning, the self-check's
        return [list(loader) for _ in range(count)]


_KINDS = ["torch", "numpy", "python", "batch_sampler", "torch RandomSampler"]


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize(("workers", "persistent"), _TOPOLOGIES)
def test_a_sampler_s_own_generator_resumes_its_epoch_and_the_next(kind: str, workers: int, persistent: bool) -> None:
    expected = _epochs(_by_sampler(kind, workers, persistent), 3)
    saved = _by_sampler(kind, workers, persistent)
    assert saved.num_workers == workers and saved.persistent_workers is persistent
    _epochs(saved, 1)
    iterator = iter(saved)
    before = take(iterator, 3)
    state = through_bytes(saved.state_dict())
    del iterator
    assert "sampler_rngs" in state
    resumed = _by_sampler(kind, workers, persistent)  # built afresh: its sampler at seed again
    resumed.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [list(resumed) for _ in range(2)]
    assert not [w for w in caught if issubclass(w.category, snaploader.ResumeMismatchWarning)]
    assert_same_stream(before + got[0], expected[1], "epoch 1")
    assert_same_stream(got[1], expected[2], "epoch 2")


@pytest.mark.parametrize("kind", ["torch", "batch_sampler"])
@pytest.mark.parametrize(("workers", "persistent"), _TOPOLOGIES)
def test_a_checkpoint_between_epochs_carries_the_sampler_s_generator(kind: str, workers: int, persistent: bool) -> None:
    expected = _epochs(_by_sampler(kind, workers, persistent), 3)
    saved = _by_sampler(kind, workers, persistent)
    _epochs(saved, 2)
    state = through_bytes(saved.state_dict())
    assert state["ended"] and "sampler_rngs" in state
    resumed = _by_sampler(kind, workers, persistent)
    resumed.load_state_dict(state)
    assert_same_stream(_epochs(resumed, 1)[0], expected[2], "epoch 2")


def test_the_loader_s_own_generator_is_not_captured_twice() -> None:
    # shuffle=True: torch's RandomSampler holds the loader's generator, which rng_start
    # and rng_next carry already.
    loader = DataLoader(Augmented(N), batch_size=3, shuffle=True, generator=generator(3))
    iterator = iter(loader)
    next(iterator)
    assert "sampler_rngs" not in loader.state_dict()
    list(iterator)
    assert "sampler_rngs" not in loader.state_dict()


def test_exclude_rngs_leaves_a_sampler_s_generator_out() -> None:
    loader = DataLoader(Augmented(N), batch_size=3, sampler=TorchShuffled(N), exclude_rngs=["batch_sampler.sampler.g"])
    next(iter(loader))
    assert "sampler_rngs" not in loader.state_dict()


def _state_of(make: Callable[[], DataLoader]) -> dict[str, Any]:
    loader = make()
    iterator = iter(loader)
    take(iterator, 2)
    state = loader.state_dict()
    del iterator
    return state


def test_a_checkpoint_of_other_sampler_generators_is_a_named_error() -> None:
    state = _state_of(lambda: _by_sampler("torch", 0, False))
    sampler = TorchShuffled(N)
    sampler.g = np.random.default_rng(5)  # type: ignore[assignment]
    other = DataLoader(Augmented(N), batch_size=3, sampler=sampler, generator=generator(3))
    with pytest.raises(snaploader.CheckpointFormatError, match=r"for the sampler differ .* at batch_sampler\.sampler\.g.*The sampler \(or batch sampler\) holds"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("value", "error"),
    [(7, r"loader state\['sampler_rngs'\]"), ("not base64!", r"loader state\['sampler_rngs'\] is not valid base64"),
     ("AAAA", r"loader state\['sampler_rngs'\] is not a generator-object state"),
     # set to None, the states are gone but the key says it was written: never by a release
     (None, r"loader state\['sampler_rngs'\] is None; snaploader writes it only when")],
)
def test_a_malformed_sampler_rngs_names_the_key(value: Any, error: str) -> None:
    state = _state_of(lambda: _by_sampler("torch", 0, False))
    with pytest.raises(snaploader.CheckpointFormatError, match=error):
        _by_sampler("torch", 0, False).load_state_dict(resign({**state, "sampler_rngs": value}))


def test_a_checkpoint_without_sampler_rngs_still_loads() -> None:
    # Written before they were recorded: the sampler's generator is left as built.
    state = _state_of(lambda: _by_sampler("torch", 0, False))
    older = resign({key: value for key, value in state.items() if key != "sampler_rngs"})
    resumed = _by_sampler("torch", 0, False)
    resumed.load_state_dict(older)
    assert len(list(resumed)) == len(resumed) - 2


def test_captured_rngs_lists_the_sampler_s_generators() -> None:
    loader = _by_sampler("torch", 0, False)
    assert "batch_sampler.sampler.g" in [path for path, _ in loader.captured_rngs()]
    unbatched = DataLoader(Augmented(N), batch_size=None, sampler=TorchShuffled(N))
    assert [path for path, _ in unbatched.captured_rngs()] == ["sampler.g"]
    shuffled = DataLoader(Augmented(N), batch_size=3, shuffle=True, generator=generator(3))
    assert shuffled.captured_rngs() == []


_CHILD = """
import sys, warnings, torch
from tests.test_sampler_rngs import _by_sampler
warnings.simplefilter("ignore")
loader = _by_sampler(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "True")
loader.load_state_dict(torch.load(sys.argv[4], weights_only=True))
torch.save([list(loader), list(loader)], sys.argv[5])
"""


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, True)])
def test_a_fresh_process_resumes_the_sampler_s_order(tmp_path: Path, workers: int, persistent: bool) -> None:
    # The case: a checkpoint in epoch 1, resumed in a new process.
    expected = _epochs(_by_sampler("torch", workers, persistent), 3)
    saved = _by_sampler("torch", workers, persistent)
    _epochs(saved, 1)
    iterator = iter(saved)
    before = take(iterator, 3)
    torch.save(saved.state_dict(), tmp_path / "state.pt")
    del iterator
    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-c", _CHILD, "torch", str(workers), str(persistent), str(tmp_path / "state.pt"), str(tmp_path / "out.pt")],
        check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120,
    )
    rest, following = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same_stream(before + rest, expected[1], "epoch 1")
    assert_same_stream(following, expected[2], "epoch 2")
