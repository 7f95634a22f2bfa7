"""``snaploader inspect``: reads loader states from checkpoints of every configuration,
wherever they sit in the file, as text and as JSON; bad input exits 2 with what to do."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import snaploader
from snaploader._tools import inspect as _inspect

from ._datasets import DrawingRange
from ._iterable_datasets import IteratorStateStream, PlainStream
from ._support import take


class TorchDraws(torch.utils.data.Dataset[torch.Tensor]):
    """Item i: [i, a draw from torch's global RNG] (Python's random and NumPy untouched)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(()))])


def inspect(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = _inspect.main(list(args), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def as_json(path: Path, *args: str, status: int = 0) -> list[dict[str, Any]]:
    code, out, err = inspect(str(path), "--json", *args)
    assert code == status, err
    parsed = json.loads(out)
    assert parsed["file"] == str(path)
    return parsed["states"]  # type: ignore[no-any-return]


def make_loader(kind: str, workers: int, persistent: bool) -> snaploader.DataLoader:
    dataset: Any = DrawingRange(16) if kind == "map" else PlainStream(16)
    return snaploader.DataLoader(
        dataset, batch_size=2, shuffle=kind == "map", num_workers=workers,
        persistent_workers=persistent, replay="allow",
        generator=torch.Generator().manual_seed(0),
        multiprocessing_context="fork" if workers else None,
    )


CONFIGS = [
    (kind, workers, persistent)
    for kind in ("map", "iterable")
    for workers in (0, 2)
    for persistent in (False, True)
    if workers or not persistent
]


@pytest.mark.parametrize(("kind", "workers", "persistent"), CONFIGS)
def test_every_configuration_mid_epoch_and_ended(
    tmp_path: Path, kind: str, workers: int, persistent: bool
) -> None:
    loader = make_loader(kind, workers, persistent)
    iterator = iter(loader)
    take(iterator, 3)
    mid = loader.state_dict()
    list(iterator)
    ended = loader.state_dict()
    del iterator, loader
    path = tmp_path / "ckpt.pt"
    torch.save({"step": 3, "model": {"w": torch.zeros(2)}, "loader": mid}, path)

    (summary,) = as_json(path)
    assert summary["key"] == "loader" and summary["format"] == "snaploader" and summary["version"] == 3
    assert summary["integrity"] == "digest matches, fields valid"
    assert summary["fingerprint"]["dataset_kind"] == kind
    assert summary["fingerprint"]["num_workers"] == workers
    assert summary["fingerprint"]["persistent_workers"] is persistent
    assert (summary["epoch"], summary["batches_consumed"], summary["epoch_ended"]) == (0, 3, False)
    # the batch index from 0, which load_state_dict(skip_to=) takes: 3 yielded, batch 3 next
    assert summary["next"] == "the next iter() continues epoch 0 at batch 3"
    assert len(summary["workers"]) == max(1, workers)
    produced = [w["batches_produced"] for w in summary["workers"]]
    assert sum(produced) == 3 and produced[0] == (3 if workers == 0 else 2)
    # every item draws from all three global RNGs, in each worker that produced one
    assert all(w["rng_moved"] == ["python random", "numpy", "torch"] for w in summary["workers"])
    assert summary["size_bytes"] == len(_saved(mid))
    if kind == "iterable":
        assert all(w["replay_batches"] == w["batches_produced"] for w in summary["workers"])

    code, out, err = inspect(str(path))
    assert code == 0, err
    assert f"loader state at loader: format snaploader version 3, {summary['size_bytes']:,} bytes" in out
    assert "integrity    digest matches, fields valid" in out
    # an unsigned edit that leaves every field valid is shown, marked; one that does
    # not is a one-line error naming both problems
    edited = {**mid, "fingerprint": {**mid["fingerprint"], "drop_last": True}}
    torch.save({"loader": edited}, path)
    # exit status 1: a script validates a checkpoint by it
    (summary_edited,) = as_json(path, status=1)
    assert summary_edited["integrity"].startswith("INVALID: loader state['digest'] does not match")
    code, text, _ = inspect(str(path))
    assert code == 1 and "integrity    INVALID: loader state['digest'] does not match" in text
    torch.save({"loader": dict(mid, yielded=mid["yielded"] + 1)}, path)
    code, _, err = inspect(str(path))
    assert code == 2 and err.count("\n") == 1
    # the field is named, as load_state_dict names it
    assert "['yielded'] is 4, but the workers produced 3" in err
    assert "epoch 0, 3 batches consumed, epoch not ended" in out
    assert f"num_workers {workers}" in out

    torch.save(ended, path)
    (summary,) = as_json(path)
    assert summary["key"] == "" and summary["epoch_ended"] is True
    assert summary["batches_consumed"] == 8 and summary["next"] == "the next iter() starts epoch 1"
    assert inspect(str(path))[1].startswith("loader state at (top level):")


def _saved(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def test_rng_flags_name_only_the_generators_that_moved(tmp_path: Path) -> None:
    loader = snaploader.DataLoader(TorchDraws(), batch_size=2)
    iterator = iter(loader)
    next(iterator)
    path = tmp_path / "ckpt.pt"
    torch.save(loader.state_dict(), path)
    del iterator
    (summary,) = as_json(path)
    assert summary["workers"][0]["rng_moved"] == ["torch"]
    assert summary["rng_kind"] == "global"
    fresh = snaploader.DataLoader(TorchDraws(), batch_size=2)
    torch.save(fresh.state_dict(), path)
    (summary,) = as_json(path)
    assert summary["epoch"] == -1 and summary["workers"] == []
    assert "no epoch started yet" in inspect(str(path))[1]


def test_iterator_state_is_reported_with_its_owner(tmp_path: Path) -> None:
    loader = snaploader.DataLoader(IteratorStateStream(8), batch_size=2)
    iterator = iter(loader)
    take(iterator, 2)
    path = tmp_path / "ckpt.pt"
    torch.save(loader.state_dict(), path)
    del iterator
    (summary,) = as_json(path)
    worker = summary["workers"][0]
    assert worker["data_state"] == "iterator" and worker["replay_batches"] == 0
    assert "held (iterator)" in inspect(str(path))[1]


def test_nested_states_are_all_found_and_key_selects_one(tmp_path: Path) -> None:
    first = snaploader.DataLoader(DrawingRange(8), batch_size=2)
    second = snaploader.DataLoader(DrawingRange(12), batch_size=3)
    take(iter(second), 1)
    path = tmp_path / "ckpt.pt"
    torch.save({"trainer": {"loaders": [first.state_dict(), second.state_dict()], "lr": 0.1}}, path)
    found = as_json(path)
    assert [s["key"] for s in found] == ["trainer.loaders.0", "trainer.loaders.1"]
    assert [s["fingerprint"]["dataset_length"] for s in found] == [8, 12]
    (picked,) = as_json(path, "--key", "trainer.loaders.1")
    assert picked["key"] == "trainer.loaders.1" and picked["fingerprint"]["batch_size"] == 3
    code, out, _ = inspect(str(path))
    assert code == 0 and out.count("loader state at trainer.loaders.") == 2


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ({"model": {}}, [], "holds no snaploader loader state (its top-level keys: 'model')"),
        ({"a": {"b": 1}}, ["--key", "a.c"], "--key a.c: no 'c' at a; the keys there are 'b'"),
        ({"a": [1]}, ["--key", "a.3"], "--key a.3: a is a list of 1 items, which has no '3'"),
        ({"a": {"b": 1}}, ["--key", "a.b"], "--key a.b holds a int, not a snaploader loader state"),
        ({"format": "snaploader", "version": 4}, [], "format version 4; this snaploader reads versions 2, 3"),
        ({"format": "snaploader", "version": 3}, [], "(version 3) is malformed: loader state has no 'digest' key"),
        ({"format": "snaploader", "version": 2}, [], "(version 2) is malformed"),
    ],
)
def test_bad_checkpoints_exit_2_with_what_to_do(
    tmp_path: Path, content: Any, args: list[str], message: str
) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save(content, path)
    code, out, err = inspect(str(path), *args)
    assert code == 2 and out == ""
    assert message in err, err


def test_unreadable_files_exit_2(tmp_path: Path) -> None:
    code, _, err = inspect(str(tmp_path / "missing.pt"))
    assert code == 2 and "missing.pt: no such file" in err
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    code, _, err = inspect(str(junk))
    assert code == 2 and "was not written by torch.save" in err
    objects = tmp_path / "objects.pt"
    torch.save({"loader": Path("x")}, objects)
    code, _, err = inspect(str(objects))
    assert code == 2 and "holds objects that torch.load(weights_only=True) refuses" in err, err
    code, _, err = inspect(str(tmp_path))
    assert code == 2 and "is a folder" in err


def _real_state() -> dict[str, Any]:
    loader = make_loader("map", 0, False)
    iterator = iter(loader)
    take(iterator, 2)
    state = loader.state_dict()
    del iterator
    return state


@pytest.mark.parametrize(
    ("edit", "as_json_too", "message"),
    [
        (lambda s: s["workers"][0]["yielded"].update(rng="!!not base64!!"), False, "['rng'] is not valid base64"),
        (lambda s: s.update(fingerprint="map"), False, "['fingerprint'] should be dict, got str"),
        (lambda s: s.update(ended=torch.tensor(False)), False, "holds something that is not plain data"),
        (lambda s: s["fingerprint"].update(batch_size=torch.tensor(2)), True, "holds something that is not plain data"),
    ],
)
def test_every_malformed_state_is_one_line_and_exit_2(tmp_path: Path, edit: Any, as_json_too: bool, message: str) -> None:
    state = _real_state()
    edit(state)
    path = tmp_path / "ckpt.pt"
    torch.save({"loader": state}, path)
    for args in ([str(path), "--json"] if as_json_too else [str(path)], [str(path)]):
        code, out, err = inspect(*args)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert message in err, err


def _deep_file(path: Path, depth: int) -> None:
    # torch.save (a recursive pickler) cannot write it: a file saved from a small list,
    # its pickle replaced by one that nests ``depth`` lists (pushed, then appended).
    import zipfile

    torch.save([0], path)
    with zipfile.ZipFile(path) as archive:
        entries = {info: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in entries.items():
            if info.filename.endswith("/data.pkl"):
                data = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
            archive.writestr(info, data)


def test_a_file_nested_200000_deep_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "deep.pt"
    _deep_file(path, 200_000)
    code, out, err = inspect(str(path))
    assert code == 2 and out == "" and err.count("\n") == 1, err[-300:]
    assert "nests dicts and lists more than 100 deep" in err


def test_piped_into_a_reader_that_stops_early_no_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "ckpt.pt"
    torch.save({"loaders": [_real_state()] * 400}, path)
    shell = f"{sys.executable} -m snaploader inspect {path} | head -n 1"
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {shell}"], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("loader state at loaders.0"), done.stdout
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
