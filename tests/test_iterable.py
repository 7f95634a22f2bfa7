"""Iterable datasets: torch's stream, and exact resume at every cut point.

What a user relies on:

- with equal shards (``get_worker_info()`` sharding), snaploader yields what torch's
  DataLoader yields: same order, same worker seeds, same augmentations drawn from the
  three global RNGs inside workers, two epochs, W = 1, 2, 3, with ``drop_last``,
  ``batch_size=None``, a custom collate and persistent workers;
- ``num_workers=0`` yields what ``num_workers=1`` yields;
- with unequal shards the order is a fixed round-robin over the workers not yet run
  dry, whatever the timing (torch's depends on timing there);
- ``state_dict()`` after any batch, and on either side of an epoch's StopIteration,
  saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)`` into a
  new loader whose generator is seeded differently (or in a new process), resumes the
  stream bit for bit, into the next epoch too: for an iterator with
  ``state_dict()``/``load_state_dict()``, a dataset with them, a generator function
  without them (replay), unequal shards, persistent workers, an iterator that keeps its
  own ``np.random.Generator`` in its state, and ``snapshot_every > 1``;
- a replay is announced once per restore by a warning naming the dataset, how many
  batches each worker replays and how to avoid it; ``replay="allow"`` is silent;
  ``replay="refuse"`` raises ReplayRefusedError from ``load_state_dict``;
- a ``state_dict()`` holding what a weights_only load refuses raises
  StateNotPlainDataError naming the key path and the type, from a worker process too.

Every resumed run uses a generator seeded differently from the original: the
checkpoint, not the new loader's arguments, must decide the stream.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import snaploader
from snaploader import ReplayRefusedError, StateNotPlainDataError

from . import _iterable_datasets as ids
from ._iterable_child import build_loader
from ._support import assert_same_stream, mp_helpers, through_bytes  # noqa: F401  (mp_helpers: a fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

ROOT = Path(__file__).resolve().parent.parent
EPOCHS = 2
SEED, OTHER_SEED = 1, 99
# Each example starts worker processes; shrinking a failure would start hundreds.
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
_STATEFUL = ["IteratorStateStream", "DatasetStateStream", "OwnGeneratorStream"]
_KINDS = ["PlainStream", *_STATEFUL]


def n_for(workers: int) -> int:
    """Equal shards for ``workers`` whose last batch of 3 is short (3+3+1, 3+2, 3+1)."""
    return {0: 7, 1: 7, 2: 10, 3: 12}[workers]


def config(dataset: str, workers: int, **options: Any) -> dict[str, Any]:
    """A loader description for :func:`build_loader` (shared with the child process)."""
    cfg: dict[str, Any] = {"dataset": dataset, "num_workers": workers, **options}
    if "sizes" not in cfg:
        cfg.setdefault("n", n_for(workers))
    return cfg


def sum_collate(batch: list[torch.Tensor]) -> dict[str, Any]:
    return {"sum": torch.stack(list(batch)).sum(0), "size": len(batch)}


# -- references and cuts -----------------------------------------------------------------


@dataclass
class Cut:
    epoch: int
    taken: int  # batches taken in that epoch
    stopped: bool  # the epoch's StopIteration was seen
    state: dict[str, Any]

    def __str__(self) -> str:
        after = ", after StopIteration" if self.stopped else ""
        return f"cut after {self.taken} batch(es) of epoch {self.epoch}{after}"


@dataclass
class Reference:
    epochs: list[list[Any]]
    cuts: list[Cut]


def run_with_cuts(cfg: dict[str, Any]) -> Reference:
    """The uninterrupted stream of EPOCHS epochs and, through torch.save and a
    weights_only load, the checkpoint at every cut: after iter() and after every batch,
    and once more after the epoch's StopIteration."""
    loader = build_loader(cfg, SEED)
    epochs: list[list[Any]] = []
    cuts: list[Cut] = []
    for epoch in range(EPOCHS):
        batches: list[Any] = []
        iterator = iter(loader)
        cuts.append(Cut(epoch, 0, False, through_bytes(loader.state_dict())))
        for batch in iterator:
            batches.append(batch)
            cuts.append(Cut(epoch, len(batches), False, through_bytes(loader.state_dict())))
        cuts.append(Cut(epoch, len(batches), True, through_bytes(loader.state_dict())))
        epochs.append(batches)
    assert_not_trivial(epochs)
    return Reference(epochs, cuts)


