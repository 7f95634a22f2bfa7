"""The constructor and the behaviours torch users rely on: validation errors, len(),
timeout, pin_memory, lambdas under spawn/forkserver, exceptions from dataset code,
and cleanup when iterators and loaders go away."""

from __future__ import annotations

import gc
import os
import signal
import random
import warnings
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import BatchSampler, IterableDataset, RandomSampler, SequentialSampler

import snaploader

from ._datasets import Poisoned, PoisonError, Range, Sleepy
from ._support import assert_same_stream, generator, mp_helpers, take  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(10))


class _SizedStream(_Stream):
    def __len__(self) -> int:
        return 10


_BAD: dict[str, Callable[[], dict[str, Any]]] = {
    "shuffle_with_sampler": lambda: dict(dataset=Range(8), shuffle=True, sampler=SequentialSampler(range(8))),
    "batch_sampler_with_batch_size": lambda: dict(dataset=Range(8), batch_size=2, batch_sampler=BatchSampler(range(8), 2, False)),
    "batch_sampler_with_shuffle": lambda: dict(dataset=Range(8), shuffle=True, batch_sampler=BatchSampler(range(8), 2, False)),
    "batch_sampler_with_sampler": lambda: dict(dataset=Range(8), sampler=range(8), batch_sampler=BatchSampler(range(8), 2, False)),
    "batch_sampler_with_drop_last": lambda: dict(dataset=Range(8), drop_last=True, batch_sampler=BatchSampler(range(8), 2, False)),
    "no_batch_size_with_drop_last": lambda: dict(dataset=Range(8), batch_size=None, drop_last=True),
    "negative_workers": lambda: dict(dataset=Range(8), num_workers=-1),
    "negative_timeout": lambda: dict(dataset=Range(8), timeout=-1),
    "prefetch_without_workers": lambda: dict(dataset=Range(8), prefetch_factor=2),
    "negative_prefetch": lambda: dict(dataset=Range(8), num_workers=1, prefetch_factor=-1),
    "persistent_without_workers": lambda: dict(dataset=Range(8), persistent_workers=True),
    "context_without_workers": lambda: dict(dataset=Range(8), multiprocessing_context="spawn"),
    "unknown_context": lambda: dict(dataset=Range(8), num_workers=1, multiprocessing_context="bogus"),
    "context_of_wrong_type": lambda: dict(dataset=Range(8), num_workers=1, multiprocessing_context=3),
    "iterable_with_shuffle": lambda: dict(dataset=_Stream(), shuffle=True),
    "iterable_with_sampler": lambda: dict(dataset=_Stream(), sampler=range(3)),
    "iterable_with_batch_sampler": lambda: dict(dataset=_Stream(), batch_sampler=[[0, 1]]),
}


# The tables below are one test each: a test costs the leak check's garbage
# collections, a case microseconds.


def test_bad_arguments_raise_what_torch_raises() -> None:
    for case, make in _BAD.items():
        with pytest.raises(Exception) as theirs:
            torch.utils.data.DataLoader(**make())
        with pytest.raises(Exception) as ours:
            snaploader.DataLoader(**make())
        assert type(ours.value) is type(theirs.value), (case, ours.value, theirs.value)
        assert type(theirs.value) in (ValueError, TypeError), case


def test_setting_fixed_attributes_after_init_raises_like_torch() -> None:
    for attr in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
        theirs = torch.utils.data.DataLoader(Range(8), batch_size=2)
        ours = snaploader.DataLoader(Range(8), batch_size=2)
        with pytest.raises(Exception) as their_error:
            setattr(theirs, attr, getattr(theirs, attr))
        with pytest.raises(type(their_error.value)):
            setattr(ours, attr, getattr(ours, attr))


def test_prefetch_factor_zero_with_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch_factor"):
        snaploader.DataLoader(Range(8), num_workers=1, prefetch_factor=0)


def test_in_order_false_is_honoured_without_a_warning() -> None:
    # Only the interleaving may differ from torch's in-order stream (tests/test_unordered.py).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = snaploader.DataLoader(Range(20), batch_size=2, num_workers=2, in_order=False,
                                       shuffle=True, generator=generator(0))
    assert loader.in_order is False
    theirs = torch.utils.data.DataLoader(Range(20), batch_size=2, num_workers=2, shuffle=True,
                                         generator=generator(0))
    assert sorted(b.tolist() for b in loader) == sorted(b.tolist() for b in theirs)


