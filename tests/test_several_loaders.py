"""Several loaders at once: each loader's state is its own, and a checkpoint of all of
them taken mid-epoch resumes the combined stream exactly: two loaders consumed
alternately in a plain loop, and Lightning's ``CombinedLoader`` in ``max_size_cycle``
and ``sequential`` modes (with the real ``lightning`` package where it is installed)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import snaploader

from ._datasets import Augmented
from ._support import assert_same, assert_same_stream, generator, through_bytes

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def make_loaders() -> dict[str, snaploader.DataLoader]:
    # 10 and 4 batches an epoch; both draw augmentations in their workers.
    return {
        "a": snaploader.DataLoader(Augmented(40), batch_size=4, shuffle=True, num_workers=2, generator=generator(1)),
        "b": snaploader.DataLoader(Augmented(12), batch_size=3, shuffle=True, num_workers=0, generator=generator(2)),
    }


class Alternating:
    """A training loop's data: one batch of ``a``, then one of ``b``, ``b`` starting
    its next epoch whenever it runs out, for ``steps`` steps."""

    def __init__(self, loaders: dict[str, snaploader.DataLoader]) -> None:
        self.loaders = loaders
        self.its = {name: iter(loader) for name, loader in loaders.items()}

    def next(self, name: str) -> Any:
        try:
            return next(self.its[name])
        except StopIteration:
            self.its[name] = iter(self.loaders[name])
            return next(self.its[name])

    def steps(self, count: int) -> list[Any]:
        return [(self.next("a"), self.next("b")) for _ in range(count)]


@pytest.mark.parametrize("cut", [3, 7, 10])
def test_two_loaders_consumed_alternately_resume_exactly(cut: int) -> None:
    total = 17  # past the end of a's first epoch and of several of b's
    expected = Alternating(make_loaders()).steps(total)
    run = Alternating(make_loaders())
    head = run.steps(cut)
    state = through_bytes({name: loader.state_dict() for name, loader in run.loaders.items()})
    del run
    loaders = make_loaders()
    for name, loader in loaders.items():
        loader.load_state_dict(state[name])
    tail = Alternating(loaders).steps(total - cut)
    assert_same_stream(head + tail, expected, f"alternating, resumed after step {cut}")


def test_each_loaders_state_is_its_own() -> None:
    run = Alternating(make_loaders())
    run.steps(5)
    state = {name: loader.state_dict() for name, loader in run.loaders.items()}
    assert (state["a"]["epoch"], state["a"]["yielded"]) == (0, 5)
    assert (state["b"]["epoch"], state["b"]["yielded"]) == (1, 1)
    with pytest.raises(snaploader.CheckpointMismatchError, match="dataset_length: 12 in checkpoint / 40"):
        make_loaders()["a"].load_state_dict(state["b"])  # swapped keys do not go unnoticed


# -- Lightning's CombinedLoader ----------------------------------------------------------


def _combined(loaders: dict[str, snaploader.DataLoader], mode: str) -> Any:
    utilities = pytest.importorskip(
        "lightning.pytorch.utilities", reason="lightning is not installed (pip install '.[integrations]')"
    )
    return utilities.CombinedLoader(loaders, mode=mode)


def _steps(combined: Any, count: int | None = None, *, started: bool = False) -> list[Any]:
    """The first ``count`` steps of a new pass of ``combined`` (None: all of them).
    Calls ``iter(combined)`` once: every call restarts each loader in it (a
    CombinedLoader is its own iterator, so ``islice(iter(combined), n)``, which calls
    ``iter`` again, would start a second pass); not at all when ``started``."""
    if not started:
        iter(combined)
    out = []
    for _ in itertools.count() if count is None else range(count):
        try:
            out.append(next(combined))
        except StopIteration:
            break
    return out


def _batches(steps: list[Any]) -> list[Any]:
    return [batch for batch, _, _ in steps]


@pytest.mark.slow
@pytest.mark.parametrize("cut", [2, 5, 9])
@pytest.mark.integration
def test_combined_loader_max_size_cycle_resumes_exactly(cut: int) -> None:
    combined = _combined(make_loaders(), "max_size_cycle")
    expected = _batches(_steps(combined)) + _batches(_steps(combined))  # two epochs: 10 steps each
    assert len(expected) == 20

    loaders = make_loaders()
    combined = _combined(loaders, "max_size_cycle")
    head = _batches(_steps(combined, cut))
    state = through_bytes({"loaders": {n: l.state_dict() for n, l in loaders.items()}, "step": cut})
    del combined

    loaders = make_loaders()
    for name, loader in loaders.items():
        loader.load_state_dict(state["loaders"][name])
    combined = _combined(loaders, "max_size_cycle")
    # CombinedLoader does not save which loaders it has cycled: bound the resumed
    # epoch by its remaining steps (Lightning's Trainer counts them itself).
    iter(combined)  # len() needs it
    rest = _batches(_steps(combined, len(combined) - state["step"], started=True))
    next_epoch = _batches(_steps(combined))
    assert_same_stream(head + rest + next_epoch, expected, f"max_size_cycle resumed at step {cut}")


@pytest.mark.slow
@pytest.mark.parametrize("cut", [3, 10, 12])
@pytest.mark.integration
def test_combined_loader_sequential_resumes_exactly(cut: int) -> None:
    combined = _combined(make_loaders(), "sequential")
    expected = _steps(combined)  # a's 10 batches, then b's 4
    assert [idx for _, _, idx in expected] == [0] * 10 + [1] * 4

    loaders = make_loaders()
    combined = _combined(loaders, "sequential")
    head = _steps(combined, cut)
    _, batch_idx, dataloader_idx = head[-1]
    state = through_bytes({
        "loaders": {n: l.state_dict() for n, l in loaders.items()},
        "dataloader_idx": dataloader_idx,
        "batch_idx": batch_idx,
    })
    del combined

    loaders = make_loaders()
    for name, loader in loaders.items():
        loader.load_state_dict(state["loaders"][name])
    # CombinedLoader does not save which loader it was on: go on from that one (a
    # loader that finished its epoch would otherwise start its next epoch).
    start = state["dataloader_idx"]
    remaining = dict(list(loaders.items())[start:])
    rest = []
    for batch, batch_idx, idx in _steps(_combined(remaining, "sequential")):
        if idx == 0:
            batch_idx += state["batch_idx"] + 1  # the resumed loader's count goes on
        rest.append((batch, batch_idx, idx + start))
    assert len(head + rest) == len(expected)
    for k, (got, want) in enumerate(zip(head + rest, expected)):
        assert got[1:] == want[1:], f"step {k}: (batch_idx, dataloader_idx) {got[1:]} vs {want[1:]}"
        assert_same(got[0], want[0], f"sequential resumed at {cut}, step {k}")
    assert torch.is_tensor(rest[-1][0])
