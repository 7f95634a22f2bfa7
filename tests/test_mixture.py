"""Mixtures (docs/mixtures.md): the blend follows the weights, each source's pass has no
repeat, a resume is exact, a resume with new weights or sources goes on without repeating
or skipping what each source's pass already gave, a schedule resumes exactly, a world
size change loses and repeats nothing, and ``consumed()`` / ``inspect --consumed`` agree
with the batches the loader yielded."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from snaploader import CheckpointFormatError, CheckpointMismatchError, DataLoader, Mixture

from ._mixture_child import Ids, build, take

ROOT = Path(__file__).resolve().parent.parent
NAMES = {0: "a", 1: "b", 2: "c", 3: "d"}
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def spec(num_workers: int = 0, **changes: Any) -> dict[str, Any]:
    base = {"sources": {"a": [0, 200], "b": [1, 120], "c": [2, 80]}, "weights": WEIGHTS,
            "samples_per_epoch": 600, "seed": 11, "num_workers": num_workers, "batch_size": 10}
    return {**base, **changes}


def flat(batches: list[list[int]]) -> list[int]:
    return [x for batch in batches for x in batch]


def per_source(items: list[int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for x in items:
        out.setdefault(NAMES[x // 10**6], []).append(x % 10**6)
    return out


def assert_passes_unique(items: list[int], lengths: dict[str, int], starts: dict[str, int] | None = None) -> None:
    """Each source's items, cut into passes of its length (from ``starts[name]`` items
    into its first pass), hold no item twice within a pass; full passes hold every item."""
    for name, seq in per_source(items).items():
        n = lengths[name]
        at = -(starts or {}).get(name, 0)
        chunks = [seq[max(0, i): i + n] for i in range(at, len(seq), n)]
        for chunk in chunks:
            assert len(set(chunk)) == len(chunk), f"source {name}: an item repeats within a pass"
        for chunk in chunks[1:-1]:
            assert sorted(chunk) == list(range(n)), f"source {name}: a full pass skipped items"


def assert_proportions(items: list[int], weights: dict[str, float]) -> None:
    total = sum(weights.values())
    counts = Counter(NAMES[x // 10**6] for x in items)
    n = len(items)
    for name, w in weights.items():
        p = w / total
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[name] - n * p) <= 4 * sd + 1e-9, f"source {name}: {counts[name]} of {n}, expected {n * p:.1f}"


def run_child(tmp_path: Path, job: dict[str, Any]) -> dict[str, Any]:
    job_path, out_path = tmp_path / "job.pt", tmp_path / "out.pt"
    torch.save(job, job_path)
    subprocess.run([sys.executable, "-m", "tests._mixture_child", str(job_path), str(out_path)],
                   cwd=ROOT, check=True, timeout=120)
    return torch.load(out_path, weights_only=True)


LENGTHS = {"a": 200, "b": 120, "c": 80, "d": 50}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_blend_follows_the_weights_and_passes_do_not_repeat(num_workers: int) -> None:
    items = flat(take(build(spec(num_workers)), None, epochs=1))
    assert len(items) == 1200
    assert_proportions(items[:600], WEIGHTS)
    assert_proportions(items, WEIGHTS)
    assert_passes_unique(items, LENGTHS)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cut_at_40_percent_resumes_exactly_in_a_fresh_process(tmp_path: Path, num_workers: int) -> None:
    full = take(build(spec(num_workers)), None, epochs=1)
    loader = build(spec(num_workers))
    head = take(loader, 24)
    out = run_child(tmp_path, {"spec": spec(num_workers), "state": loader.state_dict(), "allow": [], "batches": None, "epochs": 1})
    assert head + out["batches"] == full


def test_new_weights_at_resume_need_the_flag_and_then_choose_from_the_cut() -> None:
    loader = build(spec(2))
    head = flat(take(loader, 24))
    state = loader.state_dict()
    new = {"a": 0.1, "b": 0.1, "c": 0.8}
    with pytest.raises(CheckpointMismatchError, match="weights"):
        build(spec(2, weights=new)).load_state_dict(state)
    resumed = build(spec(2, weights=new))
    resumed.load_state_dict(state, allow_mismatch=("weights",))
    rest = flat(take(resumed, None, epochs=1))
    assert len(head) + len(rest) == 1200
    assert_proportions(rest, new)
    # each source goes on in its pass's order: nothing given before the cut in the
    # current pass comes again in it, nothing is skipped
    assert_passes_unique(head + rest, LENGTHS)


def test_a_source_added_starts_its_first_pass_and_a_removed_one_keeps_its_place() -> None:
    loader = build(spec())
    first = flat(take(loader, 20))
    state1 = loader.state_dict()
    # c removed, d added
    two = spec(sources={"a": [0, 200], "b": [1, 120], "d": [3, 50]}, weights={"a": 0.4, "b": 0.3, "d": 0.3})
    with pytest.raises(CheckpointMismatchError, match="weights"):
        build(two).load_state_dict(state1)
    resumed = build(two)
    resumed.load_state_dict(state1, allow_mismatch=("weights",))
    second = flat(take(resumed, 15))
    assert not any(x // 10**6 == 2 for x in second)
    d_items = per_source(second)["d"]
    assert d_items and len(set(d_items)) == len(d_items)
    assert list(resumed.consumed()["sources"]["d"]["passes"]) == [0]
    state2 = resumed.state_dict()
    # c back: it goes on in the pass it stood in when removed
    again = build(spec())
    again.load_state_dict(state2, allow_mismatch=("weights",))
    third = flat(take(again, None))
    assert_passes_unique(first + second + third, LENGTHS)
    # a source's order does not depend on the blend: c's items, before its removal and
    # after its return, are the start of the order an uninterrupted mixture gives it
    c_order = per_source(flat(take(build(spec()), None, epochs=2)))["c"]
    c_seen = per_source(first)["c"] + per_source(third)["c"]
    assert len(per_source(third)["c"]) > 0 and c_seen == c_order[: len(c_seen)]


def test_a_schedule_resumes_exactly_and_follows_its_weights(tmp_path: Path) -> None:
    full = take(build(spec(weights="linear")), None, epochs=1)
    items = flat(full)
    early, late = Counter(NAMES[x // 10**6] for x in items[:200]), Counter(NAMES[x // 10**6] for x in items[-200:])
    assert early["c"] > late["c"] and late["a"] > early["a"]
    loader = build(spec(weights="linear"))
    head = take(loader, 30)
    resumed = build(spec(weights="linear"))
    resumed.load_state_dict(loader.state_dict())
    assert head + take(resumed, None, epochs=1) == full


def test_a_world_size_change_loses_and_repeats_nothing() -> None:
    big = {"a": [0, 2000], "b": [1, 2000], "c": [2, 2000]}
    reference = flat(take(build(spec(sources=big, samples_per_epoch=240, batch_size=4)), None))
    old = [build(spec(sources=big, samples_per_epoch=240, batch_size=4, rank=r, world_size=4)) for r in range(4)]
    its = [iter(loader) for loader in old]
    before = [x for _ in range(5) for it in its for x in next(it).tolist()]
    states = [loader.state_dict() for loader in old]
    new = [build(spec(2, sources=big, samples_per_epoch=240, batch_size=4, rank=r, world_size=3)) for r in range(3)]
    for r, loader in enumerate(new):
        loader.load_state_dict(states[r])  # any old rank's: they stand at one position
    rests = [take(loader, None) for loader in new]
    after = [x for rest in rests for x in flat(rest)]
    # the new world counts the rest of the epoch in its own batches (14 a rank, not the
    # old world's 15 minus 5), and the state at its end loads on this world or another
    assert [len(rest) for rest in rests] == [14, 14, 14]
    ended = new[0].state_dict()
    for world_size in (3, 2):
        again = build(spec(sources=big, samples_per_epoch=240, batch_size=4, rank=0, world_size=world_size))
        again.load_state_dict(ended)
        assert again.epoch == 1 and again.batches_remaining() == len(again) == 240 // world_size // 4
    assert len(set(before + after)) == len(before + after), "a sample repeats"
    # the rest of the epoch is the stream's next draws, dealt to 3 ranks (one draw left
    # over for the next epoch: 160 draws left, 53 per rank)
    assert sorted(before + after) == sorted(reference[: len(before) + len(after)])
    assert len(before) + len(after) == 240 - 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_world_too_large_for_what_is_left_ends_the_epoch_and_draws_the_next(num_workers: int) -> None:
    big = {"a": [0, 2000], "b": [1, 2000], "c": [2, 2000]}
    shape = {"sources": big, "samples_per_epoch": 240, "batch_size": 4}
    stream = flat(take(build(spec(**{**shape, "batch_size": 1})), None, epochs=1))  # draws 0..479
    old = [build(spec(**shape, rank=r, world_size=4)) for r in range(4)]
    its = [iter(loader) for loader in old]
    for _ in range(14):  # of 15 batches: 16 draws left, fewer than one a rank of 20
        for it in its:
            next(it)
    new = build(spec(num_workers, **shape, rank=0, world_size=20))
    new.load_state_dict(old[0].state_dict())
    assert new.batches_remaining() == 0
    assert take(new, None) == []
    assert new.epoch == 1
    # the next epoch goes on with the stream's next draws: rank 0 of 20 takes draws
    # 224, 244, ... (the old world made 224; the 16 left over are the next epoch's)
    assert flat(take(new, None)) == stream[224::20][:12]
    # an epoch that ended on this world (3 batches) loads on one of 3 ranks (20 a rank)
    other = build(spec(**shape, rank=0, world_size=3))
    other.load_state_dict(new.state_dict())
    assert other.epoch == 2 and other.batches_remaining() == 20


def test_consumed_and_inspect_agree_with_the_yielded_batches_across_two_resumes(tmp_path: Path) -> None:
    loader = build(spec(2))
    got = take(loader, 7)
    one = run_child(tmp_path, {"spec": spec(2), "state": loader.state_dict(), "allow": [], "batches": 9, "epochs": 0})
    got += one["batches"]
    two = run_child(tmp_path, {"spec": spec(2), "state": one["state"], "allow": [], "batches": 5, "epochs": 0})
    got += two["batches"]
    consumed = two["consumed"]
    assert consumed["batches"] == 21
    yielded = per_source(flat(got))
    assert {name: [i for items in s["passes"].values() for i in items] for name, s in consumed["sources"].items()} == yielded
    assert {name: s["samples"] for name, s in consumed["sources"].items()} == {n: len(v) for n, v in yielded.items()}
    path = tmp_path / "ckpt.pt"
    torch.save({"loader": two["state"]}, path)
    shown = subprocess.run([sys.executable, "-m", "snaploader", "inspect", str(path), "--consumed", "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    entry = json.loads(shown.stdout)["states"][0]["consumed"]
    assert {name: [i for items in s["passes"].values() for i in items] for name, s in entry["sources"].items()} == yielded
    text = subprocess.run([sys.executable, "-m", "snaploader", "inspect", str(path), "--consumed"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "consumed     epoch 0: 21 batches" in text and "source a:" in text


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["random", "random-global", "sequential", "distributed"])
def test_consumed_indices_of_a_plain_loader_are_the_yielded_ones(num_workers: int, kind: str) -> None:
    data = list(range(37))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=1, seed=4) if kind == "distributed" else None
    loader = DataLoader(
        data, batch_size=4, shuffle=kind.startswith("random"), sampler=sampler, num_workers=num_workers,
        generator=torch.Generator().manual_seed(1) if kind == "random" else None,
    )
    if sampler is not None:
        sampler.set_epoch(2)
    assert loader.consumed()["indices"] == []
    it = iter(loader)
    got = [x for _ in range(3) for x in next(it).tolist()]
    done = loader.consumed()
    assert (done["epoch"], done["batches"], done["indices"], done["indices_unknown"]) == (0, 3, got, None)
    rest = [x for batch in it for x in batch.tolist()]
    assert loader.consumed()["indices"] == got + rest


def test_consumed_names_why_it_cannot_rebuild_an_order() -> None:
    data = list(range(20))
    own = DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, generator=torch.Generator()))
    next(iter(own))
    assert own.consumed()["indices"] is None and "generator of its own" in own.consumed()["indices_unknown"]
    replaced = DataLoader(data, batch_size=4, sampler=torch.utils.data.RandomSampler(data, replacement=True))
    next(iter(replaced))
    assert "replacement" in replaced.consumed()["indices_unknown"]


def test_other_changes_at_resume_are_refused_or_taken_as_a_grown_dataset() -> None:
    loader = build(spec())
    take(loader, 10)
    state = loader.state_dict()
    with pytest.raises(CheckpointMismatchError, match="seed=11"):
        build(spec(seed=12)).load_state_dict(state)
    grown = spec(sources={"a": [0, 200], "b": [1, 120], "c": [2, 90]})
    with pytest.raises(CheckpointMismatchError, match="dataset_length"):
        build(grown).load_state_dict(state)
    resumed = build(grown)
    resumed.load_state_dict(state, allow_mismatch=("dataset_length",))
    rest = flat(take(resumed, None))
    # the rest of the epoch draws c's old items only; its new ones come in a later epoch's pass
    assert all(x % 10**6 < 80 for x in rest if x // 10**6 == 2)
    later = flat(take(resumed, None, epochs=2))
    assert any(x % 10**6 >= 80 for x in later if x // 10**6 == 2)
    shrunk = spec(sources={"a": [0, 200], "b": [1, 120], "c": [2, 70]})
    with pytest.raises(CheckpointMismatchError, match="cannot shrink"):
        build(shrunk).load_state_dict(state, allow_mismatch=("dataset_length",))
    with pytest.raises(ValueError, match="only a Mixture's sampler"):
        DataLoader(list(range(8))).load_state_dict(DataLoader(list(range(8))).state_dict(), allow_mismatch=("weights",))


def test_a_malformed_mixture_state_is_named() -> None:
    loader = build(spec())
    take(loader, 3)
    sampler = loader.sampler
    state = sampler.state_dict()
    for key, value in [("drawn", -1), ("world", [2, 1]), ("weights", {"a": -1.0}), ("sources", {"a": [0, 1]})]:
        with pytest.raises(CheckpointFormatError, match=key):
            sampler.load_state_dict({**state, key: value})
    with pytest.raises(CheckpointFormatError, match="keys"):
        sampler.load_state_dict({"drawn": 0})


@pytest.mark.parametrize(
    ("sources", "weights", "kwargs", "match"),
    [
        ({"a": Ids(0, 5)}, {"a": -1.0}, {}, ">= 0"),
        ({"a": Ids(0, 5)}, {"a": 0.0}, {}, "all zero"),
        ({"a": Ids(0, 5)}, {"a": float("nan")}, {}, "finite"),
        ({"a": Ids(0, 5)}, {"a": 1.0, "z": 1.0}, {}, "not sources"),
        ({"a": Ids(0, 5), "b": Ids(1, 5)}, {"a": 1.0}, {}, "no weight"),
        ({"a": Ids(0, 0)}, {"a": 1.0}, {}, "empty"),
        ({"a": Ids(0, 5)}, {"a": 1.0}, {"samples_per_epoch": 0}, "samples_per_epoch"),
        ({}, {}, {}, "non-empty"),
    ],
)
def test_bad_mixtures_are_refused_at_construction(sources: Any, weights: Any, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Mixture(sources, weights, **{"samples_per_epoch": 10, **kwargs})


def test_a_bad_schedule_result_and_shuffle_are_refused() -> None:
    mixture = Mixture({"a": Ids(0, 5)}, lambda drawn: {"a": -1.0}, samples_per_epoch=4)
    with pytest.raises(ValueError, match="schedule's result for 0 samples drawn"):
        next(iter(DataLoader(mixture)))
    with pytest.raises(ValueError, match="orders its own samples"):
        DataLoader(Mixture({"a": Ids(0, 5)}, {"a": 1.0}, samples_per_epoch=4), shuffle=True)


def test_items_carry_their_source_name_when_asked() -> None:
    mixture = Mixture({"a": Ids(0, 5), "b": Ids(1, 5)}, {"a": 1.0, "b": 1.0}, samples_per_epoch=6, seed=0, with_source=True)
    names, items = next(iter(DataLoader(mixture, batch_size=6)))
    assert all(NAMES[int(x) // 10**6] == name for name, x in zip(names, items))


def test_reshard_of_a_mixture_goes_on_from_where_the_old_ranks_stood() -> None:
    from snaploader.distributed import reshard

    big = {"a": [0, 2000], "b": [1, 2000], "c": [2, 2000]}
    shape = {"sources": big, "samples_per_epoch": 240, "batch_size": 4}
    reference = flat(take(build(spec(**shape)), None))
    old = [build(spec(**shape, rank=r, world_size=2)) for r in range(2)]
    its = [iter(loader) for loader in old]
    before = [x for _ in range(6) for it in its for x in next(it).tolist()]
    states = [loader.state_dict() for loader in old]

    def make_loader(sampler: Any) -> DataLoader:
        loader = build(spec(**shape))
        return loader if sampler is None else DataLoader(
            loader.dataset, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(0))

    new = [reshard(states, make_loader, rank=r, world_size=3) for r in range(3)]
    after = [x for loader in new for batch in loader for x in batch.tolist()]
    assert sorted(before + after) == sorted(reference[: len(before) + len(after)])
    assert len(set(before + after)) == len(before + after) == 240  # 192 left: 64 a rank
    # its state resumes again, on yet another world size
    assert reshard([loader.state_dict() for loader in new], make_loader, rank=0, world_size=1).loaders
    with pytest.raises(CheckpointMismatchError, match="lack rank"):
        reshard(states[:1], make_loader, rank=0, world_size=3)
    take(old[0], 1)
    with pytest.raises(CheckpointMismatchError, match="one training step"):
        reshard([old[0].state_dict(), states[1]], make_loader, rank=0, world_size=3)


def test_another_world_size_refuses_an_out_of_order_mid_epoch_checkpoint() -> None:
    shape = {"samples_per_epoch": 240, "batch_size": 4}
    mixture = build(spec(**shape)).dataset
    loader = DataLoader(mixture, batch_size=4, num_workers=2, in_order=False, sampler=mixture.sampler(rank=0, world_size=2),
                        generator=torch.Generator().manual_seed(0))
    take(loader, 3)
    with pytest.raises(CheckpointMismatchError, match="in_order=False"):
        build(spec(**shape, rank=0, world_size=3)).load_state_dict(loader.state_dict())