def test_bad_snaploader_options_raise_value_error() -> None:
    for name, value in [
        ("snapshot_every", -2), ("snapshot_every", 1.5),
        ("snapshot_every", True), ("snapshot_every", "2"), ("replay", "never"),
        ("replay", None), ("max_worker_retries", -1), ("max_worker_retries", 2.0),
        ("max_worker_retries", False),
    ]:
        kwargs: dict[str, Any] = {name: value}
        with pytest.raises(ValueError, match=name):
            snaploader.DataLoader(Range(8), **kwargs)


def test_snaploader_options_reach_the_loader() -> None:
    loader = snaploader.DataLoader(Range(8), snapshot_every=3, replay="refuse", max_worker_retries=0)
    assert (loader.snapshot_every, loader.replay, loader.max_worker_retries) == (3, "refuse", 0)
    with pytest.raises(TypeError):  # keyword-only, after torch's arguments
        snaploader.DataLoader(Range(8), 1, None, None, None, 0, None, False, False, 0, None, None, None, 2)  # type: ignore[misc]


_LENGTHS: dict[str, Callable[[], dict[str, Any]]] = {
    "default": lambda: dict(dataset=Range(10)),
    "batch_3": lambda: dict(dataset=Range(10), batch_size=3),
    "batch_3_drop_last": lambda: dict(dataset=Range(10), batch_size=3, drop_last=True),
    "unbatched": lambda: dict(dataset=Range(10), batch_size=None),
    "num_samples": lambda: dict(dataset=Range(10), batch_size=4, sampler=RandomSampler(range(10), num_samples=23)),
    "batch_sampler": lambda: dict(dataset=Range(10), batch_sampler=BatchSampler(range(10), 4, drop_last=True)),
    "sized_iterable": lambda: dict(dataset=_SizedStream(), batch_size=3),
    "sized_iterable_drop_last": lambda: dict(dataset=_SizedStream(), batch_size=3, drop_last=True),
}


def test_len_matches_torch() -> None:
    for case, make in _LENGTHS.items():
        assert len(snaploader.DataLoader(**make())) == len(torch.utils.data.DataLoader(**make())), case


def test_len_of_an_unsized_iterable_raises_like_torch() -> None:
    with pytest.raises(TypeError):
        len(torch.utils.data.DataLoader(_Stream()))
    with pytest.raises(TypeError):
        len(snaploader.DataLoader(_Stream()))


def test_timeout_raises_when_a_worker_is_too_slow() -> None:
    loader = snaploader.DataLoader(Sleepy(4, sleep_from=2, sleep_s=5.0), batch_size=2, num_workers=1, timeout=1)
    assert loader.timeout == 1
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="timed out"):
        next(iterator)
    for pid in iterator.worker_pids:
        os.kill(pid, signal.SIGKILL)  # rather than waiting for it to wake up
    del iterator


