"""snaploader.distributed: the checkpoints of N DistributedSampler ranks resumed on M
(docs/elastic.md, "Changing the world size").

Most of it runs in one process, the N old ranks simulated by loaders over
``DistributedSampler(num_replicas=N, rank=r)``; the ``integration`` tests at the end
run the old and new worlds as gloo ranks on loopback (``tests/_world_child.py``)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DistributedSampler, RandomSampler

import snaploader
from snaploader._format.checkpoint import resign
from snaploader.distributed.rules import Source, remaining, share
from snaploader.distributed import concat, reshard

from ._datasets import Augmented
from ._support import assert_same, assert_same_stream, free_port, take, through_bytes

_EPOCH = 2  # the interrupted epoch's sampler epoch: not 0, so the epoch is really read
_ROOT = Path(__file__).resolve().parents[1]
_CHILD_TIMEOUT_S = 120


def _factory(
    n: int, batch_size: int = 3, drop_last: bool = False, num_workers: int = 0, per_sample: bool = False, seed: int = 1
) -> Callable[[Any], Any]:
    dataset = Augmented(n)

    def make_loader(sampler: Any) -> snaploader.DataLoader[Any]:
        return snaploader.DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
            drop_last=drop_last, generator=torch.Generator().manual_seed(seed), seed_per_sample=per_sample,
        )

    return make_loader


class OldRun(NamedTuple):
    states: list[dict[str, Any]]  # per rank, after ``cut`` batches of the epoch
    consumed: list[list[torch.Tensor]]  # per rank, the batches before the cut
    rest: list[list[torch.Tensor]]  # per rank, the batches after it
    following: list[list[torch.Tensor]]  # per rank, the next epoch


def _old_run(make_loader: Callable[[Any], Any], n: int, size: int, cut: int, sampler_drop_last: bool = False) -> OldRun:
    run = OldRun([], [], [], [])
    for rank in range(size):
        sampler = DistributedSampler(Augmented(n), num_replicas=size, rank=rank, shuffle=True, seed=5, drop_last=sampler_drop_last)
        loader = make_loader(sampler)
        sampler.set_epoch(_EPOCH)
        iterator = iter(loader)
        run.consumed.append(take(iterator, cut))
        run.states.append(through_bytes(loader.state_dict()))
        run.rest.append(list(iterator))
        sampler.set_epoch(_EPOCH + 1)
        run.following.append(list(loader))
    return run


def _new_run(states: list[dict[str, Any]], make_loader: Callable[[Any], Any], size: int) -> tuple[list[list[Any]], list[list[Any]]]:
    rest, following = [], []
    for rank in range(size):
        loader = reshard(states, make_loader, rank=rank, world_size=size)
        assert loader.epoch == _EPOCH
        loader.set_epoch(_EPOCH)
        rest.append(list(loader))
        loader.set_epoch(_EPOCH + 1)
        following.append(list(loader))
    return rest, following


def _cut_new_world(
    states: list[dict[str, Any]], make_loader: Callable[[Any], Any], size: int, cut: int
) -> tuple[list[list[Any]], list[dict[str, Any]], list[Iterator[Any]]]:
    """Each of ``size`` new ranks resharded from ``states`` and read ``cut`` batches on:
    the batches, the new ranks' states (through torch.save and JSON), their iterators."""
    new = [reshard(states, make_loader, rank=j, world_size=size) for j in range(size)]
    iterators = [iter(loader) for loader in new]
    taken = [take(iterator, cut) for iterator in iterators]
    saved = [json.loads(json.dumps(through_bytes(loader.state_dict()))) for loader in new]
    return taken, saved, iterators


