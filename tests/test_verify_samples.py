"""``snaploader verify --resume-batch-size N --resume-workers N``: each cut resumed into
another batch size and worker count, compared sample by sample.

Three end-to-end runs (child processes: seconds each) pin the three verdicts: exact with
per-sample seeds; order exact but values differ without them, with the suggestion; an
order failure from a sampler whose state is not captured. The pieces (cutting a batch
into samples, the loaders the mode refuses, a lost sample) are checked in-process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from snaploader._tools.verify_compare import CutResult, compare, plan
from snaploader._tools.verify_loader import Topology, UsageError, build
from snaploader._tools.verify_record import Unsplittable, sample_digests

from .test_verify import PIPELINES, flat, verify

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def from_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # The child runs import tests._verify_pipelines from their working folder.
    monkeypatch.chdir(ROOT)


# -- end to end ---------------------------------------------------------------------------


@pytest.mark.slow
def test_per_sample_seeds_resume_into_another_batch_size_and_worker_count_exactly() -> None:
    code, out, err = verify(f"{PIPELINES}:per_sample_seeds", "--cuts", "2",
                            "--resume-batch-size", "6", "--resume-workers", "1")
    assert code == 0, out + err
    assert "each cut resumed into batch_size 6 and num_workers 1, compared sample by sample" in out
    # 40 samples an epoch, 8 read before the cut: 32 of epoch 0, then all 40 of epoch 1
    # (batched by 6 in the resumed run, by 4 in the uninterrupted one).
    assert "2 epoch 0, after 2 batches 72 identical" in flat(out)
    assert "resumes exactly into batch_size 6 and num_workers 1: 72 samples compared after 1 cut" in flat(out)


@pytest.mark.slow
def test_without_per_sample_seeds_the_order_is_exact_and_the_values_differ() -> None:
    code, out, err = verify(f"{PIPELINES}:worker_draws", "--cuts", "2",
                            "--resume-batch-size", "6", "--resume-workers", "1")
    assert code == 1, out + err
    text = flat(out)
    assert "VALUES DIFFER from epoch 0 sample" in text
    assert "in both runs, so the values differ, not the order" in text
    assert "order exact, values differ" in text and "Without per-sample seeds this is expected" in text
    assert "seed_per_sample=True" in text
    assert "does not capture" not in text and "ORDER DIFFERS" not in text


@pytest.mark.slow
def test_a_sampler_whose_state_is_lost_is_an_order_failure() -> None:
    code, out, err = verify(f"{PIPELINES}:uncaptured_sampler", "--cuts", "boundary", "--resume-batch-size", "6")
    assert code == 1, out + err
    text = flat(out)
    # Epoch 1 of a fresh process starts the sampler's count over: another permutation.
    assert "ORDER DIFFERS from epoch 1 sample 0" in text
    assert "samples lost, repeated or reordered" in text
    assert "the sample order after resume differs" in text and "sampler" in text
    assert "seed_per_sample=True to make" not in text


# -- what the mode refuses ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resume-batch-size", "0"], "argument --resume-batch-size: 0 should be 1 or more"),
        (["--resume-workers", "-1"], "argument --resume-workers: -1 should be 0 or more"),
        (["--resume-workers", "two"], "argument --resume-workers: 'two' is not a whole number"),
    ],
)
def test_bad_option_values_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        verify("m:f", *args)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "topology", "message"),
    [
        ("iterable", Topology(batch_size=6), "need a map-style dataset, and this one is a Shards"),
        ("custom_batches", Topology(batch_size=6), "this one has batch_sampler=BatchSampler"),
        ("unbatched", Topology(num_workers=2), "this one has batch_size=None"),
        ("unordered", Topology(batch_size=6), "the loader has in_order=False"),
        ("worker_draws", Topology(batch_size=4, num_workers=2), "--resume-batch-size 4 and --resume-workers 2 are the loader's own"),
        # only the flag given is named (the worker count was the loader's by default)
        ("worker_draws", Topology(batch_size=4), r"^--resume-batch-size 4 is the loader's own \(batch_size=4\): .*drop it "),
        ("worker_draws", Topology(num_workers=2), r"^--resume-workers 2 is the loader's own \(num_workers=2\)"),
    ],
)
def test_loaders_the_mode_cannot_check_are_refused(name: str, topology: Topology, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        build(f"{PIPELINES}:{name}", topology)


def test_the_resumed_loader_is_built_in_the_new_topology() -> None:
    built = build(f"{PIPELINES}:per_sample_seeds", Topology(6, 0), resumed=True)
    loader = built.loader
    assert (loader.batch_size, loader.num_workers, loader.seed_per_sample) == (6, 0, True)
    assert loader.logical_workers == 0  # as the factory builds it with num_workers=0
    assert build(f"{PIPELINES}:per_sample_seeds", Topology(6, 0)).loader.batch_size == 4  # the reference


# -- the pieces ----------------------------------------------------------------------------


def _samples(n: int) -> list[dict[str, object]]:
    return [{"x": torch.full((2, 3), float(i)), "name": f"s{i}", "pair": (i, torch.tensor([i, -i]))}
            for i in range(n)]


def test_a_sample_digest_does_not_depend_on_its_batch() -> None:
    samples = _samples(6)
    whole = sample_digests(default_collate(samples), 6)
    cut = sample_digests(default_collate(samples[:4]), 4) + sample_digests(default_collate(samples[4:]), 2)
    assert whole == cut
    assert len({digest for digest, _ in whole}) == 6
    assert [path for path, _ in whole[0][1]] == ["sample['x']", "sample['name']", "sample['pair'][0]",
                                                "sample['pair'][1]"]
    # A collate_fn that returns the samples as they are: a list of them.
    assert sample_digests(samples[:4], 4)[2] == sample_digests(samples[1:4], 3)[1]


def test_a_batch_that_cannot_be_cut_names_the_part() -> None:
    with pytest.raises(Unsplittable, match=r"batch\['x'\] is a Tensor of shape \(3,\), whose first dimension"):
        sample_digests({"x": torch.zeros(3), "y": torch.zeros(4)}, 4)
    with pytest.raises(Unsplittable, match=r"batch\[1\] is a float \(0.5\), one value for the whole batch"):
        sample_digests((torch.zeros(4), 0.5), 4)


def _record(epoch: int, k: int, indices: list[int]) -> dict[str, object]:
    return {"epoch": epoch, "k": k, "indices": indices,
            "samples": [[f"d{i}", [["sample", f"d{i}"]]] for i in indices]}


def test_a_sample_lost_after_the_resume_is_an_order_failure() -> None:
    # Batches of 2 over 6 items, cut after 1 batch; resumed by 4: one sample missing.
    reference = {"batches": [_record(0, 1, [5, 3]), _record(0, 2, [1, 0]), _record(0, 3, [4, 2])],
                 "lengths": [3], "ended": [True], "batch_size": 2, "drop_last": False, "items": 6,
                 "logical_workers": 0, "num_workers": 0, "persistent_workers": False}
    cut = CutResult(["1"], (0, 1), "unused")
    compare(reference, cut, {"batches": [_record(0, 1, [1, 0, 4])]}, Topology(4))
    assert cut.samples is not None and cut.samples.kind == "order"
    assert cut.verdict == "ORDER DIFFERS from epoch 0 sample 5"
    assert "the resumed run yielded 3 samples of epoch 0 after the cut, the uninterrupted run 4" in cut.samples.describe()[0]
    assert "samples lost" in cut.samples.describe()[0]
    cut = CutResult(["1"], (0, 1), "unused")
    compare(reference, cut, {"batches": [_record(0, 1, [1, 0, 4, 2])]}, Topology(4))
    assert cut.samples is None and cut.compared == 4 and cut.verdict == "identical"
    # After the last batch of the last epoch the run ends: nothing to compare, and no note.
    end = CutResult(["end"], (0, 3), "unused")
    compare(reference, end, {"batches": []}, Topology(4))
    assert end.empty and end.verdict == "nothing to compare: the run ends here" and not end.notes


def test_epochs_after_one_left_part_way_are_not_compared() -> None:
    # Epoch 0 left after --max-batches: where it left the sampler's generator depends on
    # the batch size, so epoch 1 is neither read nor compared, and a note says why.
    reference = {"batches": [_record(0, 1, [5, 3]), _record(0, 2, [1, 0]), _record(1, 1, [2, 4])],
                 "lengths": [2, 1], "ended": [False, True], "batch_size": 2, "drop_last": False, "items": 6,
                 "logical_workers": 0, "num_workers": 0, "persistent_workers": False}
    cut = CutResult(["1"], (0, 1), "unused")
    assert [step["epoch"] for step in plan(reference, cut, Topology(3))] == [0]
    assert plan(reference, cut, Topology(3))[0]["want"] == 2
    compare(reference, cut, {"batches": [_record(0, 1, [1, 0, 4])]}, Topology(3))
    assert cut.verdict == "identical" and cut.compared == 2
    assert "epochs after epoch 0 not compared" in cut.notes[0]


def test_a_persistent_loader_resumed_into_other_workers_is_compared_in_the_interrupted_epoch_only() -> None:
    # At num_workers=0 the loader has no persistent workers, and at another count they
    # cannot carry their states on: its next epochs start as a new loader's, which draws
    # a base seed each epoch where the persistent loader drew one once: another stream.
    reference = {"batches": [_record(0, 1, [5, 3]), _record(0, 2, [1, 0]), _record(1, 1, [2, 4])],
                 "lengths": [2, 1], "ended": [True, True], "batch_size": 2, "drop_last": False, "items": 4,
                 "logical_workers": 2, "num_workers": 2, "persistent_workers": True}
    cut = CutResult(["1"], (0, 1), "unused")
    assert [step["epoch"] for step in plan(reference, cut, Topology(num_workers=0))] == [0]
    # Another worker count: the next epoch starts as a new loader's too.
    assert [step["epoch"] for step in plan(reference, cut, Topology(num_workers=1))] == [0]
    # A new batch size alone keeps the persistent workers' stream.
    assert [step["epoch"] for step in plan(reference, cut, Topology(batch_size=3))] == [0, 1]
    compare(reference, cut, {"batches": [_record(0, 1, [1, 0])]}, Topology(num_workers=0))
    assert cut.verdict == "identical" and cut.compared == 2
    assert "epochs after epoch 0 not compared: the loader has persistent workers, and the resumed one has none" in cut.notes[0]
    boundary = CutResult(["boundary"], (0, None), "unused")
    compare(reference, boundary, {"batches": []}, Topology(num_workers=0))
    assert boundary.empty and boundary.verdict == "nothing compared (see the notes)"