@pytest.mark.parametrize("num_workers", [0, 1])
def test_pin_memory_without_accelerator_warns_like_torch(num_workers: int) -> None:
    assert not torch.accelerator.is_available()

    def run(cls: type[torch.utils.data.DataLoader]) -> tuple[list[Any], list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = cls(Range(9), batch_size=4, pin_memory=True, num_workers=num_workers,
                         shuffle=True, generator=generator(2))
            assert loader.pin_memory
            batches = list(loader)
        return batches, sorted({str(w.message) for w in caught if "pin_memory" in str(w.message)})

    theirs, their_warnings = run(torch.utils.data.DataLoader)
    ours, our_warnings = run(snaploader.DataLoader)
    assert their_warnings and our_warnings == their_warnings
    assert_same_stream(ours, theirs)


@pytest.mark.usefixtures("mp_helpers")
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_lambdas_work_under_spawn_and_forkserver(context: str) -> None:
    scale = 10  # a closure, not only a lambda

    def init(worker_id: int) -> None:
        random.seed(1000 + worker_id)

    loader = snaploader.DataLoader(
        Range(6), batch_size=3, num_workers=1, multiprocessing_context=context,
        collate_fn=lambda batch: [scale * i + random.randrange(10) for i in batch],
        worker_init_fn=lambda worker_id: init(worker_id),
    )
    assert loader.multiprocessing_context.get_start_method() == context
    iterator = iter(loader)
    assert iterator.runner is not None
    assert iterator.runner.pool.context.get_start_method() == context  # type: ignore[attr-defined]
    got = list(iterator)
    del iterator
    rng = random.Random(1000)
    assert got == [[scale * i + rng.randrange(10) for i in batch] for batch in ([0, 1, 2], [3, 4, 5])]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exception_in_getitem_comes_back_with_a_note_and_iteration_goes_on(num_workers: int) -> None:
    def run(cls: type[torch.utils.data.DataLoader]) -> list[Any]:
        loader = cls(Poisoned(12, bad=(7,)), batch_size=3, num_workers=num_workers)
        out: list[Any] = []
        iterator = iter(loader)
        while True:
            try:
                out.append(next(iterator))
            except StopIteration:
                return out
            except PoisonError as exc:
                out.append(exc)

    theirs, ours = run(torch.utils.data.DataLoader), run(snaploader.DataLoader)
    assert [type(x) for x in ours] == [type(x) for x in theirs]
    assert_same_stream([x for x in ours if not isinstance(x, Exception)],
                       [x for x in theirs if not isinstance(x, Exception)])
    error = ours[2]
    assert type(error) is PoisonError and str(error) == "bad sample 7"
    notes = "\n".join(getattr(error, "__notes__", []))
    where = "in the main process" if num_workers == 0 else "worker process 0"  # batch 2: 2 mod 2
    assert where in notes and "batch 2" in notes and "[6, 7, 8]" in notes
    assert "__getitem__" in notes  # the worker's traceback


def test_abandoned_iterator_leaves_no_process() -> None:
    loader = snaploader.DataLoader(Sleepy(40, sleep_from=40, sleep_s=0), batch_size=2, num_workers=2)
    iterator = iter(loader)
    take(iterator, 3)
    workers = [psutil.Process(pid) for pid in iterator.worker_pids]
    assert len(workers) == 2 and all(w.is_running() for w in workers)
    del iterator
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_deleted_loader_with_persistent_workers_leaves_no_process() -> None:
    loader = snaploader.DataLoader(Range(10), batch_size=2, num_workers=2, persistent_workers=True)
    list(loader)
    iterator = iter(loader)
    take(iterator, 1)
    workers = [psutil.Process(pid) for pid in iterator.worker_pids]
    assert len(workers) == 2
    del iterator, loader
    gc.collect()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_deleted_loader_with_persistent_workers_stops_them_without_gc() -> None:
    loader = snaploader.DataLoader(Range(10), batch_size=2, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    workers = [psutil.Process(pid) for pid in iterator.worker_pids]
    list(iterator)
    del iterator
    gc.disable()
    try:
        del loader
        _, alive = psutil.wait_procs(workers, timeout=3)
    finally:
        gc.enable()
        gc.collect()
    assert not alive


# -- torchdata's names and torch's typing --------------------------------------------


def _state_after(k: int, **options: Any) -> dict[str, Any]:
    from ._iterable_datasets import IteratorStateStream

    loader = snaploader.DataLoader(
        IteratorStateStream(n=20), batch_size=2, generator=torch.Generator().manual_seed(0), **options
    )
    take(iter(loader), k)
    return loader.state_dict()


def test_snapshot_every_n_steps_is_torchdatas_name_for_snapshot_every() -> None:
    # A torchdata user changes only the import: the option must act, not be swallowed.
    torchdata_style = _state_after(2, snapshot_every_n_steps=3)
    assert torchdata_style == _state_after(2, snapshot_every=3)
    assert torchdata_style != _state_after(2)
    assert snaploader.DataLoader(Range(4), snapshot_every_n_steps=3).snapshot_every == 3
    # torchdata's 0, "no periodic snapshots", is snaploader's 0 (tests/test_iterable.py
    # resumes from it at every cut).
    assert snaploader.DataLoader(Range(4), snapshot_every_n_steps=0).snapshot_every == 0
    assert _state_after(2, snapshot_every_n_steps=0) == _state_after(2, snapshot_every=0)


@pytest.mark.parametrize("both", [{"snapshot_every": 2}, {"snapshot_every": 1}])
def test_snapshot_every_and_its_torchdata_name_together_are_refused(both: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="were both given; they are one option.*pass only one"):
        snaploader.DataLoader(Range(4), snapshot_every_n_steps=2, **both)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_snapshot_every_n_steps_is_named(value: Any) -> None:
    with pytest.raises(ValueError, match=f"snapshot_every_n_steps should be an int >= 0, got {value!r}"):
        snaploader.DataLoader(Range(4), snapshot_every_n_steps=value)


def test_the_loader_is_generic_like_torchs() -> None:
    alias = snaploader.DataLoader[int]
    loader = alias(Range(4), batch_size=2)
    assert isinstance(loader, snaploader.DataLoader) and isinstance(loader, torch.utils.data.DataLoader)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
