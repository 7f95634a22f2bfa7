"""``snaploader verify``: passes on pipelines that resume exactly, fails with the right
diagnosis on three that cannot, and answers bad input with exit 2 and what to do.

The end-to-end tests start real child processes (each imports torch: seconds); they
use tiny datasets, one or two cuts and few epochs to stay short.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import snaploader
from snaploader._tools import verify as _verify
from snaploader.__main__ import main
from snaploader._tools.verify_child import Cut
from snaploader._tools.verify_loader import UsageError, build, load_factory
from snaploader._tools.verify_record import leaf_digests, split_recorded

from ._verify_pipelines import DATA_FILE_ENV, Jittered

ROOT = Path(__file__).resolve().parent.parent
PIPELINES = "tests._verify_pipelines"


def flat(text: str) -> str:
    """``text`` with its line wrapping undone."""
    return " ".join(text.split())


def verify(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = _verify.main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(autouse=True)
def from_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # The child runs import tests._verify_pipelines from their working folder.
    monkeypatch.chdir(ROOT)


# -- pipelines that resume exactly ------------------------------------------------------


@pytest.mark.slow
def test_demo_pipeline_resumes_exactly_with_a_worker_killed() -> None:
    code, out, err = verify(f"{PIPELINES}:demo_loader", "--cuts", "boundary", "--kill-worker")
    assert code == 0, out + err
    assert "map-style dataset, 2 workers, 2 epochs of 12 batches" in out
    assert "boundary epoch 0 ended 12 identical" in flat(out)
    assert "SIGKILLed worker pid" in out and "WorkerRespawnedWarning" in out  # it hit a busy worker
    # Batches are named by their index from 0, as skip_to and the warnings name them:
    # the kill comes right after the first resumed batch, batch 0 of epoch 1.
    assert "after batch 0 of epoch 1" in out
    assert "resumes exactly: 12 batches compared" in out
    assert "a second uninterrupted run in a fresh process is identical too" in flat(out)
    assert "verify: reference run" in err and "verify: resume from cut boundary" in err


@pytest.mark.slow
def test_iterable_pipeline_resumes_exactly_mid_epoch() -> None:
    code, out, err = verify(f"{PIPELINES}:iterable", "--cuts", "mid")
    assert code == 0, out + err
    assert "iterable-style dataset, 2 workers, 2 epochs of 8 batches" in out
    assert "mid epoch 0, after 4 batches 12 identical" in flat(out)


def test_torch_loader_is_rebuilt_with_its_arguments_and_records_indices() -> None:
    built = build(f"{PIPELINES}:augmented_map_torch")
    assert isinstance(built.loader, snaploader.DataLoader) and built.recorded
    assert "returned a torch DataLoader" in built.notes[0]
    assert isinstance(built.loader.dataset, Jittered)  # still the user's class
    assert isinstance(built.loader.sampler, torch.utils.data.RandomSampler)
    assert built.loader.num_workers == 2 and built.loader.batch_size == 4
    same = snaploader.DataLoader(Jittered(48), batch_size=4, shuffle=True, num_workers=2,
                                 generator=torch.Generator().manual_seed(3), multiprocessing_context="fork")
    for tagged, plain in zip(built.loader, same, strict=True):
        indices, batch = split_recorded(tagged)
        assert torch.equal(batch, plain)
        assert indices == [int(v) for v in plain[:, 0]]


@pytest.mark.slow
def test_a_cut_that_compares_nothing_is_not_a_pass() -> None:
    # With one epoch, the end cut has nothing after it: it is reported as checking
    # nothing, the summary counts only the mid cut, and the torch-loader note (made by
    # every run) is printed once.
    code, out, err = verify(f"{PIPELINES}:augmented_map_torch", "--epochs", "1", "--cuts", "mid,end")
    assert code == 0, out + err
    assert "end epoch 0, after 12 batches 0 nothing to compare: the run ends here" in flat(out)
    assert "resumes exactly: 6 batches compared after 1 cut," in flat(out)
    assert "not checked: cut end compared nothing" in flat(out)
    assert out.count("returned a torch DataLoader") == 1
    code, out, err = verify(f"{PIPELINES}:augmented_map_torch", "--epochs", "1", "--cuts", "end")
    assert code == 2, out + err
    assert "resumes exactly" not in out
    assert "nothing checked: cut end compared nothing" in flat(out)


# -- pipelines that do not, each with its diagnosis -----------------------------------


def verify_broken(name: str) -> tuple[str, str]:
    """(report with its wrapping undone, progress) of a pipeline that must fail."""
    code, out, err = verify(f"{PIPELINES}:{name}", "--epochs", "1", "--cuts", "mid")
    assert code == 1, out + err
    # after 2 batches (0 and 1), the first resumed one, batch 2, differs
    assert "mid epoch 0, after 2 batches 1 DIFFERS from epoch 0 batch 2" in flat(out)
    return flat(out), err


@pytest.mark.slow
def test_generator_in_another_module_is_diagnosed_as_not_captured() -> None:
    out, _ = verify_broken("uncaptured")
    assert "sample indices: the same in both runs" in out
    assert "randomness or state that snaploader does not capture" in out
    assert "nondeterministic" not in out and "data changed" not in out


@pytest.mark.slow
def test_data_changed_on_disk_between_runs_is_diagnosed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "values.txt"
    data.write_text(" ".join(str(v) for v in range(16)))
    monkeypatch.setenv(DATA_FILE_ENV, str(data))
    out, err = verify_broken("changing_data")
    assert "the data changed while verify ran: a second uninterrupted run and the resumed runs agree" in out
    assert "with the same sample indices" in out
    assert "does not capture" not in out and "nondeterministic" not in out
    assert "diagnosis: two more" not in err  # the resumed run already told


@pytest.mark.slow
def test_time_seeded_augmentation_is_diagnosed_as_nondeterministic() -> None:
    out, err = verify_broken("time_seeded")
    assert "the pipeline is nondeterministic" in out and "time.time_ns()" in out
    assert "data changed" not in out and "does not capture" not in out
    assert "diagnosis: two more uninterrupted runs" in err


# -- usage errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no_colon"], "should be MODULE:FACTORY"),
        (["m:f", "--cuts", "0"], "cut '0' is not understood"),
        (["m:f", "--cuts", "mid@x"], "the epoch after '@' should be a number"),
        (["m:f", "--cuts", "mid@2"], "raise --epochs to 3"),
        (["m:f", "--cuts", ","], "--cuts is empty"),
        (["m:f", "--timeout-s", "0"], "--timeout-s should be a positive number"),
    ],
)
def test_bad_options_exit_2_with_what_to_do(args: list[str], message: str) -> None:
    code, out, err = verify(*args)
    assert code == 2 and out == ""
    assert message in err


def test_bad_number_exits_2() -> None:
    with pytest.raises(SystemExit) as raised:
        verify("m:f", "--epochs", "0")
    assert raised.value.code == 2


@pytest.mark.slow
def test_a_run_that_outlives_the_timeout_is_killed() -> None:
    # --timeout-s 1 ends the run while it still imports torch: the kill path, cheaply.
    code, out, err = verify(f"{PIPELINES}:hangs", "--epochs", "1", "--timeout-s", "1")
    assert code == 2, out + err
    assert "did not finish within --timeout-s 1; it was killed with its workers" in err


@pytest.mark.slow
def test_factory_that_returns_no_loader_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", f"{PIPELINES}:not_a_loader"])  # through the command dispatcher
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "returned a builtins.list" in err and "should return a snaploader.DataLoader" in err


# -- the pieces -----------------------------------------------------------------------


def test_cuts_resolve_against_the_epochs_the_run_saw() -> None:
    lengths, ended = [6, 6], [True, False]
    assert Cut.parse("mid").resolve(lengths, ended, 64) == (0, 3)
    assert Cut.parse("end@1").resolve(lengths, ended, 64) == (1, 6)
    assert Cut.parse("first").resolve(lengths, ended, 64) == (0, 1)
    assert Cut.parse("boundary").resolve(lengths, ended, 64) == (0, None)
    with pytest.raises(UsageError, match="more than --max-batches 6"):
        Cut.parse("boundary@1").resolve(lengths, ended, 6)
    with pytest.raises(UsageError, match="pick a cut between 1 and 6"):
        Cut.parse("7").resolve(lengths, ended, 64)


def test_digest_sees_dtype_shape_bytes_and_structure() -> None:
    base = {"x": torch.zeros(2, 3), "y": [1, "a"]}
    digest, leaves = leaf_digests(base)
    assert [path for path, _ in leaves] == ["batch['x']", "batch['y'][0]", "batch['y'][1]"]
    variants = [
        {"x": torch.zeros(2, 3, dtype=torch.float64), "y": [1, "a"]},
        {"x": torch.zeros(3, 2), "y": [1, "a"]},
        {"x": torch.zeros(2, 3).index_fill_(0, torch.tensor([1]), -0.0), "y": [1, "a"]},
        {"x": torch.zeros(2, 3), "y": (1, "a")},
        {"x": torch.zeros(2, 3), "y": [1, "b"]},
        {"y": [1, "a"], "x": torch.zeros(2, 3)},
    ]
    assert len({digest} | {leaf_digests(v)[0] for v in variants}) == len(variants) + 1
    assert leaf_digests({"x": torch.zeros(2, 3).t().t(), "y": [1, "a"]})[0] == digest
    assert leaf_digests(torch.ones(2, dtype=torch.bfloat16))[0] != leaf_digests(torch.ones(2, dtype=torch.float16))[0]


def test_factory_from_a_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_pipeline_for_verify.py").write_text("def make():\n    return 42\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_pipeline_for_verify", raising=False)
    try:
        assert load_factory(f"{tmp_path}/my_pipeline_for_verify.py:make")() == 42
        with pytest.raises(UsageError, match="has no 'other'; its callables are \\['make'\\]"):
            load_factory(f"{tmp_path}/my_pipeline_for_verify.py:other")
    finally:
        sys.modules.pop("my_pipeline_for_verify", None)
    with pytest.raises(UsageError, match="no such file"):
        load_factory(f"{tmp_path}/missing.py:make")
    with pytest.raises(UsageError, match="module 'tests.no_such_module': not found"):
        load_factory("tests.no_such_module:make")
