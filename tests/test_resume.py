"""Exact resume: a checkpoint taken at any batch of any epoch, saved, loaded with
weights_only=True into a new loader (in this process or a fresh one) continues the
stream bit for bit, the rest of that epoch and the next."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler

import snaploader

from ._datasets import Augmented, PlainBatchSampler, StatefulSampler
from ._resume_child import build_loader, resume
from ._support import assert_same_stream, mp_helpers, take, through_bytes  # noqa: F401

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

ROOT = Path(__file__).resolve().parent.parent
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # each example starts processes
SEED, OTHER_SEED = 1234, 98765


@dataclass
class Cut:
    epoch: int
    k: int  # batches of the epoch yielded when the state was taken
    ended: bool  # taken after StopIteration
    state: dict[str, Any]
    global_rng: torch.Tensor


@dataclass
class Reference:
    epochs: list[list[Any]]  # the uninterrupted stream
    generator_after: list[torch.Tensor | None]  # the generator's state after each epoch
    cuts: list[Cut]


def _run_with_cuts(config: dict[str, Any], epochs: int = 3, cut_epochs: int = 2) -> Reference:
    """The uninterrupted run, with a checkpoint before every batch, after the last one
    (before StopIteration) and after StopIteration, in the first ``cut_epochs``."""
    loader = build_loader(config, SEED)
    _assert_reaches(loader, config)
    out, generator_after, cuts = [], [], []
    for epoch in range(epochs):
        iterator = iter(loader)
        batches: list[Any] = []
        while True:
            if epoch < cut_epochs:
                cuts.append(Cut(epoch, len(batches), False, loader.state_dict(), torch.get_rng_state()))
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        del iterator
        if epoch < cut_epochs:
            cuts.append(Cut(epoch, len(batches), True, loader.state_dict(), torch.get_rng_state()))
        out.append(batches)
        generator_after.append(None if loader.generator is None else loader.generator.get_state())
    return Reference(out, generator_after, cuts)


def _assert_reaches(loader: snaploader.DataLoader, config: dict[str, Any]) -> None:
    """Every parameter the configuration varies reached the loader."""
    workers = config["num_workers"]
    assert loader.num_workers == workers and loader.batch_size == config["batch_size"]
    assert loader.drop_last == config["drop_last"]
    assert loader.persistent_workers == (config.get("persistent_workers", False) and workers > 0)
    assert type(loader.sampler).__name__ == ("RandomSampler" if config["shuffle"] else "SequentialSampler")
    assert (loader.generator is not None) == config.get("generator", True)
    assert (loader.worker_init_fn is not None) == bool(config.get("init"))
    if workers:
        assert loader.multiprocessing_context.get_start_method() == config["context"]
        assert loader.prefetch_factor == (config.get("prefetch_factor") or 2)


def _plain_run(config: dict[str, Any], epochs: int = 3) -> list[list[Any]]:
    loader = build_loader(config, SEED)
    return [list(loader) for _ in range(epochs)]


def _check(ref: Reference, cut: Cut, got: dict[str, Any]) -> None:
    where = f"cut at batch {cut.k} of epoch {cut.epoch}{' (ended)' if cut.ended else ''}"
    expected_rest = [] if cut.ended else ref.epochs[cut.epoch][cut.k:]
    assert_same_stream(got["rest"], expected_rest, f"{where}, rest of epoch")
    assert_same_stream(got["next"], ref.epochs[cut.epoch + 1], f"{where}, next epoch")
    generator_after = ref.generator_after[cut.epoch]
    if not cut.ended and generator_after is not None:
        # the generator ends the epoch where the uninterrupted run leaves it
        assert torch.equal(got["generator_after_rest"], generator_after), where
    assert got["global_untouched"], where


pytestmark = [pytestmark, pytest.mark.usefixtures("keep_global_rngs")]  # both marks, not the last one only


def _config(**kwargs: Any) -> dict[str, Any]:
    config: dict[str, Any] = dict(
        n=13, batch_size=3, shuffle=True, drop_last=False, num_workers=2,
        persistent_workers=False, init=True, context="fork",
    )
    config.update(kwargs)
    return config


# -- every cut point, in this process --------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        _config(num_workers=0),
        _config(num_workers=0, shuffle=False, drop_last=True, init=False),
        _config(num_workers=1, drop_last=True),
        _config(num_workers=2, persistent_workers=True),
        _config(num_workers=3, shuffle=False, n=9),
        _config(num_workers=3, persistent_workers=True, drop_last=True, batch_size=2, n=9),
    ],
    ids=lambda c: f"w{c['num_workers']}{'-persistent' if c['persistent_workers'] else ''}"
    f"{'-shuffle' if c['shuffle'] else ''}{'-drop_last' if c['drop_last'] else ''}",
)
def test_resume_at_every_cut_point(config: dict[str, Any]) -> None:
    ref = _run_with_cuts(config)
    # taking checkpoints changes nothing in the stream
    for epoch, batches in enumerate(_plain_run(config)):
        assert_same_stream(ref.epochs[epoch], batches, f"epoch {epoch}")
    assert {(c.epoch, c.k, c.ended) for c in ref.cuts} >= {(0, 0, False), (1, len(ref.epochs[1]), False)}
    for cut in ref.cuts:
        _check(ref, cut, resume(config, through_bytes(cut.state), OTHER_SEED))


_configs = st.fixed_dictionaries(
    {
        "n": st.integers(8, 24),
        "batch_size": st.integers(1, 5),
        "shuffle": st.booleans(),
        "drop_last": st.booleans(),
        "num_workers": st.integers(0, 3),
        "persistent_workers": st.booleans(),
        "init": st.booleans(),
        "prefetch_factor": st.sampled_from([None, 1, 3]),
    }
)


@settings(max_examples=10, deadline=None, phases=_NO_SHRINK)
@given(config=_configs, data=st.data())
def test_resume_property(config: dict[str, Any], data: st.DataObject) -> None:
    """Random configurations and cuts; the resumed loader has another prefetch depth,
    and a second checkpoint taken after the resume resumes exactly too."""
    config["context"] = "fork"
    ref = _run_with_cuts(config)
    cuts = data.draw(st.lists(st.sampled_from(ref.cuts), min_size=1, max_size=3, unique_by=id), label="cuts")
    for cut in cuts:
        resumed_config = dict(config, prefetch_factor=data.draw(st.sampled_from([None, 1, 2, 4])))
        _check(ref, cut, resume(resumed_config, through_bytes(cut.state), OTHER_SEED))
        if cut.ended:
            continue
        # again: resume, go on j batches, checkpoint, resume that in another loader
        remaining = len(ref.epochs[cut.epoch]) - cut.k
        j = data.draw(st.integers(0, remaining), label="j")
        loader = build_loader(resumed_config, OTHER_SEED + 1)
        loader.load_state_dict(through_bytes(cut.state))
        iterator = iter(loader)
        take(iterator, j)
        second = through_bytes(loader.state_dict())
        del iterator
        again = Cut(cut.epoch, cut.k + j, False, second, cut.global_rng)
        _check(ref, again, resume(config, second, OTHER_SEED + 2))


# -- in a fresh process ------------------------------------------------------------------


def _resume_in_fresh_process(tmp_path: Path, jobs: list[tuple[dict[str, Any], Cut]]) -> list[dict[str, Any]]:
    """Resume each (config, cut) in one new Python process; its results."""
    jobs_path, out_path = tmp_path / "jobs.pt", tmp_path / "out.pt"
    torch.save(
        [
            {"config": config, "state": cut.state, "seed": OTHER_SEED + i,
             "global_rng": cut.global_rng if not config.get("generator", True) else None}
            for i, (config, cut) in enumerate(jobs)
        ],
        jobs_path,
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests._resume_child", str(jobs_path), str(out_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(out_path, weights_only=True)
    assert len(results) == len(jobs)
    return results


def _some_cuts(ref: Reference) -> list[Cut]:
    """A cut at the start, in the middle and at the end of epoch 0, one mid epoch 1
    and one between the epochs."""
    first = [c for c in ref.cuts if c.epoch == 0 and not c.ended]
    second = [c for c in ref.cuts if c.epoch == 1 and not c.ended]
    ended = [c for c in ref.cuts if c.ended and c.epoch == 0]
    return [first[0], first[len(first) // 2], first[-1], second[len(second) // 2], *ended]


def test_fresh_process_resume_fork_and_inline(tmp_path: Path) -> None:
    configs = [
        _config(num_workers=0, drop_last=True),
        _config(num_workers=2, drop_last=True, batch_size=4),
        _config(num_workers=3, persistent_workers=True, shuffle=False, n=14),
        _config(num_workers=1, generator=False),  # the global RNG drives the epoch
    ]
    refs = [_run_with_cuts(config) for config in configs]
    jobs = [(config, cut) for config, ref in zip(configs, refs) for cut in _some_cuts(ref)]
    results = _resume_in_fresh_process(tmp_path, jobs)
    i = 0
    for config, ref in zip(configs, refs):
        for cut in _some_cuts(ref):
            _check(ref, cut, results[i])
            i += 1


@pytest.mark.usefixtures("mp_helpers")
def test_fresh_process_resume_spawn(tmp_path: Path) -> None:
    # Checkpoints taken under spawn here, resumed under spawn in a fresh process; the
    # reference stream comes from fork: the context changes nothing. (A spawned worker
    # imports torch, seconds on this machine: one worker, persistent, one cut.)
    config = _config(num_workers=1, persistent_workers=True, context="spawn", n=12)
    ref = _run_with_cuts(dict(config, context="fork"), epochs=2, cut_epochs=1)
    spawned = _run_with_cuts(config, epochs=1, cut_epochs=1)
    assert_same_stream(spawned.epochs[0], ref.epochs[0], "spawn, epoch 0")
    loader = build_loader(config, SEED)
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    cuts = [spawned.cuts[2]]  # mid-epoch; the resume then runs the next epoch too
    assert not cuts[0].ended and cuts[0].k == 2
    results = _resume_in_fresh_process(tmp_path, [(config, cut) for cut in cuts])
    for cut, got in zip(cuts, results):
        _check(ref, cut, got)


# -- particular moments and properties ---------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_before_any_iteration(num_workers: int) -> None:
    config = _config(num_workers=num_workers)
    expected = _plain_run(config, epochs=2)
    state = through_bytes(build_loader(config, SEED).state_dict())
    assert state["epoch"] == -1
    loader = build_loader(config, OTHER_SEED)
    loader.load_state_dict(state)
    for epoch in range(2):
        assert_same_stream(list(loader), expected[epoch], f"epoch {epoch}")


def test_state_wins_over_the_new_loaders_generator() -> None:
    config = _config(num_workers=1)
    expected = _plain_run(config, epochs=2)
    other = build_loader(config, OTHER_SEED)
    unrestored = list(other)
    assert not all(torch.equal(a, b) for a, b in zip(unrestored, expected[0]))
    original = build_loader(config, SEED)
    iterator = iter(original)
    head = take(iterator, 2)
    state = through_bytes(original.state_dict())
    del iterator
    other.load_state_dict(state)  # a loader that already ran an epoch of its own
    assert_same_stream(head + list(other), expected[0])
    assert_same_stream(list(other), expected[1])


def test_load_into_the_same_loader_rewinds() -> None:
    config = _config(num_workers=2, persistent_workers=True)
    loader = build_loader(config, SEED)
    iterator = iter(loader)
    take(iterator, 1)
    state = loader.state_dict()
    rest = list(iterator)
    following = list(loader)
    loader.load_state_dict(state)  # while its persistent workers are alive
    assert loader.state_dict()["yielded"] == state["yielded"]
    assert_same_stream(list(loader), rest)
    assert_same_stream(list(loader), following)
    del iterator, loader


@pytest.mark.parametrize("persistent", [False, True])
def test_load_while_iterating_invalidates_the_old_iterator(persistent: bool) -> None:
    """After load_state_dict() the old iterator never yields the old stream on (which
    state_dict() no longer describes): it raises, and iter() resumes the loaded state."""
    config = _config(num_workers=2, persistent_workers=persistent)
    want = list(build_loader(config, SEED))
    loader = build_loader(config, SEED)
    old = iter(loader)
    take(old, 1)
    state = loader.state_dict()
    take(old, 2)
    pids = old.worker_pids
    assert pids
    loader.load_state_dict(state)
    assert old.worker_pids == []  # its workers were stopped
    for _ in range(2):  # and it stays invalid
        with pytest.raises(RuntimeError, match=r"invalidated by load_state_dict\(\); call iter\(loader\)"):
            next(old)
    assert_same_stream(list(loader), want[1:])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_global_rng_untouched_by_load_and_iter_without_generator(num_workers: int) -> None:
    config = _config(num_workers=num_workers, generator=False)
    ref = _run_with_cuts(config, epochs=2, cut_epochs=1)
    cut = next(c for c in ref.cuts if c.k == 2)
    torch.manual_seed(777)  # the resumed training loop's RNG, whatever it is
    loop_rng = torch.get_rng_state()
    loader = build_loader(config, OTHER_SEED)
    loader.load_state_dict(through_bytes(cut.state))
    iterator = iter(loader)
    assert torch.equal(torch.get_rng_state(), loop_rng)
    rest = list(iterator)
    assert torch.equal(torch.get_rng_state(), loop_rng)
    assert_same_stream(rest, ref.epochs[0][2:])
    # with the loop's RNG put back where the original run had it, the next epoch matches
    torch.set_rng_state(cut.global_rng)
    assert_same_stream(list(loader), ref.epochs[1])


# -- samplers -------------------------------------------------------------------------


def _sampler_loader(kind: str, seed: int, num_workers: int = 2) -> snaploader.DataLoader:
    dataset = Augmented(17)
    g = torch.Generator().manual_seed(seed)
    if kind == "distributed":
        return snaploader.DataLoader(
            dataset, batch_size=2, num_workers=2, generator=g,
            sampler=DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3),
        )
    if kind == "stateful":
        return snaploader.DataLoader(dataset, batch_size=3, num_workers=num_workers, generator=g, sampler=StatefulSampler(17, 5))
    if kind == "stateful_batch_sampler":
        return snaploader.DataLoader(
            dataset, num_workers=1, generator=g, batch_sampler=BatchSampler(StatefulSampler(17, 5), 4, drop_last=True)
        )
    if kind == "custom_batch_sampler":
        return snaploader.DataLoader(dataset, num_workers=2, generator=g, batch_sampler=PlainBatchSampler(17))
    raise AssertionError(kind)


def _set_epoch(loader: snaploader.DataLoader, epoch: int) -> None:
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)


@pytest.mark.parametrize("kind", ["distributed", "stateful", "stateful_batch_sampler", "custom_batch_sampler"])
def test_resume_with_samplers(kind: str) -> None:
    expected = []
    loader = _sampler_loader(kind, SEED)
    for epoch in range(3):
        _set_epoch(loader, epoch)
        expected.append(list(loader))
    assert len(expected[1]) >= 3
    for k in (0, 1, len(expected[1]) - 1):
        original = _sampler_loader(kind, SEED)
        list(original)
        _set_epoch(original, 1)
        iterator = iter(original)
        take(iterator, k)
        state = through_bytes(original.state_dict())
        del iterator
        resumed = _sampler_loader(kind, OTHER_SEED)  # a fresh sampler: epoch 0, position 0
        resumed.load_state_dict(state)
        assert_same_stream(list(resumed), expected[1][k:], f"{kind}, cut at {k}, rest")
        _set_epoch(resumed, 2)
        assert_same_stream(list(resumed), expected[2], f"{kind}, cut at {k}, next epoch")


def test_stateful_sampler_cut_after_the_last_batch() -> None:
    loader = _sampler_loader("stateful", SEED, 0)
    expected = [list(loader), list(loader)]
    original = _sampler_loader("stateful", SEED, 0)
    iterator = iter(original)
    take(iterator, len(expected[0]))
    state = through_bytes(original.state_dict())
    del iterator
    resumed = _sampler_loader("stateful", OTHER_SEED, 0)
    resumed.load_state_dict(state)
    assert list(resumed) == []
    assert_same_stream(list(resumed), expected[1])


def test_stateful_sampler_cut_between_epochs() -> None:
    loader = _sampler_loader("stateful", SEED, 0)
    expected = [list(loader), list(loader)]
    original = _sampler_loader("stateful", SEED, 0)
    list(original)
    state = through_bytes(original.state_dict())
    resumed = _sampler_loader("stateful", OTHER_SEED, 0)
    resumed.load_state_dict(state)
    assert_same_stream(list(resumed), expected[1])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_sampler_generator_after_restore_is_the_uninterrupted_runs(num_workers: int) -> None:
    # A restore skips a RandomSampler's permutations by slicing them (_epoch/plan.py); the
    # generator they are drawn from must still stand where the uninterrupted run has it
    # after every batch, across the several permutations num_samples > n asks for. The
    # uninterrupted run steps torch's own iterator (a subclass is not sliced).
    n, batch_size = 23, 4

    class Stepped(torch.utils.data.RandomSampler):
        pass

    def loader(seed: int, kind: type = torch.utils.data.RandomSampler) -> tuple[snaploader.DataLoader, torch.Generator]:
        g = torch.Generator().manual_seed(seed)
        sampler = kind(Augmented(n), num_samples=3 * n + 5, generator=g)
        return snaploader.DataLoader(
            Augmented(n), batch_size=batch_size, sampler=sampler, num_workers=num_workers, generator=g
        ), g

    original, g = loader(SEED, Stepped)
    expected: list[list[Any]] = [[], []]
    states: list[list[torch.Tensor]] = [[], []]
    for epoch in range(2):
        for batch in original:
            expected[epoch].append(batch)
            states[epoch].append(g.get_state())
    for k in (1, 6, len(states[0]) - 1):
        cut, _ = loader(SEED)
        iterator = iter(cut)
        take(iterator, k)
        state = through_bytes(cut.state_dict())
        del iterator
        resumed, resumed_g = loader(OTHER_SEED)
        resumed.load_state_dict(state)
        got = []
        for j, batch in enumerate(resumed, start=k):
            got.append(batch)
            assert torch.equal(resumed_g.get_state(), states[0][j]), f"cut at {k}, after batch {j}"
        assert_same_stream(got, expected[0][k:], f"cut at {k}")
        assert_same_stream(list(resumed), expected[1], f"cut at {k}, next epoch")
        assert torch.equal(resumed_g.get_state(), states[1][-1])
