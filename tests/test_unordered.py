"""``in_order=False``: a slow sample no longer holds back the other workers' batches,
and a checkpoint taken at any point resumes exactly in content: every batch bit for
bit, as the uninterrupted run made it for its (worker, index), none lost or repeated;
only the interleaving across workers follows timing."""

from __future__ import annotations

import json
from types import SimpleNamespace
import time
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import snaploader
from snaploader._format.checkpoint import resign
from snaploader._state.epoch_record import EpochRecord
from snaploader.distributed.rules import require_in_order

from ._datasets import StatefulSampler
from ._support import assert_same, assert_same_stream, generator

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

N, BATCH, SLOW_S = 24, 2, 0.3


def _sample(i: int, slow: int) -> dict[str, torch.Tensor]:
    if i == slow:
        time.sleep(SLOW_S)
    info = get_worker_info()
    worker = -1 if info is None else info.id
    # drawn in the worker: the batch is exact only if its RNG state is
    return {"id": torch.tensor(i), "worker": torch.tensor(worker), "noise": torch.rand(3)}


class SlowMap(Dataset[dict[str, torch.Tensor]]):
    """Item i carries its id, the worker that made it and random noise; item ``slow``
    sleeps."""

    def __init__(self, slow: int = 0) -> None:
        self.slow = slow

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return _sample(i, self.slow)


class SlowStream(IterableDataset[dict[str, torch.Tensor]]):
    """Logical worker w of W yields items w, w + W, ... of range(N); item ``slow`` sleeps."""

    def __init__(self, slow: int = 0) -> None:
        self.slow = slow

    def __iter__(self) -> Any:
        info = get_worker_info()
        w, count = (0, 1) if info is None else (info.id, info.num_workers)
        return (_sample(i, self.slow) for i in range(w, N, count))


def _loader(iterable: bool, in_order: bool, num_workers: int = 2, **kwargs: Any) -> snaploader.DataLoader[Any]:
    if iterable:
        return snaploader.DataLoader(SlowStream(), batch_size=BATCH, num_workers=num_workers,
                                     in_order=in_order, generator=generator(7), replay="allow", **kwargs)
    kwargs.setdefault("shuffle", True)
    return snaploader.DataLoader(SlowMap(), batch_size=BATCH, num_workers=num_workers,
                                 in_order=in_order, generator=generator(7), **kwargs)


