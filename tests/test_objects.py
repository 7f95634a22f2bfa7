"""Generator objects held by the dataset, its transforms and closures (``_rng/objects.py``):
exact resume, num_workers=0 as 1, torch's stream, the warnings and the options."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import snaploader
from snaploader._rng import objects as _objects

from ._object_datasets import (
    ClosureTransform,
    ManyGenerators,
    OwnGenerators,
    OwnStream,
    albumentations_dataset,
    noisy,
    reseed_own,
)
from ._support import assert_same_stream, cut_state, generator, mp_helpers, through_bytes  # noqa: F401

_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def _make(kind: str, workers: int, persistent: bool = False, context: str = "fork", **options: Any) -> snaploader.DataLoader:
    dataset: Any = OwnGenerators(21) if kind == "own" else ClosureTransform(21, noisy(4))
    return snaploader.DataLoader(
        dataset, batch_size=2, shuffle=True, num_workers=workers, persistent_workers=persistent and workers > 0,
        generator=generator(9), multiprocessing_context=context if workers else None,
        timeout=60 if workers else 0, **options,
    )


def _quiet_list(loader: Any) -> list[Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(loader)


def _cut(loader: snaploader.DataLoader, epochs_before: int, cut: int) -> dict[str, Any]:
    state = cut_state(loader, epochs_before, cut)
    _close(loader)
    return state


def _close(loader: snaploader.DataLoader) -> None:
    # persistent workers would otherwise live until the cyclic gc runs
    if loader._persistent_iter is not None:
        loader._persistent_iter.close()


# Under spawn, workers rebuild the dataset from a pickle and find its generators again:
# one fixed spawn case (a worker start costs seconds there), four drawn under fork.
@settings(max_examples=4, deadline=None, phases=_NO_SHRINK)
@example(kind="closure", workers=1, persistent=True, context="spawn", cut=5)
@given(
    kind=st.sampled_from(["own", "closure"]),
    workers=st.integers(0, 3),
    persistent=st.booleans(),
    context=st.just("fork"),
    cut=st.integers(0, 11),
)
def test_resume_is_exact_at_every_cut(
    kind: str, workers: int, persistent: bool, context: str, cut: int, mp_helpers: None  # noqa: F811
) -> None:
    loader = _make(kind, workers, persistent, context)
    assert loader.num_workers == workers and loader.persistent_workers == (persistent and workers > 0)
    expected = [_quiet_list(loader) for _ in range(3)]
    state = _cut(_make(kind, workers, persistent, context), 1, cut)
    resumed = _make(kind, workers, persistent, context)
    resumed.load_state_dict(state)
    got = _quiet_list(resumed) + _quiet_list(resumed)
    _close(loader)
    _close(resumed)
    assert_same_stream(got, expected[1][cut:] + expected[2])


_CHILD = """
import sys, torch, warnings
warnings.simplefilter("ignore")
from tests.test_objects import _make
for path, kind in zip(sys.argv[1::2], sys.argv[2::2]):
    loader = _make(kind, 2)
    loader.load_state_dict(torch.load(path, weights_only=True))
    torch.save([b for b in loader], path + ".out")
