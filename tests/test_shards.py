"""snaploader.shards: a tar-shard stream's resume is exact, in a fresh process, and reads
the shuffle buffer and one shard's rest, not the epoch; other worker counts and world
sizes lose and repeat nothing; bad shards and foreign checkpoints are named errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from snaploader import CheckpointFormatError, CheckpointMismatchError
from snaploader.shards import Decoder, ShardError, ShardStream, decode, resplit
from snaploader.shards.tar import samples

from ._shard_streams import BATCH, BUFFER, PER_SHARD, SHARDS, augment, ids, make_loader, member, write_shards
from ._support import assert_same, mp_helpers  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
EVERY = list(range(SHARDS * PER_SHARD))


@pytest.fixture
def urls(tmp_path: Path) -> list[str]:
    return write_shards(tmp_path)


def _cut(urls: list[str], num_workers: int, k: int | None) -> dict[str, Any]:
    """The loader's state after ``k`` batches of epoch 0 (None: after the whole epoch)."""
    loader = make_loader(urls, num_workers)
    it = iter(loader)
    if k is None:
        list(it)
    else:
        for _ in range(k):
            next(it)
    state = loader.state_dict()
    del it
    return state


@pytest.mark.parametrize("num_workers", [0, 2])
def test_fresh_process_resume_is_bit_for_bit(urls: list[str], tmp_path: Path, num_workers: int) -> None:
    loader = make_loader(urls, num_workers)
    reference = [list(loader), list(loader)]
    assert sorted(ids(reference[0])) == EVERY and sorted(ids(reference[1])) == EVERY
    assert ids(reference[0]) != ids(reference[1])  # the epochs shuffle anew
    batches = len(reference[0])
    cuts = [batches // 10, batches // 2, batches * 9 // 10, None]
    jobs = [{"urls": urls, "num_workers": num_workers, "state": _cut(urls, num_workers, k), "seed": 99}
            for k in cuts]
    torch.save(jobs, tmp_path / "jobs.pt")
    done = subprocess.run([sys.executable, "-m", "tests._shard_streams", str(tmp_path / "jobs.pt"),
                           str(tmp_path / "out.pt")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for k, (rest, following) in zip(cuts, torch.load(tmp_path / "out.pt", weights_only=True)):
        assert_same(rest, reference[0][batches if k is None else k :])
        assert_same(following, reference[1])


def test_the_order_is_a_function_of_the_seed_and_torchs_for_it(urls: list[str]) -> None:
    ours = list(make_loader(urls, 2, seed=1))
    assert_same(ours, list(make_loader(urls, 2, seed=1)))
    assert ids(list(make_loader(urls, 0, seed=1))) != ids(list(make_loader(urls, 0, seed=2)))
    theirs = torch.utils.data.DataLoader(ShardStream(urls, shuffle_buffer=BUFFER, map=augment), batch_size=BATCH,
                                         num_workers=2, generator=torch.Generator().manual_seed(1))
    assert_same(ours, list(theirs))


class _CountingFile(io.FileIO):
    read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        _CountingFile.read_bytes += len(data)
        return data


def _counting_open(url: str) -> io.FileIO:
    return _CountingFile(url, "rb")


def test_a_resume_at_90_percent_reads_the_buffer_and_one_shard(urls: list[str]) -> None:
    loader = make_loader(urls, 0, open=_counting_open)
    batches = len(list(loader))
    k = batches * 9 // 10
    _CountingFile.read_bytes = 0
    it = iter(make_loader(urls, 0, open=_counting_open))
    for _ in range(k + 1):
        next(it)
    fresh = _CountingFile.read_bytes
    state = _cut(urls, 0, k)
    resumed = make_loader(urls, 0, open=_counting_open)
    resumed.load_state_dict(state)
    _CountingFile.read_bytes = 0
    next(iter(resumed))
    # A sample: three members of a 512-byte header and at most one 512-byte data block
    # each, and the next sample's first header read to end it. The resume reads the
    # buffered samples, those of its first batch, and at most one shard's headers.
    sample_bytes = 3 * 1024 + 512
    buffered = len(state["workers"][0]["yielded"]["data"]["buffer"])
    header_walk = PER_SHARD * 3 * 512 + 1024
    budget = (buffered + BATCH) * sample_bytes + header_walk
    assert 0 < buffered <= BUFFER
    assert _CountingFile.read_bytes <= budget, (_CountingFile.read_bytes, budget, fresh)
    assert _CountingFile.read_bytes * 5 < fresh


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_another_worker_count_goes_on_bit_for_bit(urls: list[str]) -> None:
    # 2 -> 3 workers: the interrupted epoch keeps its 2 logical workers (docs/elastic.md).
    reference = list(make_loader(urls, 2))
    state = _cut(urls, 2, 12)
    resumed = make_loader(urls, 3)
    resumed.load_state_dict(state)
    assert_same(list(resumed), reference[12:])
    assert sorted(ids(list(resumed))) == EVERY  # the next epoch is 3 workers' own


def _rank_states(urls: list[str], world: int, num_workers: int, depth: int = 0) -> tuple[list[int], list[dict[str, Any]]]:
    """Each rank of a ``world``-rank run cut after ``1 + depth * rank`` batches (ranks at
    different depths of their shares): the ids they yielded, and their states."""
    head: list[int] = []
    states = []
    for rank in range(world):
        loader = make_loader(urls, num_workers, rank=rank, world_size=world)
        it = iter(loader)
        head += ids([next(it) for _ in range(1 + depth * rank)])
        states.append(loader.state_dict())
        del it
    return head, states


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize(("old", "new", "workers"), [(2, 1, 2), (1, 2, 1), (2, 3, 3)])
def test_another_world_size_loses_and_repeats_nothing(urls: list[str], old: int, new: int, workers: int) -> None:
    head, states = _rank_states(urls, old, 2, depth=2)
    rest: list[int] = []
    for rank in range(new):
        rest += ids(list(resplit(states, make_loader(urls, workers, rank=rank, world_size=new))))
    assert sorted(head + rest) == EVERY


def test_a_checkpoint_in_a_resplit_epoch_resumes_exactly(urls: list[str]) -> None:
    _, states = _rank_states(urls, 2, 2)
    single = resplit(states, make_loader(urls, 2, rank=0, world_size=1))
    reference = [list(single), list(single)]
    assert sorted(ids(reference[1])) == EVERY  # after the rest of the old epoch, an ordinary one
    cut = resplit(states, make_loader(urls, 2, rank=0, world_size=1))
    it = iter(cut)
    head = [next(it) for _ in range(5)]
    state = cut.state_dict()
    del it
    resumed = resplit(states, make_loader(urls, 1, rank=0, world_size=1))
    resumed.load_state_dict(state)
    assert_same(head + list(resumed), reference[0])
    assert sorted(ids(list(resumed))) == EVERY  # the next epoch: 1 worker's, ordinary


def test_a_checkpoint_over_other_shards_is_refused(urls: list[str]) -> None:
    state = _cut(urls, 0, 5)
    for other in (urls[:-1], urls[::-1]):
        with pytest.raises(CheckpointMismatchError, match="another shard list"):
            make_loader(other, 0).load_state_dict(state)  # before any worker starts
    # In a worker too, where the stream's own load_state_dict() checks it again: the
    # error says why, with no note guessing that the protocol is lossy.
    stream = ShardStream(urls[:-1])
    with pytest.raises(CheckpointMismatchError, match="another shard list") as caught:
        iter(stream).load_state_dict(state["workers"][0]["yielded"]["data"])
    assert not getattr(caught.value, "__notes__", None)
    ended = _cut(urls, 0, None)  # an epoch's end holds no position in the shards
    make_loader(urls + [urls[0]], 0).load_state_dict(ended)


def test_a_checkpoint_of_another_world_size_points_to_resplit(urls: list[str]) -> None:
    loader = make_loader(urls, 2, rank=0, world_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    with pytest.raises(CheckpointMismatchError, match="snaploader.shards.resplit"):
        make_loader(urls, 2, rank=0, world_size=1).load_state_dict(state)


def test_an_edited_stream_state_is_a_format_error(urls: list[str]) -> None:
    stream = ShardStream(urls, shuffle_buffer=BUFFER)
    it = iter(stream)
    next(it)
    good = it.state_dict()
    for key, value in (("item", 99), ("buffer", [[SHARDS, 0]]), ("buffer", [[0, 0], [0, 0]]),
                       ("split", [0, 1, 0]), ("offset", "x")):
        bad = dict(good, **{key: value})
        with pytest.raises(CheckpointFormatError, match=key):
            iter(stream).load_state_dict(bad)
    it.close()


def _error_of(urls: list[str]) -> str:
    with pytest.raises(ShardError) as caught:
        list(make_loader(urls, 0))
    return str(caught.value)


def test_a_truncated_shard_is_named(urls: list[str]) -> None:
    path = Path(urls[2])
    data = path.read_bytes()
    path.write_bytes(data[: 1024 * 31 + 512 + 50])  # inside the data of member 31, a .npy
    message = _error_of(urls)
    assert urls[2] in message and "truncated in member" in message
    path.write_bytes(data[: 3 * 1024 * 5])  # at a member boundary, no end-of-archive blocks
    message = _error_of(urls)
    assert urls[2] in message and "end-of-archive" in message


def test_a_corrupt_header_is_named(urls: list[str]) -> None:
    path = Path(urls[1])
    data = bytearray(path.read_bytes())
    data[3 * 1024 * 4 + 100 : 3 * 1024 * 4 + 110] = b"garbage!!!"  # a header's mode field
    path.write_bytes(bytes(data))
    message = _error_of(urls)
    assert urls[1] in message and f"byte {3 * 1024 * 4}" in message


def test_a_missing_shard_is_named(urls: list[str]) -> None:
    Path(urls[4]).unlink()
    assert urls[4] in _error_of(urls) and "missing" in _error_of(urls)


def test_members_that_disagree_are_named(tmp_path: Path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        member(tar, "a.cls", b"1")
        member(tar, "a.cls", b"2")
    with pytest.raises(ShardError, match="two members with extension 'cls'"):
        list(ShardStream([str(path)]))


def test_samples_are_grouped_by_key_as_webdataset_does(tmp_path: Path) -> None:
    path = tmp_path / "names.tar"
    with tarfile.open(path, "w") as tar:
        member(tar, "dir.v1/x.seg.png", b"p")
        member(tar, "dir.v1/x.txt", b"t")
        member(tar, "noext", b"skipped")
        member(tar, "y.txt", b"u")
    with open(path, "rb") as f:
        got = [s for _, _, s in samples(f, "names", 0)]
    assert got == [{"__key__": "dir.v1/x", "__url__": "names", "seg.png": b"p", "txt": b"t"},
                   {"__key__": "y", "__url__": "names", "txt": b"u"}]


def test_plain_decoders(tmp_path: Path) -> None:
    array = io.BytesIO()
    np.save(array, np.eye(2))
    sample = {"__key__": "k", "__url__": "u", "npy": array.getvalue(), "json": b'{"a": 1}',
              "txt": "héllo".encode(), "cls": b"7", "bin": b"\x00"}
    got = decode(sample)
    assert np.array_equal(got["npy"], np.eye(2)) and got["json"] == {"a": 1}
    assert got["txt"] == "héllo" and got["cls"] == 7 and got["bin"] == b"\x00" and got["__key__"] == "k"
    with pytest.raises(ValueError) as caught:
        decode(dict(sample, json=b"{"))
    assert "member 'json' of sample 'k'" in "".join(caught.value.__notes__)


def test_images_decode_through_pil() -> None:
    image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    png = io.BytesIO()
    image.new("RGB", (3, 2), (10, 20, 30)).save(png, format="PNG")
    got = Decoder(image="numpy")({"png": png.getvalue()})["png"]
    assert got.shape == (2, 3, 3) and got[0, 0].tolist() == [10, 20, 30]


def test_webdataset_handlers_and_decoder() -> None:
    wds = pytest.importorskip("webdataset", reason="webdataset is not installed")
    sample = {"__key__": "k", "__url__": "u", "cls": b"3", "json": b'{"a": 2}'}
    ours = Decoder(wds.autodecode.basichandlers)(sample)
    theirs = wds.autodecode.Decoder([wds.autodecode.basichandlers])(sample)
    assert ours == theirs == {"__key__": "k", "__url__": "u", "cls": 3, "json": {"a": 2}}


def test_fsspec_memory_urls_resume_exactly(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed")
    local = write_shards(tmp_path, shards=3)
    fs = fsspec.filesystem("memory")
    urls = []
    for path in local:
        url = f"memory://snaploader-test/{Path(path).name}"
        fs.pipe(url, Path(path).read_bytes())
        urls.append(url)
    try:
        reference = list(make_loader(urls, 0))
        assert sorted(ids(reference)) == list(range(3 * PER_SHARD))
        state = _cut(urls, 0, 7)
        resumed = make_loader(urls, 0)
        resumed.load_state_dict(json.loads(json.dumps(state)))
        assert_same(list(resumed), reference[7:])
    finally:
        fs.rm("memory://snaploader-test", recursive=True)


def test_fsspec_local_files_seek(urls: list[str]) -> None:
    fsspec = pytest.importorskip("fsspec", reason="fsspec is not installed")

    def fsspec_open(url: str) -> Any:
        return fsspec.open(url, "rb").open()

    reference = list(make_loader(urls, 0))
    state = _cut(urls, 0, 20)
    resumed = make_loader(urls, 0, open=fsspec_open)
    resumed.load_state_dict(state)
    assert_same(list(resumed), reference[20:])


def test_the_main_processs_world_travels_to_a_spawned_worker(urls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    blob = pickle.dumps(ShardStream(urls))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert pickle.loads(blob).world() == (1, 2)
    assert ShardStream(urls).world() == (0, 1)


def test_a_url_without_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=r"snaploader\[shards\]"):
        list(ShardStream(["s3://bucket/shard-000.tar"]))


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="list of shard"):
        ShardStream("a.tar")
    with pytest.raises(ValueError, match="at least one"):
        ShardStream([])
    with pytest.raises(ValueError, match="shuffle_buffer"):
        ShardStream(["a.tar"], shuffle_buffer=-1)
    with pytest.raises(ValueError, match="rank"):
        ShardStream(["a.tar"], rank=2, world_size=2)


@pytest.mark.parametrize("persistent", [False, True])
def test_after_the_rest_of_a_resplit_epoch_the_epochs_are_ordinary(urls: list[str], persistent: bool) -> None:
    head, states = _rank_states(urls, 2, 2)
    workers = 2 if persistent else 0
    resplit_loader = resplit(states, make_loader(urls, workers, rank=0, world_size=1, persistent_workers=persistent))
    rest = ids(list(resplit_loader))
    assert sorted(head + rest) == EVERY
    assert sorted(ids(list(resplit_loader))) == EVERY


def test_every_public_name_has_a_section_in_the_docs() -> None:
    import snaploader.shards

    doc = (ROOT / "docs" / "shards.md").read_text()
    missing = [name for name in snaploader.shards.__all__ if f"`{name}" not in doc]
    assert not missing, f"docs/shards.md does not name {missing}"


@pytest.mark.usefixtures("mp_helpers")
def test_spawned_workers_resume_exactly(urls: list[str]) -> None:
    reference = list(make_loader(urls, 1))
    loader = make_loader(urls, 1, multiprocessing_context="spawn")
    it = iter(loader)
    head = [next(it) for _ in range(10)]
    state = loader.state_dict()
    del it
    resumed = make_loader(urls, 1, multiprocessing_context="spawn")
    resumed.load_state_dict(state)
    assert_same(head + list(resumed), reference)


def test_resplit_refuses_what_it_cannot_pool(urls: list[str]) -> None:
    _, states = _rank_states(urls, 2, 0)
    skipping = make_loader(urls, 0, rank=1, world_size=2)
    skipping.load_state_dict(states[1], skip=2)
    with pytest.raises(CheckpointMismatchError, match="pending skip"):
        resplit([states[0], skipping.state_dict()], make_loader(urls, 0, rank=0, world_size=1))
    with pytest.raises(CheckpointMismatchError, match="in rank order"):
        resplit(states[::-1], make_loader(urls, 0, rank=0, world_size=1))
    other = make_loader(urls, 0, seed=5, rank=1, world_size=2)
    it = iter(other)
    next(it)
    with pytest.raises(CheckpointMismatchError, match="different base seeds"):
        resplit([states[0], other.state_dict()], make_loader(urls, 0, rank=0, world_size=1))
    del it
    with pytest.raises(TypeError, match="ShardStream"):
        resplit(states, make_loader(urls, 0).__class__(list(range(4))))