def _key(batch: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(batch["id"].tolist())


def _cut(loader: snaploader.DataLoader[Any], k: int) -> tuple[list[Any], dict[str, Any]]:
    """The first ``k`` batches of an epoch of ``loader`` and its state then, through JSON."""
    iterator = iter(loader)
    head = [next(iterator) for _ in range(k)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    return head, state


def _assert_same_content(got: list[Any], expected: list[Any], what: str) -> None:
    """The same batches bit for bit, each once, in any order: matched by sample ids."""
    keys = [_key(b) for b in got]
    assert len(set(keys)) == len(keys), f"{what}: a batch was yielded twice: {keys}"
    assert sorted(keys) == sorted(_key(b) for b in expected), f"{what}: {sorted(keys)}"
    by_key = {_key(b): b for b in expected}
    for batch in got:
        assert_same(batch, by_key[_key(batch)], f"{what} batch {_key(batch)}")


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_a_slow_sample_no_longer_blocks_and_the_content_is_torchs(iterable: bool) -> None:
    ordered = list(_loader(iterable, True))
    if not iterable:  # the fixed order is torch's; in_order=False keeps its content
        theirs = torch.utils.data.DataLoader(SlowMap(), batch_size=BATCH, num_workers=2,
                                             shuffle=True, generator=generator(7))
        assert_same_stream(ordered, list(theirs))
    got = list(_loader(iterable, False))
    slow_at = next(k for k, b in enumerate(ordered) if 0 in b["id"].tolist())
    assert slow_at <= 1
    # while the slow batch is fetched, the other worker's batches come first
    assert [_key(b) for b in got[:3]] != [_key(b) for b in ordered[:3]]
    assert next(k for k, b in enumerate(got) if 0 in b["id"].tolist()) > slow_at + 1
    _assert_same_content(got, ordered, "in_order=False epoch")


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_resume_is_exact_in_content_at_any_cut(iterable: bool) -> None:
    reference = _loader(iterable, True)
    epochs = [list(reference), list(reference)]
    loader = _loader(iterable, False)
    iterator = iter(loader)
    before: list[Any] = []
    cuts: list[tuple[list[Any], dict[str, Any]]] = []
    for k in range(len(epochs[0])):
        if k in (1, 3, 9):  # 1 and 3: while the slow batch is still being fetched
            state = json.loads(json.dumps(loader.state_dict()))
            assert state["in_order"] is False and state["yielded"] == k
            cuts.append((list(before), state))
            if k == 3:  # the slow batch is still outstanding: not the fixed order's position
                assert not any(0 in b["id"].tolist() for b in before)
        before.append(next(iterator))
    assert [_key(b) for b in before] != [_key(b) for b in epochs[0]]
    _assert_same_content(before, epochs[0], "uninterrupted in_order=False epoch")
    other = 1 if iterable else 3
    for k, (head, state) in zip((1, 3, 9), cuts):
        for num_workers in (2, other):
            resumed = _loader(iterable, False, num_workers)
            resumed.load_state_dict(state)
            tail = list(resumed)
            _assert_same_content(head + tail, epochs[0], f"cut {k}, num_workers={num_workers}")
            if num_workers == 2:  # a new epoch has the loader's own logical workers
                _assert_same_content(list(resumed), epochs[1], f"epoch after cut {k}")


def test_an_in_order_loader_resumes_an_unordered_checkpoint_in_the_fixed_order() -> None:
    ordered = list(_loader(False, True))
    head, state = _cut(_loader(False, False), 3)
    resumed = _loader(False, True)
    resumed.load_state_dict(state)
    tail = list(resumed)
    _assert_same_content(head + tail, ordered, "resumed in order")
    rest = [b for b in ordered if _key(b) not in {_key(h) for h in head}]
    assert_same_stream(tail, rest)


def test_a_stateful_sampler_resumes_from_the_first_batch_not_yielded() -> None:
    first = int(torch.randperm(N, generator=torch.Generator().manual_seed(3))[0])  # the sampler's

    def make(in_order: bool, num_workers: int = 2) -> snaploader.DataLoader[Any]:
        return snaploader.DataLoader(SlowMap(slow=first), batch_size=BATCH, num_workers=num_workers,
                                     in_order=in_order, sampler=StatefulSampler(N, 3), generator=generator(7))
    ordered = list(make(True))
    head, state = _cut(make(False), 4)
    assert first not in torch.cat([b["id"] for b in head]).tolist()  # batch 0 is still due
    resumed = make(False, 3)
    resumed.load_state_dict(state)
    _assert_same_content(head + list(resumed), ordered, "stateful sampler")


def test_a_skip_needs_a_position_in_the_fixed_order() -> None:
    _, state = _cut(_loader(False, False), 3)
    with pytest.raises(ValueError, match="in_order=False"):
        _loader(False, False).load_state_dict(state, skip=1)
    with pytest.raises(ValueError, match="in_order=False"):
        _loader(False, True).load_state_dict(state, skip_to=5)


def test_older_checkpoints_without_the_field_load_as_in_order() -> None:
    head, state = _cut(_loader(False, True, 1), 3)
    assert state["in_order"] is True
    del state["in_order"]
    resumed = _loader(False, True, 1)
    resumed.load_state_dict(_redigested(state))
    assert_same_stream(head + list(resumed), list(_loader(False, True, 1)))


def test_num_workers_0_stays_in_order() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = list(_loader(False, False, 0))
    assert_same_stream(got, list(_loader(False, True, 0)))


def _redigested(state: dict[str, Any]) -> dict[str, Any]:
    state["digest"] = resign(state)["digest"]
    return state


def test_the_consistency_checks_follow_the_in_order_field() -> None:
    head, state = _cut(_loader(False, False), 3)
    counts = [w["yielded"]["produced"] if w["yielded"] else 0 for w in state["workers"]]
    assert sum(counts) == 3 and counts != [2, 1]  # not the fixed order's position
    claimed = _redigested({**state, "in_order": True})
    with pytest.raises(snaploader.CheckpointFormatError, match="needs"):
        _loader(False, False).load_state_dict(claimed)
    too_many = json.loads(json.dumps(state))
    busy = counts.index(max(counts))
    too_many["workers"][busy]["yielded"]["produced"] = N // BATCH
    too_many["yielded"] = sum(counts) - counts[busy] + N // BATCH  # the position's count stays coherent
    with pytest.raises(snaploader.CheckpointFormatError, match="share"):
        _loader(False, False).load_state_dict(_redigested(too_many))


def test_repartitioning_refuses_a_mid_epoch_unordered_checkpoint() -> None:
    # the rule reads two fields of each parsed checkpoint
    ended, live, unordered = (
        SimpleNamespace(record=EpochRecord(in_order=o), ended=e) for o, e in ((False, True), (True, False), (False, False))
    )
    require_in_order([ended, live])  # type: ignore[list-item]
    with pytest.raises(snaploader.CheckpointMismatchError, match="in_order=False"):
        require_in_order([live, unordered])  # type: ignore[list-item]