def assert_not_trivial(epochs: list[list[Any]]) -> None:
    """The stream draws from every global RNG and differs between epochs, so a worker
    that resumed with the wrong RNG state or in the wrong epoch would be caught."""
    rows = [torch.atleast_2d(b) for b in epochs[0] if isinstance(b, torch.Tensor)]
    assert rows and len(epochs[0]) > 1
    first = torch.cat(rows)
    for column in (2, 3, 4):  # random, numpy, torch
        assert first[:, column].unique().numel() == first.shape[0], "an RNG column repeats"
    assert not torch.equal(torch.cat([torch.atleast_2d(b) for b in epochs[1]])[:, 2:], first[:, 2:])


def resume(cfg: dict[str, Any], cut: Cut, seed: int = OTHER_SEED) -> list[list[Any]]:
    """A new loader (another generator seed) that loads ``cut``; the rest of the run."""
    loader = build_loader(cfg, seed)
    loader.load_state_dict(cut.state)
    return [list(loader) for _ in range(epochs_left(cut))]


def epochs_left(cut: Cut) -> int:
    return EPOCHS - cut.epoch - (1 if cut.stopped else 0)


def expected(ref: Reference, cut: Cut) -> list[list[Any]]:
    if cut.stopped:
        return ref.epochs[cut.epoch + 1 :]
    return [ref.epochs[cut.epoch][cut.taken :], *ref.epochs[cut.epoch + 1 :]]


def check(ref: Reference, cut: Cut, got: list[list[Any]]) -> None:
    want = expected(ref, cut)
    assert len(got) == len(want), f"{cut}: {len(got)} epochs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same_stream(g, w, f"{cut}, resumed epoch {cut.epoch + i + (1 if cut.stopped else 0)}")


def check_every_cut(cfg: dict[str, Any]) -> Reference:
    ref = run_with_cuts(cfg)
    for cut in ref.cuts:
        check(ref, cut, resume(cfg, cut))
    return ref


# -- equivalence with torch ------------------------------------------------------------


def _loader_pair(
    dataset: Any, workers: int, **kwargs: Any
) -> tuple[snaploader.DataLoader, torch.utils.data.DataLoader]:
    def build(cls: type[torch.utils.data.DataLoader]) -> Any:
        return cls(dataset, num_workers=workers, generator=torch.Generator().manual_seed(SEED), **kwargs)

    return build(snaploader.DataLoader), build(torch.utils.data.DataLoader)


def assert_same_epochs(ours: torch.utils.data.DataLoader, theirs: torch.utils.data.DataLoader) -> list[list[Any]]:
    got = [list(ours) for _ in range(EPOCHS)]
    want = [list(theirs) for _ in range(EPOCHS)]
    for epoch in range(EPOCHS):
        assert_same_stream(got[epoch], want[epoch], f"epoch {epoch}")
    return got


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_same_stream_as_torch(workers: int) -> None:
    ours, theirs = _loader_pair(ids.PlainStream(n=n_for(workers)), workers, batch_size=3)
    got = assert_same_epochs(ours, theirs)
    assert_not_trivial(got)


