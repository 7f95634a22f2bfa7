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
from snaploader._format.checkpoint import resign
from snaploader._workers.selfcheck import batch_digest

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


def test_a_lossy_protocol_resume_is_caught_by_an_older_checkpoints_self_check() -> None:
    # A checkpoint of an older release, which kept the digest of the worker's next
    # batch when it had arrived (this release writes none: NOTE [ one state per
    # position ]): the restore still checks it.
    full = list(_loader(1))
    head, state = _cut(_loader(1), 6)
    assert state["next_batches"] == [None]
    state = resign({**state, "next_batches": [{"produced": 7, "digest": batch_digest(full[6])}]})
    loader = _loader(1)
    loader.load_state_dict(state)
    with pytest.warns(snaploader.ResumeMismatchWarning, match="(?s)batch 6 of epoch 0 .*shuffle buffer"):
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
    with pytest.raises(ValueError, match="state_protocol should be True, False or None, got 1"):
        _loader(0, state_protocol=1)


class _CountingMap(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset with its own state (the items it has read)."""

    def __init__(self) -> None:
        self.reads = 0

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"reads": self.reads}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reads = state["reads"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_style_checkpoint_of_one_setting_names_the_setting_in_the_other(num_workers: int) -> None:
    def loader(setting: bool) -> snaploader.DataLoader:
        return snaploader.DataLoader(_CountingMap(), batch_size=2, num_workers=num_workers, state_protocol=setting)

    for saved, loaded, says in [(True, False, "built with state_protocol=False"), (False, True, "built with state_protocol=True")]:
        _, state = _cut(loader(saved), 2)
        with pytest.raises(snaploader.CheckpointFormatError, match=says) as raised:
            loader(loaded).load_state_dict(state)
        assert f"Build the loader with state_protocol={saved}" in str(raised.value)


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
    full, resumed = _hf_cut_and_resumed(num_workers, state_protocol=False, replay="allow")
    assert sorted(torch.cat(full).tolist()) == list(range(400))
    assert_same_stream(resumed, full, "HF shuffle, resumed by replay")


def _hf_cut_and_resumed(num_workers: int, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """The uninterrupted epoch, and the epoch cut after 17 batches and resumed by a new
    loader, built with ``kwargs``."""
    full = [batch["x"] for batch in _hf_loader(num_workers, **kwargs)]
    loader = _hf_loader(num_workers, **kwargs)
    it = iter(loader)
    head = [batch["x"] for batch in take(it, 17)]
    state = through_bytes(loader.state_dict())
    del it
    resumed = _hf_loader(num_workers, **kwargs)
    resumed.load_state_dict(state)
    return full, head + [batch["x"] for batch in resumed]


@pytest.mark.slow
@pytest.mark.integration
def test_hf_shuffle_buffer_through_its_own_protocol_is_not_exact() -> None:
    # Why the default turns it off (datasets 5.2): HF's state holds no shuffle buffer,
    # and at num_workers=0 nothing was prefetched, so no digest could catch it.
    full = [batch["x"] for batch in _hf_loader(0, state_protocol=True)]
    loader = _hf_loader(0, state_protocol=True)
    it = iter(loader)
    head = [batch["x"] for batch in take(it, 17)]
    state = through_bytes(loader.state_dict())
    del it
    assert state["next_batches"] == [None]
    resumed = _hf_loader(0, state_protocol=True)
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


# -- datasets known to lose data through their own protocol ---------------------------


class BufferShuffledExamplesIterable:
    """Named and placed as Hugging Face's shuffle buffer in an IterableDataset's chain."""

    __module__ = "datasets.iterable_dataset"

    def __init__(self, inner: Any, buffer_size: int) -> None:
        self.ex_iterable = inner
        self.buffer_size = buffer_size


class _FakeHfStream(LossyShuffle):
    """What snaploader sees of ``datasets.IterableDataset(...).shuffle(buffer_size=8)``:
    the module and class names and the ``_ex_iterable`` chain (the buffer under a map)
    of an HF stream, whose protocol (here the iterator's) drops the buffered items."""

    __module__ = "datasets.iterable_dataset"

    def __init__(self, n: int, shuffled: bool = True) -> None:
        super().__init__(n, size=8)
        mapped = type("MappedExamplesIterable", (), {})()
        mapped.ex_iterable = BufferShuffledExamplesIterable(None, 8) if shuffled else None
        self._ex_iterable = mapped


def _fake_hf_loader(num_workers: int, shuffled: bool = True, **kwargs: Any) -> snaploader.DataLoader:
    return snaploader.DataLoader(
        _FakeHfStream(120, shuffled), batch_size=4, num_workers=num_workers, generator=generator(0), **kwargs
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_known_to_lose_data_is_resumed_by_replay_by_default_and_says_so(num_workers: int) -> None:
    with pytest.warns(UserWarning, match=r"shuffled through a buffer of 8 examples .* resumes it exactly by replay"):
        loader = _fake_hf_loader(num_workers)
    assert not loader.state_protocol
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = list(_fake_hf_loader(num_workers))
        head, state = _cut(_fake_hf_loader(num_workers), 11)
        resumed = _fake_hf_loader(num_workers)
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"(?s)replays .* instead of through its own state_dict\(\), because .*buffer"):
        tail = list(resumed)
    assert_same_stream(head + tail, full, "a lossy protocol, replayed by default")


def test_the_detection_is_only_for_what_is_known_and_can_be_overridden() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no announcement for any of these
        assert _fake_hf_loader(0, shuffled=False).state_protocol  # no shuffle buffer
        assert _loader(0).state_protocol  # the same protocol, not known to be lossy
        explicit = _fake_hf_loader(0, state_protocol=True)
        assert explicit.state_protocol
        assert not _fake_hf_loader(0, state_protocol=False).state_protocol
    full = list(_fake_hf_loader(0, state_protocol=True))
    head, state = _cut(_fake_hf_loader(0, state_protocol=True), 11)
    resumed = _fake_hf_loader(0, state_protocol=True)
    resumed.load_state_dict(state)
    assert torch.cat(head + list(resumed)).tolist() != torch.cat(full).tolist()  # lossy, as asked


class _RefusingState(IterableDataset[torch.Tensor]):
    """A dataset-level protocol whose state cannot be loaded back (another worker
    count's, another version's)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in shard(self.n, None):
            yield torch.tensor([float(i)])

    def state_dict(self) -> dict[str, Any]:
        return {"shards": [0]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise IndexError("list index out of range")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_restore_error_in_the_datasets_own_load_state_dict_names_it_and_the_fix(num_workers: int) -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(_RefusingState(120), batch_size=4, num_workers=num_workers, generator=generator(0))

    _, state = _cut(make(), 5)
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.raises(IndexError) as excinfo:
        list(resumed)
    note = "\n".join(excinfo.value.__notes__)
    assert "while its load_state_dict() restored _RefusingState's own state" in note
    assert "state_protocol=False" in note


class _CheckedState(_RefusingState):
    """A protocol that refuses a foreign state with snaploader's own error."""

    def __init__(self, n: int, shards: list[int]) -> None:
        super().__init__(n)
        self.shards = shards

    def state_dict(self) -> dict[str, Any]:
        return {"shards": self.shards}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["shards"] != self.shards:
            raise snaploader.CheckpointMismatchError(f"taken over shards {state['shards']}, not {self.shards}")


class _CheckedAtLoad(_CheckedState):
    """The same, with the load-time hook the loader calls in the main process."""

    def check_state(self, state: Any, owner: str) -> None:
        assert owner == "dataset"
        self.load_state_dict(state)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_that_refuses_a_state_says_why_at_load_state_dict_or_in_the_worker(num_workers: int) -> None:
    def make(shards: list[int], checks: bool) -> snaploader.DataLoader:
        dataset = (_CheckedAtLoad if checks else _CheckedState)(120, shards)
        return snaploader.DataLoader(dataset, batch_size=4, num_workers=num_workers, generator=generator(0))

    _, state = _cut(make([0], False), 5)
    with pytest.raises(snaploader.CheckpointMismatchError, match="taken over shards"):
        make([1], True).load_state_dict(state)  # check_state: before anything forks
    resumed = make([1], False)
    resumed.load_state_dict(state)
    with pytest.raises(snaploader.CheckpointMismatchError, match="taken over shards") as excinfo:
        list(resumed)
    # the dataset said why: no note guessing that its protocol is lossy
    assert "state_protocol=False" not in "\n".join(getattr(excinfo.value, "__notes__", []))
    make([0], True).load_state_dict(state)  # its own state passes


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("num_workers", [0, 2])
def test_hf_shuffle_buffer_resumes_exactly_by_default(num_workers: int) -> None:
    with pytest.warns(UserWarning, match="Hugging Face datasets"):
        _hf_loader(num_workers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, resumed = _hf_cut_and_resumed(num_workers)
    assert_same_stream(resumed, full, "HF shuffle, resumed with the defaults")


@pytest.mark.slow
@pytest.mark.integration
def test_hf_shuffle_buffer_through_its_own_protocol_at_two_workers_names_the_cause() -> None:
    loader = _hf_loader(2, state_protocol=True)
    it = iter(loader)
    take(it, 17)
    state = through_bytes(loader.state_dict())
    del it
    resumed = _hf_loader(2, state_protocol=True)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception) as excinfo:
            list(resumed)
    note = "\n".join(getattr(excinfo.value, "__notes__", []))
    assert "own load_state_dict() restored IterableDataset's own state" in note
    assert "state_protocol=False" in note