def _global(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    assert len({len(batches) for batches in per_rank}) == 1, [len(b) for b in per_rank]
    return [torch.cat(step) for step in zip(*per_rank)]


def _ids(per_rank: list[list[torch.Tensor]]) -> list[int]:
    return [int(i) for batches in per_rank for batch in batches for i in batch[:, 0].tolist()]


# -- hosting: M divides N ------------------------------------------------------------


@pytest.mark.parametrize("new_size", [1, 2, 4])
def test_hosting_keeps_the_global_batches_bit_for_bit(new_size: int) -> None:
    make_loader = _factory(40)
    old = _old_run(make_loader, 40, 4, cut=1)
    rest, following = _new_run(old.states, make_loader, new_size)
    assert_same_stream(_global(rest), _global(old.rest), "rest of the interrupted epoch")
    assert_same_stream(_global(following), _global(old.following), "the next epoch")


def test_a_hosting_checkpoint_reshards_again() -> None:
    make_loader = _factory(48)
    old = _old_run(make_loader, 48, 4, cut=1)
    taken, saved, _ = _cut_new_world(old.states, make_loader, 2, 1)
    assert [len(state["loaders"]) for state in saved] == [2, 2]
    # back onto 4 ranks: each hosts its own logical rank, the old stream goes on
    back, _ = _new_run(saved, make_loader, 4)
    assert_same_stream(_global(back), _global(old.rest)[1:], "4 -> 2 -> 4")
    # onto 3: re-partitioned, nothing lost or repeated
    spread, _ = _new_run(saved, make_loader, 3)
    seen = _ids(old.consumed) + [int(i) for t in taken for b in t for i in b[:, 0].tolist()] + _ids(spread)
    assert sorted(seen) == list(range(48))


def test_hosting_needs_the_ranks_at_one_step() -> None:
    make_loader = _factory(40)
    behind = _old_run(make_loader, 40, 4, cut=1).states
    ahead = _old_run(make_loader, 40, 4, cut=2).states
    with pytest.raises(ValueError, match=r"same step.*rank 2: 2 batches of epoch 0"):
        reshard(behind[:2] + ahead[2:], make_loader, rank=0, world_size=2)
    # re-partitioning does not need it: each old rank's rest is its own
    rest, _ = _new_run(behind[:2] + ahead[2:], make_loader, 3)
    assert len(_ids(rest)) == 40 - 4 * 3 - 2 * 3


# -- re-partition: M does not divide N ------------------------------------------------


@pytest.mark.parametrize(
    ("n", "old_size", "new_size", "batch_size", "drop_last", "sampler_drop_last"),
    [
        (40, 4, 3, 3, False, False),
        (38, 4, 3, 3, False, False),  # DistributedSampler pads 2 repeats
        (38, 4, 3, 3, False, True),  # ... or drops 2 samples
        (40, 2, 4, 4, False, False),
        (41, 3, 2, 4, True, False),
    ],
)
def test_repartition_loses_and_repeats_no_sample(
    n: int, old_size: int, new_size: int, batch_size: int, drop_last: bool, sampler_drop_last: bool
) -> None:
    make_loader = _factory(n, batch_size, drop_last)
    old = _old_run(make_loader, n, old_size, cut=1, sampler_drop_last=sampler_drop_last)
    rest, following = _new_run(old.states, make_loader, new_size)
    # what the old run yields of the epoch, each sample once (padding repeats aside)
    expected = sorted(set(_ids(old.consumed) + _ids(old.rest)))
    assert sorted(_ids(old.consumed) + _ids(rest)) == expected
    counts = [len(batches) for batches in rest]
    assert max(counts) - min(counts) <= 1, counts
    for rank, batches in enumerate(following):
        sampler = DistributedSampler(Augmented(n), num_replicas=new_size, rank=rank, shuffle=True, seed=5, drop_last=sampler_drop_last)
        sampler.set_epoch(_EPOCH + 1)
        order = list(sampler)
        assert _ids([batches]) == order[: len(order) // batch_size * batch_size if drop_last else None]


def test_a_checkpoint_taken_during_a_repartitioned_epoch_resumes_on_its_world_size() -> None:
    make_loader = _factory(40)
    old = _old_run(make_loader, 40, 4, cut=1)
    taken, saved, iterators = _cut_new_world(old.states, make_loader, 3, 2)
    expected = [list(iterator) for iterator in iterators]
    for rank in range(3):
        resumed = reshard(saved, make_loader, rank=rank, world_size=3)
        assert_same_stream(list(resumed), expected[rank], f"rank {rank}")
    assert sorted(_ids(old.consumed) + _ids(taken) + _ids(expected)) == list(range(40))
    # saved before its first batch, a new rank still owes its whole share
    untouched = [reshard(old.states, make_loader, rank=j, world_size=3).state_dict() for j in range(3)]
    shares = [list(reshard(untouched, make_loader, rank=j, world_size=3)) for j in range(3)]
    assert_same_stream(shares[1], taken[1] + expected[1], "rank 1 from a state saved before its first batch")
    with pytest.raises(ValueError, match=r"re-partitioned onto \[3\] rank.*only on the same world size.*world_size=2"):
        reshard(saved, make_loader, rank=0, world_size=2)


def test_between_epochs_the_new_world_starts_the_next_epoch() -> None:
    make_loader = _factory(24)
    ended = []
    for rank in range(4):
        sampler = DistributedSampler(Augmented(24), num_replicas=4, rank=rank, shuffle=True, seed=5)
        loader = make_loader(sampler)
        sampler.set_epoch(_EPOCH)
        list(loader)
        ended.append(loader.state_dict())
    loader = reshard(ended, make_loader, rank=1, world_size=3)
    assert loader.mode == "repartition" and loader.epoch == _EPOCH + 1
    sampler = DistributedSampler(Augmented(24), num_replicas=3, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(_EPOCH + 1)
    assert _ids([list(loader)]) == list(sampler)


# -- the pure rules, over many configurations ------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 60), old_size=st.integers(1, 6), new_size=st.integers(1, 7),
    batch_size=st.integers(1, 5), drop_last=st.booleans(), sampler_drop_last=st.booleans(),
    data=st.data(),
)
def test_the_rest_of_an_epoch_is_dealt_out_whole(
    n: int, old_size: int, new_size: int, batch_size: int, drop_last: bool, sampler_drop_last: bool, data: st.DataObject
) -> None:
    per_rank = (n // old_size if sampler_drop_last else -(-n // old_size))
    batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    cut = data.draw(st.integers(0, batches))
    source = Source(old_size, True, 3, sampler_drop_last, n, batch_size, drop_last, 4, (cut,) * old_size)
    pool = remaining(source)
    yielded = []
    for rank in range(old_size):
        sampler = DistributedSampler(range(n), num_replicas=old_size, rank=rank, seed=3, drop_last=sampler_drop_last)  # type: ignore[arg-type]
        sampler.set_epoch(4)
        order = list(sampler)
        yielded += order[: (len(order) // batch_size * batch_size if drop_last else len(order))][: cut * batch_size]
    whole_epoch = set(yielded) | set(pool)
    assert len(pool) == len(set(pool)) and not set(pool) & set(yielded)
    shares = [share(pool, batch_size, rank, new_size) for rank in range(new_size)]
    assert sorted(i for s in shares for i in s) == sorted(pool)
    counts = [-(-len(s) // batch_size) for s in shares]
    assert max(counts) - min(counts) <= 1
    if not drop_last and not sampler_drop_last:
        assert whole_epoch == set(range(n))


# -- errors that say what to do -------------------------------------------------------


def test_what_cannot_be_resharded_is_named() -> None:
    make_loader = _factory(40)
    states = _old_run(make_loader, 40, 4, cut=1).states
    with pytest.raises(ValueError, match=r"4-rank run, but ranks \[3\] are missing"):
        reshard(states[:3], make_loader, rank=0, world_size=2)
    with pytest.raises(snaploader.CheckpointMismatchError, match="rank 1's checkpoint is given twice"):
        reshard(states + states[1:2], make_loader, rank=0, world_size=2)
    with pytest.raises(snaploader.CheckpointMismatchError, match="built differently"):
        reshard(states[:2] + _old_run(_factory(41), 41, 4, cut=1).states[2:], make_loader, rank=0, world_size=2)
    shuffled = snaploader.DataLoader(Augmented(40), batch_size=3, sampler=RandomSampler(Augmented(40)))
    take(iter(shuffled), 1)
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"sampler 'RandomSampler'.*DistributedSampler"):
        reshard([shuffled.state_dict()], make_loader, rank=0, world_size=2)
    older = json.loads(json.dumps(states[0]))
    del older["fingerprint"]["distributed"]
    older["digest"] = resign(older)["digest"]
    with pytest.raises(snaploader.CheckpointMismatchError, match="did not record the DistributedSampler"):
        reshard([older, *states[1:]], make_loader, rank=0, world_size=2)
    with pytest.raises(snaploader.CheckpointFormatError, match="checkpoint 2 of the list: loader state.*digest"):
        reshard(states[:2] + [{**states[2], "yielded": 0}] + states[3:], make_loader, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank=2 and world_size=2"):
        reshard(states, make_loader, rank=2, world_size=2)
    with pytest.raises(TypeError, match="sampler=<the sampler it is given>"):
        reshard(states, lambda sampler: make_loader(None), rank=0, world_size=2)


def test_mixed_epochs_are_refused() -> None:
    make_loader = _factory(40)
    states = _old_run(make_loader, 40, 4, cut=1).states
    sampler = DistributedSampler(Augmented(40), num_replicas=4, rank=3, shuffle=True, seed=5)
    loader = make_loader(sampler)
    sampler.set_epoch(_EPOCH)
    list(loader)
    take(iter(loader), 1)
    with pytest.raises(ValueError, match=r"different epochs.*rank 3: epoch 1"):
        reshard(states[:3] + [loader.state_dict()], make_loader, rank=0, world_size=3)


def test_a_rank_loads_only_its_own_checkpoint() -> None:
    make_loader = _factory(40)
    states = _old_run(make_loader, 40, 4, cut=1).states
    loader = make_loader(DistributedSampler(Augmented(40), num_replicas=4, rank=0, shuffle=True, seed=5))
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"distributed: .*'rank': 1.*'rank': 0"):
        loader.load_state_dict(states[1])
    loader.load_state_dict(states[1], allow_mismatch=("distributed",))


def test_a_checkpoint_without_the_sampler_arguments_still_loads() -> None:
    make_loader = _factory(40)
    old = _old_run(make_loader, 40, 4, cut=1)
    state = json.loads(json.dumps(old.states[2]))
    del state["fingerprint"]["distributed"]
    state["digest"] = resign(state)["digest"]
    loader = make_loader(DistributedSampler(Augmented(40), num_replicas=4, rank=2, shuffle=True, seed=5))
    loader.load_state_dict(state)
    assert_same_stream(list(loader), old.rest[2])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_states_reads_every_rank_and_says_what_is_wrong(tmp_path: Path) -> None:
    old = _old_run(_factory(40), 40, 2, cut=1)
    entries = {f"rank{r}_of_2": json.dumps(state) for r, state in enumerate(old.states)}
    dcp.save({"loader": entries}, checkpoint_id=str(tmp_path / "ok"))
    assert snaploader.distributed.dcp_states(str(tmp_path / "ok")) == old.states
    dcp.save({"loader": {"rank0_of_2": "{}"}}, checkpoint_id=str(tmp_path / "half"))
    with pytest.raises(snaploader.CheckpointFormatError, match=r"\['rank0_of_2'\], not one 'rank<r>_of_<N>' per rank"):
        snaploader.distributed.dcp_states(str(tmp_path / "half"))
    resharded = reshard(old.states, _factory(40), rank=0, world_size=1)
    saved = snaploader.dcp_state(resharded).state_dict()
    assert json.loads(saved["rank0_of_1"]) == resharded.state_dict()
    with pytest.raises(TypeError, match="resumed by snaploader.distributed.reshard"):
        snaploader.dcp_state(resharded).load_state_dict(saved)


# -- concat ---------------------------------------------------------------------------


class Pair(NamedTuple):
    x: torch.Tensor
    names: list[str]


def test_concat_joins_what_default_collate_makes() -> None:
    a = {"x": torch.arange(2), "pair": Pair(torch.ones(2), ["a", "b"]), "arr": np.zeros(2), "t": (torch.zeros(1), ["c"])}
    b = {"x": torch.arange(2, 4), "pair": Pair(torch.zeros(1), ["c"]), "arr": np.ones(1), "t": (torch.ones(1), ["d"])}
    joined = concat([a, b])
    assert_same(joined["x"], torch.arange(4))
    assert isinstance(joined["pair"], Pair) and joined["pair"].names == ["a", "b", "c"]
    assert_same(joined["t"], (torch.tensor([0.0, 1.0]), ["c", "d"]))
    assert joined["arr"].tolist() == [0.0, 0.0, 1.0]
    assert concat([a]) is a
    with pytest.raises(TypeError, match="combine=list"):
        concat([object(), object()])


# -- multi-process: gloo ranks on loopback ---------------------------------------------


def _world(phase: str, size: int, old_size: int, out: Path, per_sample: bool = False, new_batch: int = 0) -> list[Any]:
    port = free_port()
    flag = {"SNAPLOADER_TEST_PER_SAMPLE": "1" if per_sample else "0", "SNAPLOADER_TEST_NEW_BATCH": str(new_batch)}
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._world_child", phase, str(rank), str(size), str(old_size), str(port), str(out)],
            cwd=_ROOT, env=dict(os.environ, PYTHONPATH=str(_ROOT), OMP_NUM_THREADS="1", **flag), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(size)
    ]
    logs = []
    try:
        logs = [child.communicate(timeout=_CHILD_TIMEOUT_S)[0] for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    for rank, (child, log) in enumerate(zip(children, logs)):
        assert child.returncode == 0, f"rank {rank} of the {phase} run on {size} ranks failed:\n{log[-4000:]}"
    suffix = f"_b{new_batch}" if new_batch else ""
    return [torch.load(out / f"{phase}{size}{suffix}_{rank}.pt", weights_only=True) for rank in range(size)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("four")
    return out, _world("save", 4, 4, out)


def _check_repartitioned(saved: list[Any], resumed: list[Any]) -> None:
    consumed = [r["consumed"] for r in saved]
    expected = sorted(set(_ids(consumed) + _ids([r["rest"] for r in saved])))
    assert sorted(_ids(consumed) + _ids([r["rest"] for r in resumed])) == expected


@pytest.mark.integration
def test_four_ranks_hosted_on_two_keep_the_global_batches(four_ranks: tuple[Path, list[Any]]) -> None:
    out, saved = four_ranks
    resumed = _world("load", 2, 4, out)
    for part in ("rest", "following"):
        assert_same_stream(_global([r[part] for r in resumed]), _global([r[part] for r in saved]), part)
    # hosting goes on with the 4-rank stream, DistributedSampler's 2 padding repeats too
    seen = _ids([r["consumed"] for r in saved]) + _ids([r["rest"] for r in resumed])
    assert len(seen) == 64 and set(seen) == set(range(62))


@pytest.mark.integration
def test_four_ranks_repartitioned_on_three_lose_and_repeat_nothing(four_ranks: tuple[Path, list[Any]]) -> None:
    out, saved = four_ranks
    _check_repartitioned(saved, _world("load", 3, 4, out))


@pytest.mark.integration
def test_two_ranks_repartitioned_on_four_lose_and_repeat_nothing(tmp_path: Path) -> None:
    saved = _world("save", 2, 2, tmp_path)
    _check_repartitioned(saved, _world("load", 4, 2, tmp_path))


# -- re-partitioning checks what hosting checks ------------------------------------


def _resigned_outer(state: dict[str, Any]) -> dict[str, Any]:
    from snaploader._format.checkpoint import sha256_of

    body = {key: value for key, value in state.items() if key != "digest"}
    return {**body, "digest": "sha256:" + sha256_of(body)}


def test_repartitioning_refuses_a_grown_dataset_and_an_inconsistent_position() -> None:
    old = _old_run(_factory(40), 40, 4, cut=1)
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"(?s)rank 0's checkpoint: .*dataset_length: 40 in checkpoint / 48"):
        reshard(old.states, _factory(48), rank=0, world_size=3)
    # re-signed positions that hosting refuses: yielded alone, and yielded with the
    # ledger past the end of a rank's 4-batch epoch (which only the loader can tell)
    for produced, error in ((None, r"\['yielded'\] is 5, but the workers produced 1"), (5, r"\['yielded'\] is 5 for an epoch of 4")):
        edited = json.loads(json.dumps(old.states))
        edited[1]["yielded"] = 5
        if produced is not None:
            edited[1]["workers"][0]["yielded"]["produced"] = produced
        with pytest.raises(snaploader.CheckpointFormatError, match=error):
            reshard([*edited[:1], resign(edited[1]), *edited[2:]], _factory(40), rank=0, world_size=3)


@pytest.mark.parametrize(
    "edit, error",
    [
        (("batch_size", 0), r"\['batch_size'\] is 0; expected >= 1"),
        (("dataset_length", None), r"\['dataset_length'\] is None, but a DistributedSampler"),
        (("distributed", "seed", 2**70), r"\['seed'\] is 1180591620717411303424; torch seeds fit in 64 bits"),
        (("distributed", "num_replicas", 2**40), r"ranks \[4, 5, .* more are missing"),
    ],
)
def test_a_resigned_fingerprint_edit_is_a_named_error_when_repartitioning(edit: tuple[Any, ...], error: str) -> None:
    states = json.loads(json.dumps(_old_run(_factory(40), 40, 4, cut=1).states))
    for state in states:
        target = state["fingerprint"]
        for key in edit[:-2]:
            target = target[key]
        target[edit[-2]] = edit[-1]
    with pytest.raises(ValueError, match=error) as raised:
        reshard([resign(state) for state in states], _factory(40), rank=0, world_size=3)
    assert "num_replicas" in str(edit) or isinstance(raised.value, snaploader.CheckpointFormatError)


@pytest.mark.parametrize(
    "key, value, error",
    [
        ("dataset_length", 48, r"dataset_length: 48 in checkpoint / 40 in this loader"),
        ("batch_size", 2, r"batch_size: 2 in checkpoint / 3 in this loader"),
        ("consumed", [-1, 1, 1, 1], r"\['consumed'\]\[0\] is -1; expected an int from 0 to 4"),
        ("consumed", [9, 1, 1, 1], r"\['consumed'\]\[0\] is 9; expected an int from 0 to 4"),
        ("seed", 2**70, r"\['seed'\] is .*64 bits"),
        ("batch_size", 0, r"\['batch_size'\] is 0; expected >= 1"),
        ("dataset_length", None, r"\['dataset_length'\] should be int"),
        ("new_batch_size", 0, r"\['new_batch_size'\] should be None or an int >= 1"),
        ("new_batch_size", 4, r"batch_size: 4 in checkpoint / 3 in this loader"),
    ],
)
def test_a_resigned_edit_of_a_repartitioned_epoch_is_refused(key: str, value: Any, error: str) -> None:
    make_loader = _factory(40)
    old = _old_run(make_loader, 40, 4, cut=1)
    _, saved, _ = _cut_new_world(old.states, make_loader, 3, 1)
    for state in saved:
        state["rest"]["source"][key] = value
    edited = [_resigned_outer(state) for state in saved]
    with pytest.raises((snaploader.CheckpointFormatError, snaploader.CheckpointMismatchError), match=error):
        reshard(edited, make_loader, rank=0, world_size=3)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize(
    "entries, error",
    [
        ({"rank00_of_1": "{}"}, r"entries \['rank00_of_1'\], not one 'rank<r>_of_<N>'"),
        ({"rank0_of_1": "not json"}, r"entry loader.rank0_of_1 is not valid JSON"),
        ({"rank0_of_1": 7}, r"entry loader.rank0_of_1 should be the loader state as a JSON string|cannot be read"),
        ({"rank0_of_1": torch.zeros(2)}, r"cannot be read under 'loader'"),
        ({"rank0_of_1": "[1, 2]"}, r"entry loader.rank0_of_1 holds a list, not a loader state"),
    ],
)
def test_dcp_states_names_an_entry_it_cannot_use(tmp_path: Path, entries: dict[str, Any], error: str) -> None:
    dcp.save({"loader": entries}, checkpoint_id=str(tmp_path / "bad"))
    with pytest.raises(snaploader.CheckpointFormatError, match=error):
        snaploader.distributed.dcp_states(str(tmp_path / "bad"))


def _samples(batches: Any) -> dict[int, torch.Tensor]:
    return {int(row[0]): row for batch in batches for row in batch}


@pytest.mark.parametrize(("old", "new"), [(4, 3), (2, 3)])
def test_per_sample_seeds_make_a_repartitioned_epoch_exact_per_sample(old: int, new: int) -> None:
    make = _factory(31, per_sample=True)
    run = _old_run(make, 31, old, cut=2)
    expected = {i: row for rank in run.rest for i, row in _samples(rank).items()}
    states = [through_bytes(state) for state in run.states]
    # New loaders on another generator seed: the interrupted epoch's per-sample seed must
    # come from the checkpoints, not from what the new loaders would draw.
    remake = _factory(31, per_sample=True, seed=2)
    got: dict[int, torch.Tensor] = {}
    for rank in range(new):
        loader = reshard(states, remake, rank=rank, world_size=new)
        assert loader.mode == "repartition"
        loader.set_epoch(_EPOCH)
        rows = _samples(list(loader))
        assert not set(rows) & set(got), "a sample read twice"
        got.update(rows)
    consumed = {i for rank in run.consumed for i in _samples(rank)}
    assert set(got) <= set(expected) and not set(got) & consumed
    assert sorted(consumed | set(got)) == list(range(31))  # every sample once
    for index, row in got.items():
        assert torch.equal(row, expected[index]), f"sample {index} differs"


def test_per_sample_seeds_need_one_generator_seed_on_every_rank() -> None:
    states = []
    for rank in range(4):
        make = _factory(31, per_sample=True, seed=rank)
        sampler = DistributedSampler(Augmented(31), num_replicas=4, rank=rank, shuffle=True, seed=5)
        loader = make(sampler)
        take(iter(loader), 1)
        states.append(loader.state_dict())
    with pytest.raises(ValueError, match="different base seeds"):
        reshard(states, _factory(31, per_sample=True), rank=0, world_size=3)
    same = _old_run(_factory(31, per_sample=True), 31, 4, cut=1).states
    with pytest.raises(snaploader.CheckpointMismatchError, match="seed_per_sample: True"):
        reshard(same, _factory(31), rank=0, world_size=3)


# -- a new per-rank batch size (reshard(..., allow_mismatch=("batch_size",))) -----------


def _old_order(run: OldRun) -> list[int]:
    """The samples the old run still yielded after the cut, in its global order (step by
    step, rank by rank), DistributedSampler's padding repeats (later copies) left out."""
    seen = set(_ids(run.consumed))
    order = []
    for step in itertools.zip_longest(*run.rest, fillvalue=None):
        for batch in step:
            for i in ([] if batch is None else batch[:, 0].tolist()):
                if int(i) not in seen:
                    seen.add(int(i))
                    order.append(int(i))
    return order


def _dealt_order(per_rank: list[list[torch.Tensor]]) -> list[int]:
    """The new ranks' samples in the new global order: step by step, rank by rank."""
    steps = itertools.zip_longest(*per_rank, fillvalue=None)
    return [int(i) for step in steps for batch in step if batch is not None for i in batch[:, 0].tolist()]


@pytest.mark.parametrize(
    ("n", "old_size", "new_size", "old_batch", "new_batch", "drop_last", "per_sample"),
    [
        (48, 4, 3, 3, 5, False, True),
        (48, 4, 3, 6, 4, False, False),
        (48, 4, 2, 4, 6, False, True),  # M divides N: re-partitioned too
        (48, 4, 4, 6, 4, True, True),  # the same world size, a new batch
        (50, 2, 3, 4, 6, True, True),  # drop_last drops the old and the new short batches
        (38, 4, 3, 4, 6, False, True),  # DistributedSampler pads 2 repeats
    ],
)
def test_a_new_per_rank_batch_deals_the_rest_of_the_epoch_in_batches_of_that_size(
    n: int, old_size: int, new_size: int, old_batch: int, new_batch: int, drop_last: bool, per_sample: bool
) -> None:
    old = _old_run(_factory(n, old_batch, drop_last, per_sample=per_sample), n, old_size, cut=1)
    # another generator seed: the rest is drawn with the interrupted epoch's seed anyway
    make_new = _factory(n, new_batch, drop_last, num_workers=1, per_sample=per_sample, seed=2)
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"batch_size: .* allow_mismatch=\('batch_size',\)"):
        reshard(old.states, make_new, rank=0, world_size=new_size)
    rest, following = [], []
    for rank in range(new_size):
        loader = reshard(old.states, make_new, rank=rank, world_size=new_size, allow_mismatch=("batch_size",))
        assert loader.mode == "repartition" and loader.epoch == _EPOCH
        loader.set_epoch(_EPOCH)
        rest.append(list(loader))
        loader.set_epoch(_EPOCH + 1)
        following.append(list(loader))
    pool = _old_order(old)
    # the pool in the old run's order, cut into batches of the new size, dealt round-robin
    assert _dealt_order(rest) == pool[: len(pool) // new_batch * new_batch if drop_last else None]
    sizes = [len(batch) for batches in rest for batch in batches]
    assert sizes.count(new_batch) >= len(sizes) - 1 and (not drop_last or set(sizes) == {new_batch}), sizes
    assert max(map(len, rest)) - min(map(len, rest)) <= 1
    if per_sample:
        before = {i: row for batches in old.rest for i, row in _samples(batches).items()}
        for batches in rest:
            for index, row in _samples(batches).items():
                assert torch.equal(row, before[index]), f"sample {index} differs"
    for rank, batches in enumerate(following):  # the next epoch: a plain M-rank loader
        sampler = DistributedSampler(Augmented(n), num_replicas=new_size, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(_EPOCH + 1)
        order = list(sampler)
        assert _ids([batches]) == order[: len(order) // new_batch * new_batch if drop_last else None]
        assert {len(batch) for batch in batches[:-1]} <= {new_batch}


def test_a_new_per_rank_batch_needs_the_option_and_changes_nothing_else() -> None:
    old = _old_run(_factory(40), 40, 4, cut=1)
    for world_size in (2, 3):  # hosting and re-partition refuse alike
        with pytest.raises(snaploader.CheckpointMismatchError) as raised:
            reshard(old.states, _factory(40, batch_size=5), rank=0, world_size=world_size)
        assert str(raised.value).startswith("batch_size: 3 in the old run's checkpoints / 5 in the loader")
        assert "reshard(..., allow_mismatch=('batch_size',))" in str(raised.value)
    for bad in (("drop_last",), "batch_size"):
        with pytest.raises(ValueError, match="only 'batch_size' may differ"):
            reshard(old.states, _factory(40), rank=0, world_size=2, allow_mismatch=bad)
    with pytest.raises(snaploader.CheckpointMismatchError, match="build it with batch_size="):
        reshard(old.states, _factory(40, batch_size=None), rank=0, world_size=3, allow_mismatch=("batch_size",))  # type: ignore[arg-type]
    # a re-signed position past a rank's epoch, which a loader of another batch size cannot tell
    edited = json.loads(json.dumps(old.states))
    edited[1]["yielded"] = edited[1]["workers"][0]["yielded"]["produced"] = 5
    with pytest.raises(snaploader.CheckpointFormatError, match=r"rank 1's checkpoint: .*'yielded'\] is 5 for an epoch of 4 batches of 3"):
        reshard([*edited[:1], resign(edited[1]), *edited[2:]], _factory(40, batch_size=5), rank=0, world_size=3,
                allow_mismatch=("batch_size",))
    # the same batch size: the option changes nothing, hosting still keeps the global batches
    kept = [reshard(old.states, _factory(40), rank=j, world_size=2, allow_mismatch=("batch_size",)) for j in range(2)]
    assert [loader.mode for loader in kept] == ["hosting", "hosting"]
    assert_same_stream(_global([list(loader) for loader in kept]), _global(old.rest), "hosting with the option given")


def test_a_new_per_rank_batch_builds_one_loader_per_old_rank_checked_and_one_to_read() -> None:
    # make_loader may be costly (a dataset per call): a re-partition builds a loader to
    # check each old rank's checkpoint and one for the rest, whether or not M divides N
    old = _old_run(_factory(48), 48, 4, cut=1)
    make = _factory(48, batch_size=5)
    for world_size in (2, 3):
        calls = []

        def counting(sampler: Any) -> Any:
            calls.append(sampler)
            return make(sampler)

        loader = reshard(old.states, counting, rank=0, world_size=world_size, allow_mismatch=("batch_size",))
        assert loader.mode == "repartition"
        assert len(calls) == 4 + 1, (world_size, len(calls))


def test_a_new_per_rank_batch_between_epochs_starts_a_plain_loader_of_that_size() -> None:
    ended = []
    for rank in range(4):
        sampler = DistributedSampler(Augmented(24), num_replicas=4, rank=rank, shuffle=True, seed=5)
        loader = _factory(24)(sampler)
        sampler.set_epoch(_EPOCH)
        list(loader)
        ended.append(loader.state_dict())
    loader = reshard(ended, _factory(24, batch_size=4), rank=1, world_size=2, allow_mismatch=("batch_size",))
    assert loader.mode == "repartition" and loader.epoch == _EPOCH + 1 and loader.loaders[0].batch_size == 4
    sampler = DistributedSampler(Augmented(24), num_replicas=2, rank=1, shuffle=True, seed=5)
    sampler.set_epoch(_EPOCH + 1)
    batches = list(loader)
    assert _ids([batches]) == list(sampler) and [len(batch) for batch in batches] == [4, 4, 4]


def test_a_state_taken_in_an_epoch_dealt_in_a_new_batch_resumes_on_its_world_size() -> None:
    old = _old_run(_factory(48, 3, per_sample=True), 48, 4, cut=1)
    make_new = _factory(48, 5, per_sample=True)
    new = [reshard(old.states, make_new, rank=j, world_size=3, allow_mismatch=("batch_size",)) for j in range(3)]
    iterators = [iter(loader) for loader in new]
    taken = [take(iterator, 2) for iterator in iterators]
    saved = [json.loads(json.dumps(through_bytes(loader.state_dict()))) for loader in new]
    expected = [list(iterator) for iterator in iterators]
    assert {state["rest"]["source"]["new_batch_size"] for state in saved} == {5}
    assert {state["rest"]["source"]["batch_size"] for state in saved} == {3}
    for rank in range(3):
        resumed = reshard(saved, make_new, rank=rank, world_size=3)
        assert_same_stream(list(resumed), expected[rank], f"rank {rank}")
    assert sorted(_ids(old.consumed) + _ids(taken) + _ids(expected)) == list(range(48))
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"batch_size: 5 in checkpoint / 3 in this loader"):
        reshard(saved, _factory(48, 3, per_sample=True), rank=0, world_size=3, allow_mismatch=("batch_size",))
    with pytest.raises(ValueError, match=r"re-partitioned onto \[3\] rank.*world_size=2"):
        reshard(saved, make_new, rank=0, world_size=2)
    # a state written before new_batch_size was recorded was dealt in the old size
    older = json.loads(json.dumps(saved))
    for state in older:
        del state["rest"]["source"]["new_batch_size"]
    with pytest.raises(snaploader.CheckpointMismatchError, match=r"batch_size: 3 in checkpoint / 5 in this loader"):
        reshard([_resigned_outer(state) for state in older], make_new, rank=0, world_size=3)


@pytest.fixture(scope="module")
def four_ranks_per_sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    out = tmp_path_factory.mktemp("four_per_sample")
    return out, _world("save", 4, 4, out, per_sample=True)


@pytest.mark.integration
def test_four_gloo_ranks_on_three_match_sample_for_sample_with_per_sample_seeds(
    four_ranks_per_sample: tuple[Path, list[Any]],
) -> None:
    out, saved = four_ranks_per_sample
    resumed = _world("load", 3, 4, out, per_sample=True)
    _check_repartitioned(saved, resumed)
    expected = {i: row for r in saved for i, row in _samples(r["rest"]).items()}
    got = {i: row for r in resumed for i, row in _samples(r["rest"]).items()}
    assert got and set(got) <= set(expected)
    for index, row in got.items():
        assert torch.equal(row, expected[index]), f"sample {index} differs"


def _check_new_batch(saved: list[Any], resumed: list[Any], new_batch: int) -> None:
    """The rest of the epoch dealt in batches of ``new_batch`` from the old run's pool, in
    its order, none lost or repeated; the next epoch a plain 3-rank loader of that size."""
    _check_repartitioned(saved, resumed)
    pool = _old_order(OldRun([], [r["consumed"] for r in saved], [r["rest"] for r in saved], []))
    assert _dealt_order([r["rest"] for r in resumed]) == pool
    sizes = [len(batch) for r in resumed for batch in r["rest"]]
    assert sizes.count(new_batch) >= len(sizes) - 1, sizes
    for rank, r in enumerate(resumed):
        sampler = DistributedSampler(Augmented(62), num_replicas=len(resumed), rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(2)  # tests/_world_child.py's interrupted epoch is 1
        assert _ids([r["following"]]) == list(sampler)
        assert {len(batch) for batch in r["following"][:-1]} == {new_batch}


@pytest.mark.integration
def test_four_gloo_ranks_on_three_with_a_new_per_rank_batch_lose_and_repeat_nothing(
    four_ranks: tuple[Path, list[Any]],
) -> None:
    out, saved = four_ranks
    _check_new_batch(saved, _world("load", 3, 4, out, new_batch=5), 5)


@pytest.mark.integration
def test_four_gloo_ranks_on_three_with_a_new_per_rank_batch_match_sample_for_sample(
    four_ranks_per_sample: tuple[Path, list[Any]],
) -> None:
    out, saved = four_ranks_per_sample
    resumed = _world("load", 3, 4, out, per_sample=True, new_batch=5)
    _check_new_batch(saved, resumed, 5)
    expected = {i: row for r in saved for i, row in _samples(r["rest"]).items()}
    got = {i: row for r in resumed for i, row in _samples(r["rest"]).items()}
    assert got and set(got) <= set(expected)
    for index, row in got.items():
        assert torch.equal(row, expected[index]), f"sample {index} differs"


def test_a_mid_epoch_checkpoint_of_an_epoch_resumed_into_another_batch_size_is_refused() -> None:
    """Its ranks' batches are cut at another size than the old world's positions count,
    so reshard refuses it (naming what to do) rather than deal the wrong samples."""
    run = _old_run(_factory(31, batch_size=3), 31, 4, cut=1)
    rebatched = []
    for rank, state in enumerate(run.states):
        sampler = DistributedSampler(Augmented(31), num_replicas=4, rank=rank, shuffle=True, seed=5)
        loader = _factory(31, batch_size=2)(sampler)
        loader.load_state_dict(state, allow_mismatch=("batch_size",))
        take(iter(loader), 1)
        rebatched.append(loader.state_dict())
    with pytest.raises(snaploader.CheckpointMismatchError, match="resumed with another batch_size or dataset length"):
        reshard(rebatched, _factory(31, batch_size=2), rank=0, world_size=3)
