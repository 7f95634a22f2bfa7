"""A dataset whose own state protocol loses data: ``state_protocol=False`` resumes it
exactly by replay, and the resume self-check warns when it is resumed through its
protocol and a prefetched batch's digest was kept. With the real Hugging Face
``datasets`` package where it is installed."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

import snaploader

from ._iterable_datasets import _ShuffleBufferIterator, shard
from ._support import assert_same_stream, generator, take, through_bytes

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class _LossyBuffer(_ShuffleBufferIterator):
    """A shuffle buffer whose state, like HF's ``shuffle(buffer_size=...)``, holds the
    source position but not the buffer: a load refills the buffer from the source
    position, so the items that were in the buffer are lost."""

    def __init__(self, ids: list[int], size: int) -> None:
        super().__init__(ids, size, as_tensor=False)
        self.size = size

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        end = min(state["source"] + self.size, len(self.ids))
        self.buffer = self.ids[state["source"]: end]
        self.source = end


class LossyShuffle(IterableDataset[torch.Tensor]):
    def __init__(self, n: int, size: int = 8) -> None:
        self.n, self.size = n, size

    def __iter__(self) -> Iterator[torch.Tensor]:
        return _LossyBuffer(shard(self.n, None), self.size)


def _loader(num_workers: int, **kwargs: Any) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        LossyShuffle(120), batch_size=4, num_workers=num_workers, generator=generator(0), **kwargs
    )


def _cut(loader: snaploader.DataLoader, k: int, step_s: float = 0.0) -> tuple[list[Any], dict[str, Any]]:
    """``k`` batches with a training step of ``step_s`` after each, then the state."""
    it = iter(loader)
    head = []
    for _ in range(k):
        head.append(next(it))
        time.sleep(step_s)
    state = through_bytes(loader.state_dict())
    del it
    return head, state


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_state_protocol_false_resumes_a_lossy_protocol_exactly_by_replay(num_workers: int) -> None:
    full = list(_loader(num_workers, state_protocol=False))
    assert sorted(torch.cat(full)[:, 0].long().tolist()) == list(range(120))
    head, state = _cut(_loader(num_workers, state_protocol=False), 11)
    assert all(ledger["yielded"]["data_owner"] is None for ledger in state["workers"] if ledger["yielded"])
    loader = _loader(num_workers, state_protocol=False)
    loader.load_state_dict(state)
    with pytest.warns(UserWarning, match="because the loader was built with state_protocol=False"):
        tail = list(loader)
    assert_same_stream(head + tail, full, "replayed resume")


def test_a_lossy_protocol_resume_is_caught_by_the_self_check() -> None:
    # One worker: its next batch is taken from the pipe while the training step runs
    # (the step here is a sleep), so the checkpoint keeps its digest.
    full = list(_loader(1))
    head, state = _cut(_loader(1), 6, step_s=0.2)
    assert state["next_batches"][0] is not None
    loader = _loader(1)
    loader.load_state_dict(state)
    with pytest.warns(snaploader.ResumeMismatchWarning, match="batch 6 of epoch 0 .*shuffle buffer"):
        tail = list(loader)
    assert torch.cat(head + tail).tolist() != torch.cat(full).tolist()  # what it warned of


def test_checkpoints_of_one_setting_do_not_load_into_the_other() -> None:
    _, through_protocol = _cut(_loader(0), 3)
    with pytest.raises(snaploader.CheckpointFormatError, match="built with state_protocol=False"):
        _loader(0, state_protocol=False).load_state_dict(through_protocol)

    class DatasetState(LossyShuffle):
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    def with_dataset_state(**kwargs: Any) -> snaploader.DataLoader:
        return snaploader.DataLoader(DatasetState(120), batch_size=4, generator=generator(0), **kwargs)

    _, by_replay = _cut(with_dataset_state(state_protocol=False), 3)
    with pytest.raises(snaploader.CheckpointFormatError, match="taken with state_protocol=False resumes only"):
        with_dataset_state().load_state_dict(by_replay)
    with pytest.raises(ValueError, match="state_protocol should be True or False, got 1"):
        _loader(0, state_protocol=1)


def test_replay_refuse_names_state_protocol() -> None:
    _, state = _cut(_loader(0, state_protocol=False), 3)
    with pytest.raises(snaploader.ReplayRefusedError, match="state_protocol=False"):
        _loader(0, state_protocol=False, replay="refuse").load_state_dict(state)


# -- the real Hugging Face datasets ---------------------------------------------------


def _hf_loader(num_workers: int, **kwargs: Any) -> snaploader.DataLoader:
    datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed (pip install '.[integrations]')")
    items = datasets.Dataset.from_dict({"x": list(range(400))})
    stream = items.to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=50)
    return snaploader.DataLoader(stream, batch_size=10, num_workers=num_workers, generator=generator(0), **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.integration
def test_hf_shuffle_buffer_resumes_exactly_with_state_protocol_false(num_workers: int) -> None:
    full = [batch["x"] for batch in _hf_loader(num_workers, state_protocol=False)]
    assert sorted(torch.cat(full).tolist()) == list(range(400))
    loader = _hf_loader(num_workers, state_protocol=False, replay="allow")
    it = iter(loader)
    head = [batch["x"] for batch in take(it, 17)]
    state = through_bytes(loader.state_dict())
    del it
    resumed = _hf_loader(num_workers, state_protocol=False, replay="allow")
    resumed.load_state_dict(state)
    tail = [batch["x"] for batch in resumed]
    assert_same_stream(head + tail, full, "HF shuffle, resumed by replay")


@pytest.mark.slow
@pytest.mark.integration
def test_hf_shuffle_buffer_through_its_own_protocol_is_not_exact() -> None:
    # Why the option exists (datasets 5.2): HF's state holds no shuffle buffer, and at
    # num_workers=0 nothing was prefetched, so no digest could catch it.
    full = [batch["x"] for batch in _hf_loader(0)]
    loader = _hf_loader(0)
    it = iter(loader)
    head = [batch["x"] for batch in take(it, 17)]
    state = through_bytes(loader.state_dict())
    del it
    assert state["next_batches"] == [None]
    resumed = _hf_loader(0)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's own log line about the refilled buffer
        tail = [batch["x"] for batch in resumed]
    got = torch.cat(head + tail).tolist()
    assert got != torch.cat(full).tolist() and len(set(got)) < 400


# -- num_workers=0: the main process hosts the stream (torchdata's test suite) -------------


class _GlobalRngState(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Its state is torch's global RNG state (torchdata's DummyMapDataset): loading it
    outside the stream's RNG swap would overwrite the training loop's RNG."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        return i

    def state_dict(self) -> dict[str, Any]:
        return {"g": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["g"])


def test_inline_calls_into_the_dataset_protocol_with_the_streams_rng_swapped_in() -> None:
    # No generator: each epoch's shuffle draws from the global RNG, as in torch. A
    # checkpoint loaded between epochs must leave the loop's RNG where it was.
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(_GlobalRngState(), batch_size=2, shuffle=True)

    torch.manual_seed(0)
    first = make()
    got = [torch.cat(list(first)).tolist() for _ in range(2)]
    state = through_bytes(first.state_dict())
    resumed = make()
    loop_rng = torch.get_rng_state()
    resumed.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), loop_rng)
    got += [torch.cat(list(resumed)).tolist() for _ in range(2)]
    torch.manual_seed(0)
    uninterrupted = make()
    assert got == [torch.cat(list(uninterrupted)).tolist() for _ in range(4)]


class _EpochCounting(IterableDataset[tuple[int, int]]):
    """torchdata's GeneratorIterable: its position and epoch live on the dataset; a
    loaded position is taken up by the next __iter__, and the epoch counts up at the
    end of each pass."""

    def __init__(self, n: int) -> None:
        self.n, self.i, self.epoch = n, 0, 0
        self.resume: int | None = None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        self.i = 0
        if self.resume is not None:
            self.i, self.resume = self.resume, None
        for j in range(self.i, self.n):
            self.i += 1
            yield (j, self.epoch)
        self.i = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.resume, self.epoch = state["i"], state["epoch"]


def test_inline_a_stale_position_of_an_abandoned_iterator_does_not_override_the_checkpoint() -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(_EpochCounting(30), batch_size=None)

    original = make()
    list(original)
    state = through_bytes(original.state_dict())
    want = [list(original), list(original)]
    assert [x[1] for x in want[0]] == [1] * 30
    loader = make()
    abandoned = iter(loader)
    take(abandoned, 2)
    loader.load_state_dict(state)
    got = [list(loader), list(loader)]
    assert got == want


class _StateAfterIter(IterableDataset[int]):
    """torchdata's CountIterCallsIter: the dataset is its own iterator, and its state
    exists only once __iter__ has run."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _StateAfterIter:
        self.curr = 0
        return self

    def __next__(self) -> int:
        if self.curr >= self.n:
            raise StopIteration
        self.curr += 1
        return self.curr - 1

    def state_dict(self) -> dict[str, Any]:
        return {"curr": self.curr}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.curr = state["curr"]


def test_inline_a_dataset_whose_state_exists_only_after_iter_resumes() -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(_StateAfterIter(40), batch_size=None)

    loader = make()
    it = iter(loader)
    head = take(it, 10)
    state = through_bytes(loader.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    assert head + list(resumed) == list(range(40))
    assert list(resumed) == list(range(40))