"""


def test_resume_in_a_fresh_process(tmp_path: Any) -> None:
    # Both kinds in one fresh process (each start imports torch: seconds).
    expected, args = {}, []
    for kind in ("own", "closure"):
        expected[kind] = _quiet_list(_make(kind, 2))
        path = str(tmp_path / f"state-{kind}.pt")
        torch.save(_cut(_make(kind, 2), 0, 5), path)
        args += [path, kind]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", _CHILD, *args], check=True, cwd=root, timeout=300)
    for kind in ("own", "closure"):
        assert_same_stream(torch.load(str(tmp_path / f"state-{kind}.pt.out"), weights_only=True), expected[kind][5:])


def test_without_a_checkpoint_the_stream_is_torchs() -> None:
    ours = _quiet_list(_make("own", 2, worker_init_fn=reseed_own))
    theirs = list(torch.utils.data.DataLoader(
        OwnGenerators(21), batch_size=2, shuffle=True, num_workers=2, generator=generator(9),
        worker_init_fn=reseed_own,
    ))
    assert_same_stream(ours, theirs)


def test_num_workers_0_is_1_across_epochs() -> None:
    zero, one = _make("own", 0), _make("own", 1)
    assert_same_stream(_quiet_list(zero) + _quiet_list(zero), _quiet_list(one) + _quiet_list(one))
    # and the dataset's generators, between epochs, are where a worker leaves them: untouched
    assert zero.dataset.py.random() == random.Random(0).random()


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_with_own_and_iterator_generators_resumes(workers: int) -> None:
    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(OwnStream(19), batch_size=2, num_workers=workers,
                                     generator=generator(2), replay="allow", timeout=60 if workers else 0)

    expected = _quiet_list(make())
    state = _cut(make(), 0, 4)
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_stream(_quiet_list(resumed), expected[4:])


def test_respawned_worker_resumes_its_generators() -> None:
    expected = _quiet_list(_make("own", 2))
    loader = _make("own", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        iterator = iter(loader)
        got = [next(iterator) for _ in range(4)]
        os.kill(iterator.runner.worker_pids[0], signal.SIGKILL)
        got += list(iterator)
    assert_same_stream(got, expected)


def test_workers_sharing_a_generator_state_are_warned_about_once() -> None:
    with pytest.warns(UserWarning, match=r"both started with dataset\.rng, dataset\.py, dataset\.g") as record:
        list(_make("own", 2))
    assert sum("both started" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(_make("own", 2, worker_init_fn=reseed_own))


def test_captured_rngs_names_paths_and_kinds() -> None:
    loader = _make("closure", 2)
    before = loader.captured_rngs()
    assert before == [("dataset.transform.<closure rng>", "numpy PCG64")]
    _quiet_list(loader)
    assert loader.captured_rngs() == before
    own = _make("own", 0)
    assert [path for path, _ in own.captured_rngs()] == ["dataset.rng", "dataset.py", "dataset.g"]


_HIDDEN = random.Random(11)  # reachable only as a global of this module


def _draws_hidden(batch: Any) -> Any:
    return [torch.utils.data.default_collate(batch), _HIDDEN.random()]


def _hidden() -> list[Any]:
    return [_HIDDEN]


def test_rng_objects_adds_and_exclude_rngs_removes() -> None:
    def make(**options: Any) -> snaploader.DataLoader:
        return snaploader.DataLoader(OwnGenerators(9), batch_size=2, num_workers=1,
                                     collate_fn=_draws_hidden, generator=generator(1), **options)

    expected = _quiet_list(make(rng_objects=_hidden))
    loader = make(rng_objects=_hidden, exclude_rngs=["dataset.g"])
    state = _cut(loader, 0, 2)
    paths = [path for path, _ in loader.captured_rngs()]
    assert paths == ["dataset.rng", "dataset.py", "rng_objects()[0]"]
    resumed = make(rng_objects=_hidden, exclude_rngs=lambda path, g: path == "dataset.g")
    resumed.load_state_dict(state)
    got = _quiet_list(resumed)
    assert [b[1] for b in got] == [b[1] for b in expected[2:]]  # the hidden generator resumed


@pytest.mark.parametrize("bad", [3, [1, 2], object()])
def test_bad_exclude_rngs_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="exclude_rngs should be paths"):
        snaploader.DataLoader(OwnGenerators(4), exclude_rngs=bad)
    with pytest.raises(ValueError, match="rng_objects should be a callable"):
        snaploader.DataLoader(OwnGenerators(4), rng_objects=[random.Random()])


class _WithSystemRandom(OwnGenerators):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.secure = random.SystemRandom()


def test_an_uncapturable_generator_is_named_once() -> None:
    loader = snaploader.DataLoader(_WithSystemRandom(6), batch_size=2, num_workers=0)
    with pytest.warns(UserWarning, match=r"dataset\.secure is a random\.SystemRandom") as record:
        list(loader)
        list(loader)
    assert sum("SystemRandom" in str(w.message) for w in record) == 1


def test_a_checkpoint_from_another_graph_names_the_path() -> None:
    state = _cut(_make("own", 1), 0, 3)
    other = snaploader.DataLoader(
        ClosureTransform(21, noisy(4)), batch_size=2, shuffle=True, num_workers=1, generator=generator(9), timeout=60,
    )
    other.load_state_dict(state, allow_mismatch=["dataset_kind"])
    with pytest.raises(snaploader.CheckpointFormatError, match=r"at dataset\.rng: the checkpoint has a numpy PCG64"):
        _quiet_list(other)


def test_an_out_of_range_state_is_refused_before_anything_runs() -> None:
    from snaploader._format import plain as _plain
    from snaploader._format.checkpoint import resign

    state = _cut(_make("own", 1), 0, 3)
    blob = bytearray(_plain.unb64(state["workers"][0]["yielded"]["objects"], "x"))
    at = blob.index(b"dataset.py") + len("dataset.py") + 1 + 4  # past the kind and length
    blob[at:at + 4] = (700).to_bytes(4, "little")  # Mersenne Twister position 700 > 624
    state["workers"][0]["yielded"]["objects"] = _plain.b64(bytes(blob))
    state["digest"] = resign(state)["digest"]
    with pytest.raises(snaploader.CheckpointFormatError, match=r"'objects'\] .*dataset\.py.*position 700"):
        _make("own", 1).load_state_dict(state)


def test_the_walk_skips_big_scalar_lists_and_stops_at_its_bound() -> None:
    names = ManyGenerators(4, 1, names=1_000_000)
    found, problems = _objects.discover([("dataset", names)], None)
    assert [entry.path for entry in found] == ["dataset.generators[0]"] and not problems
    crowd = [(i,) for i in range(_objects.MAX_VISITS + 10)] + [np.random.default_rng(1)]
    found, problems = _objects.discover([("dataset", crowd)], None)
    assert not found and "stopped looking for generator objects" in problems[0]


@pytest.mark.integration
@pytest.mark.parametrize("seed", [1234, None])
def test_albumentations_compose_resumes_exactly(seed: int | None) -> None:
    pytest.importorskip("albumentations", reason="albumentations is not installed (pip install -e '.[integrations]')")
    dataset = albumentations_dataset(14, seed)

    def make() -> snaploader.DataLoader:
        return snaploader.DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2,
                                     generator=generator(3), timeout=60)

    paths = [path for path, _ in make().captured_rngs()]
    assert "dataset.transform.transforms[0].random_generator" in paths
    assert "dataset.transform.transforms[2].py_random" in paths
    expected = _quiet_list(make())
    state = _cut(make(), 0, 3)
    # a new Compose: unseeded, it starts from other entropy; the checkpoint's states win
    resumed = snaploader.DataLoader(albumentations_dataset(14, seed), batch_size=2, shuffle=True,
                                    num_workers=2, generator=generator(3), timeout=60)
    resumed.load_state_dict(state)
    assert_same_stream(_quiet_list(resumed), expected[3:])