@settings(max_examples=10, deadline=None, phases=_NO_SHRINK)
@given(
    workers=st.sampled_from([1, 2, 3]),
    kind=st.sampled_from(_KINDS),
    batch_size=st.sampled_from([None, 1, 2, 3]),
    drop_last=st.booleans(),
    custom_collate=st.booleans(),
    persistent=st.booleans(),
)
def test_same_stream_as_torch_options(
    workers: int, kind: str, batch_size: int | None, drop_last: bool, custom_collate: bool, persistent: bool
) -> None:
    dataset = getattr(ids, kind)(n=n_for(workers))
    drop_last = drop_last and batch_size is not None  # torch refuses both
    options: dict[str, Any] = {"batch_size": batch_size, "drop_last": drop_last, "persistent_workers": persistent}
    if custom_collate:
        options["collate_fn"] = sum_collate
    ours, theirs = _loader_pair(dataset, workers, **options)
    assert (ours.num_workers, ours.batch_size, ours.drop_last, ours.persistent_workers) == (
        workers, batch_size, drop_last, persistent,
    )
    got = assert_same_epochs(ours, theirs)
    per_shard = n_for(workers) // workers
    if batch_size is None:
        per_worker = per_shard
    elif drop_last:
        per_worker = per_shard // batch_size
    else:
        per_worker = -(-per_shard // batch_size)
    assert len(got[0]) == per_worker * workers
    if custom_collate:
        assert all(isinstance(b, dict) for b in got[0])


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("batch_size", [None, 3])
def test_no_workers_is_worker_0_of_one(kind: str, batch_size: int | None) -> None:
    streams = []
    for workers in (0, 1):
        loader = snaploader.DataLoader(
            getattr(ids, kind)(n=7), batch_size=batch_size, num_workers=workers,
            generator=torch.Generator().manual_seed(SEED),
        )
        streams.append([list(loader) for _ in range(EPOCHS)])
    # num_workers=0 iterates the dataset object itself (torch's contract): a dataset
    # that keeps state across epochs in its attributes (DatasetStateStream counts its
    # passes) carries it into the next epoch there, and not in a worker process, which
    # iterates a fresh copy each epoch. The first epoch is the same stream.
    same_epochs = 1 if kind == "DatasetStateStream" else EPOCHS
    for epoch in range(same_epochs):
        assert_same_stream(streams[0][epoch], streams[1][epoch], f"epoch {epoch}")
    assert_not_trivial(streams[0])


def test_no_workers_iterates_the_callers_dataset_as_torch_does() -> None:
    def passes(cls: type[torch.utils.data.DataLoader]) -> list[tuple[int, int]]:
        dataset = ids.DatasetStateStream(n=7)
        loader = cls(dataset, batch_size=3, num_workers=0)
        seen = []
        for _ in range(2):
            iterator = iter(loader)
            next(iterator)
            seen.append((dataset.pos, dataset.passes))
            list(iterator)
            seen.append((dataset.pos, dataset.passes))
        return seen

    assert passes(snaploader.DataLoader) == passes(torch.utils.data.DataLoader) == [(3, 0), (0, 1), (3, 1), (0, 2)]


@pytest.mark.parametrize("workers", [0, 2])
def test_more_batches_than_len_warns_as_torch_does(workers: int) -> None:
    # torch compares the batches yielded with len(dataset), here 2: batches 3 and 4 warn
    dataset = ids.MisreportedLength(n=12, reported=2)

    def length_warnings(cls: type[torch.utils.data.DataLoader]) -> list[str]:
        loader = cls(dataset, batch_size=3, num_workers=workers, generator=torch.Generator().manual_seed(SEED))
        assert len(loader) == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len(list(loader)) == 4
        return [str(w.message) for w in caught if "was reported to be" in str(w.message)]

    ours = length_warnings(snaploader.DataLoader)
    assert len(ours) == 2
    assert ours == length_warnings(torch.utils.data.DataLoader)


# -- unequal shards: the order ---------------------------------------------------------


def round_robin(sizes: tuple[int, ...], batch_size: int, drop_last: bool) -> list[list[int]]:
    """The sample ids of each batch, as documented: round-robin over the workers
    that still have a batch."""
    per_worker = []
    for w, size in enumerate(sizes):
        ids_ = [1000 * w + j for j in range(size)]
        chunks = [ids_[i : i + batch_size] for i in range(0, size, batch_size)]
        if drop_last:
            chunks = [c for c in chunks if len(c) == batch_size]
        per_worker.append(chunks)
    order = []
    for r in range(max(len(c) for c in per_worker)):
        order += [chunks[r] for chunks in per_worker if r < len(chunks)]
    return order


@pytest.mark.parametrize("slow", [0, 1])
def test_unequal_shards_order_is_fixed_whatever_the_timing(slow: int) -> None:
    sizes, batch_size = (2, 7, 4), 2
    loader = snaploader.DataLoader(
        ids.SlowWorkerStream(sizes, slow=slow, delay_s=0.02), batch_size=batch_size, num_workers=3
    )
    got = [b[:, 0].long().tolist() for b in loader]
    assert got == round_robin(sizes, batch_size, drop_last=False)


@settings(max_examples=3, deadline=None, phases=_NO_SHRINK)
@given(
    workers=st.sampled_from([2, 3]),
    sizes=st.lists(st.integers(0, 6), min_size=3, max_size=3),
    batch_size=st.sampled_from([2, 3]),
    drop_last=st.booleans(),
    kind=st.sampled_from(["PlainStream", "IteratorStateStream", "DatasetStateStream"]),
)
def test_unequal_shards_resume_at_every_cut(
    workers: int, sizes: list[int], batch_size: int, drop_last: bool, kind: str
) -> None:
    sizes[0] = 6  # at least one worker has batches in every example
    cfg = config(kind, workers, sizes=sizes[:workers], batch_size=batch_size, drop_last=drop_last)
    ref = check_every_cut(cfg)
    order = round_robin(tuple(sizes[:workers]), batch_size, drop_last)
    for epoch in ref.epochs:
        assert [b[:, 0].long().tolist() for b in epoch] == order


# -- exact resume at every cut ---------------------------------------------------------


@pytest.mark.parametrize(
    "kind,workers",
    [(kind, w) for kind in _KINDS for w in (0, 2)]
    + [("PlainStream", 3), ("ShuffleBufferStream", 2)],
)
def test_resume_at_every_cut(kind: str, workers: int) -> None:
    check_every_cut(config(kind, workers, replay="allow"))


@pytest.mark.parametrize("kind", ["PlainStream", "IteratorStateStream", "DatasetStateStream"])
def test_persistent_workers_resume_at_every_cut(kind: str) -> None:
    check_every_cut(config(kind, 2, persistent_workers=True, replay="allow"))


def test_persistent_workers_stay_the_same_processes() -> None:
    # Each worker's last batch is short, and its prefetched tasks are still answered
    # after it: the epoch's end must not cost a restart of the workers.
    loader = snaploader.DataLoader(ids.PidStream(n=10), batch_size=3, num_workers=2, persistent_workers=True)
    pids = [{int(pid) for batch in loader for pid in batch[:, 1]} for _ in range(3)]
    assert len(pids[0]) == 2
    assert pids[0] == pids[1] == pids[2]


@pytest.mark.parametrize(
    "kind,workers,every",
    [("IteratorStateStream", 2, 3), ("OwnGeneratorStream", 2, 2), ("DatasetStateStream", 0, 2),
     ("IteratorStateStream", 2, 0), ("DatasetStateStream", 0, 0)],
)
def test_snapshot_every_n_resumes_at_every_cut(kind: str, workers: int, every: int) -> None:
    # A stateful dataset snapshotted every N batches replays at most N-1 batches from
    # its last snapshot: by choice, so neither a warning nor a refusal. N=0 (torchdata's
    # snapshot_every_n_steps=0) snapshots only after a worker's last batch: resume
    # replays from the epoch start, as exactly.
    cfg = config(kind, workers, snapshot_every=every, replay="refuse")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*replays")
        check_every_cut(cfg)


def test_cut_at_the_end_of_an_epoch() -> None:
    # The three states around an epoch's end: after its last batch, after its
    # StopIteration, and after iter() of the next epoch (k=0). All go on with the next
    # epoch, the first of them after an empty rest of its own epoch.
    cfg = config("IteratorStateStream", 2, sizes=(5, 2))  # the last batch is worker 0's 3rd
    ref = run_with_cuts(cfg)
    last = [c for c in ref.cuts if c.epoch == 0 and c.taken == len(ref.epochs[0])]
    assert [c.stopped for c in last] == [False, True]
    first_of_next = next(c for c in ref.cuts if c.epoch == 1 and c.taken == 0)
    for cut in [*last, first_of_next]:
        got = resume(cfg, cut)
        check(ref, cut, got)
    before_stop = resume(cfg, last[0])
    assert before_stop[0] == [] and len(before_stop[1]) == len(ref.epochs[1])


# -- in a fresh process and under spawn -------------------------------------------------


def resume_in_fresh_process(tmp_path: Path, jobs: list[tuple[dict[str, Any], Cut]]) -> list[list[list[Any]]]:
    """Resume each (config, cut) in one new Python process; what each yielded."""
    jobs_path, out_path = tmp_path / "jobs.pt", tmp_path / "out.pt"
    torch.save(
        [
            {"config": cfg, "state": cut.state, "epochs": epochs_left(cut), "seed": OTHER_SEED + i}
            for i, (cfg, cut) in enumerate(jobs)
        ],
        jobs_path,
    )
    done = subprocess.run(
        [sys.executable, "-m", "tests._iterable_child", str(jobs_path), str(out_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = torch.load(out_path, weights_only=True)
    assert len(results) == len(jobs)
    return results


def some_cuts(ref: Reference) -> list[Cut]:
    """Mid epoch 0, after its last batch, after its StopIteration, mid epoch 1."""
    zero = [c for c in ref.cuts if c.epoch == 0 and not c.stopped]
    one = [c for c in ref.cuts if c.epoch == 1 and not c.stopped]
    stopped = next(c for c in ref.cuts if c.epoch == 0 and c.stopped)
    return [zero[len(zero) // 2], zero[-1], stopped, one[len(one) // 2]]


def test_resume_in_a_fresh_process(tmp_path: Path) -> None:
    configs = [
        config("IteratorStateStream", 2, persistent_workers=True),
        config("DatasetStateStream", 0),
        config("PlainStream", 3, sizes=(2, 7, 4)),
        config("OwnGeneratorStream", 2, snapshot_every=2),
    ]
    refs = [run_with_cuts(cfg) for cfg in configs]
    jobs = [(cfg, cut) for cfg, ref in zip(configs, refs) for cut in some_cuts(ref)]
    results = resume_in_fresh_process(tmp_path, jobs)
    for (cfg, cut), got in zip(jobs, results):
        ref = refs[configs.index(cfg)]
        check(ref, cut, got)


@pytest.mark.usefixtures("mp_helpers")
def test_resume_under_spawn() -> None:
    # Checkpoints taken under fork resume under spawn: the context changes nothing.
    cfg = config("IteratorStateStream", 2, persistent_workers=True)
    ref = run_with_cuts(cfg)
    cut = ref.cuts[2]
    spawned = dict(cfg, context="spawn")
    assert build_loader(spawned, SEED).multiprocessing_context.get_start_method() == "spawn"
    check(ref, cut, resume(spawned, cut))


# -- replay without the protocol ---------------------------------------------------------


def replay_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "replays" in str(w.message)]


def test_replay_warns_once_per_restore_and_says_what_and_how_to_avoid() -> None:
    cfg = config("PlainStream", 2, n=16, replay="warn")  # 3 batches a worker: 3, 3, 2
    ref = run_with_cuts(cfg)
    cut = next(c for c in ref.cuts if c.epoch == 0 and c.taken == 3)
    for _ in range(2):  # each restore announces itself
        loader = build_loader(cfg, OTHER_SEED)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.load_state_dict(cut.state)
            got = [list(loader) for _ in range(EPOCHS)]
        check(ref, cut, got)
        messages = replay_warnings(caught)
        assert len(messages) == 1, messages
        message = messages[0]
        # worker 0 produced batches 0 and 2, worker 1 batch 1
        assert "PlainStream" in message
        assert "worker 0: 2, worker 1: 1" in message
        assert "state_dict()/load_state_dict()" in message
        assert "replay='allow'" in message
        # the first line says what happens and what to do, the details come after
        first = message.splitlines()[0]
        assert first.startswith("an exact resume of PlainStream replays 3 batch(es) from the epoch start")
        assert "to avoid it, implement state_dict()/load_state_dict()" in first
        assert "replay='allow' silences this warning" in first and "worker 0:" not in first
        warned = next(w for w in caught if "replays" in str(w.message))
        assert warned.filename == __file__, "the warning should point at the caller's iter()"


def test_replay_allow_is_silent() -> None:
    cfg = config("PlainStream", 2, replay="allow")
    ref = run_with_cuts(cfg)
    cut = next(c for c in ref.cuts if c.epoch == 1 and c.taken == 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = resume(cfg, cut)
    assert replay_warnings(caught) == []
    check(ref, cut, got)


def test_replay_refuse_raises_in_load_state_dict() -> None:
    cfg = config("PlainStream", 2, replay="refuse")
    ref = run_with_cuts(cfg)
    for cut in ref.cuts:
        loader = build_loader(cfg, OTHER_SEED)
        needs_replay = not cut.stopped and cut.taken > 0 and cut.taken < len(ref.epochs[cut.epoch])
        if needs_replay:
            with pytest.raises(ReplayRefusedError) as raised:
                loader.load_state_dict(cut.state)
            message = str(raised.value)
            assert "PlainStream" in message and "replay='refuse'" in message
            assert re.search(r"worker 0: \d+, worker 1: \d+", message)
            assert "state_dict()/load_state_dict()" in message
        else:
            # Nothing to replay (an epoch start, or every worker past its last
            # batch): refusing would be pointless, and the resume is exact.
            loader.load_state_dict(cut.state)
            check(ref, cut, [list(loader) for _ in range(epochs_left(cut))])


def test_replay_skips_workers_that_ran_dry() -> None:
    # Worker 0 (2 samples) ran dry long before the cut: only worker 1 replays.
    cfg = config("PlainStream", 2, sizes=(2, 9), replay="warn")
    ref = run_with_cuts(cfg)
    cut = next(c for c in ref.cuts if c.epoch == 0 and c.taken == 3)
    loader = build_loader(cfg, OTHER_SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(cut.state)
        got = [list(loader) for _ in range(EPOCHS)]
    check(ref, cut, got)
    assert len(replay_warnings(caught)) == 1
    assert "worker 0: 0, worker 1: 2" in replay_warnings(caught)[0]


# -- state that is not plain data --------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(
    "bad,type_name", [("ndarray", "numpy.ndarray"), ("generator", "numpy.random._generator.Generator")]
)
def test_state_not_plain_data(workers: int, bad: str, type_name: str) -> None:
    loader = snaploader.DataLoader(ids.BadStateStream(8, bad), batch_size=2, num_workers=workers)
    iterator = iter(loader)
    with pytest.raises(StateNotPlainDataError) as raised:
        next(iterator)
    message = str(raised.value)
    assert "['extra']['inner']" in message, message
    assert type_name in message, message
    assert "weights_only=True" in message
    if workers:
        assert any("worker process" in note for note in raised.value.__notes__)
