"""A tar-shard stream (``snaploader.shards.ShardStream``) resumed late in its epoch: the
time to the first batch through its state (the shuffle buffer re-read by seeks, the open
shard read on from its offset) beside the replay path (the same stream with
``state_protocol=False``, each worker re-reading its share up to the cut) and a fresh
epoch's first batch, snaploader's and torch's DataLoader's, measured in the same run.

The shards are written to a temporary folder; every sample is one 1 KiB member, and
reading a member's data sleeps ``read_ms`` (a remote store's latency per sample)."""

from __future__ import annotations

import gc
import io
import os
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from stress._probes import median, saved_bytes

from .restore import time_first_batch

from snaploader import DataLoader
from snaploader.shards import ShardStream

_MEMBER_BYTES = 1024


class _SlowFile(io.FileIO):
    """A shard whose member data reads sleep (a tar header is one 512-byte read)."""

    read_s = 0.0

    def read(self, size: int | None = -1) -> bytes:
        if size is not None and size > tarfile.BLOCKSIZE:
            time.sleep(self.read_s)
        return super().read(size)


def _write(folder: str, shards: int, per_shard: int) -> list[str]:
    urls = []
    for s in range(shards):
        path = os.path.join(folder, f"shard-{s:03d}.tar")
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                index = s * per_shard + i
                info = tarfile.TarInfo(f"{index:08d}.bin")
                info.size = _MEMBER_BYTES
                tar.addfile(info, io.BytesIO(index.to_bytes(8, "little") * (_MEMBER_BYTES // 8)))
        urls.append(path)
    return urls


def _augment(sample: dict[str, Any]) -> torch.Tensor:
    index = int.from_bytes(sample["bin"][:8], "little")
    return torch.tensor([float(index), torch.rand(()).item()], dtype=torch.float64)


def measure_shards(
    shards: int, per_shard: int, buffer: int, batch_size: int, workers: int, read_ms: float,
    fraction: float, repeats: int, seed: int = 0, log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Median ms to the first batch: a fresh epoch (torch's DataLoader and snaploader's),
    and a resume after ``fraction`` of the epoch through the stream's state and by
    replay; whether each resumed batch is the uninterrupted run's."""
    folder = tempfile.mkdtemp(prefix="snaploader-bench-shards-")
    urls = _write(folder, shards, per_shard)
    read_s = read_ms / 1000

    def slow_open(url: str) -> io.FileIO:
        file = _SlowFile(url, "rb")
        file.read_s = read_s
        return file

    def stream() -> ShardStream:
        return ShardStream(urls, shuffle_buffer=buffer, map=_augment, open=slow_open)

    def snap(state_protocol: bool) -> DataLoader[Any]:
        return DataLoader(stream(), batch_size=batch_size, num_workers=workers, state_protocol=state_protocol,
                          replay="allow", generator=torch.Generator().manual_seed(seed))

    total = shards * per_shard // batch_size
    k = int(total * fraction)
    checkpoints: dict[str, tuple[bytes, torch.Tensor]] = {}
    for name, protocol in (("state", True), ("replay", False)):
        loader = snap(protocol)
        iterator = iter(loader)
        for _ in range(k):
            next(iterator)
        checkpoints[name] = (saved_bytes(loader.state_dict()), next(iterator))
        del iterator, loader
        gc.collect()

    def first_batch(case: str) -> tuple[float, bool]:
        if case == "torch":
            loader: Any = torch.utils.data.DataLoader(stream(), batch_size=batch_size, num_workers=workers,
                                                      generator=torch.Generator().manual_seed(seed))
        else:
            loader = snap(case != "replay")
        expected, state = None, None
        if case in checkpoints:
            raw, expected = checkpoints[case]
            state = torch.load(io.BytesIO(raw), weights_only=True)
        ms, batch = time_first_batch(loader, state)
        del loader
        return ms, expected is None or torch.equal(batch, expected)

    cases = ("torch", "fresh", "state", "replay")
    times: dict[str, list[float]] = {c: [] for c in cases}
    exact = {c: True for c in cases}
    for r in range(repeats):
        for case in cases[r % len(cases):] + cases[: r % len(cases)]:
            ms, same = first_batch(case)
            times[case].append(ms)
            exact[case] = exact[case] and same
    for url in urls:
        os.unlink(url)
    os.rmdir(folder)
    result: dict[str, Any] = {
        "shards": shards, "per_shard": per_shard, "buffer": buffer, "batch_size": batch_size,
        "workers": workers, "read_ms": read_ms, "resume_after": k, "batches_per_epoch": total,
        "ms": {c: median(times[c]) for c in cases}, "all_ms": times,
        "exact": {c: exact[c] for c in ("state", "replay")},
    }
    got = result["ms"]
    log(f"  first batch: torch fresh {got['torch']:.0f} ms, snaploader fresh {got['fresh']:.0f} ms, "
        f"resumed after {k}/{total} by state {got['state']:.0f} ms, by replay {got['replay']:.0f} ms")
    return result


def shards_text(measured: dict[str, Any]) -> list[str]:
    """The printed rows: time to the first batch, and each against torch's fresh epoch."""
    ms = measured["ms"]
    torch_ms = ms["torch"]
    exact = measured["exact"]
    rows = [("torch, fresh epoch", "torch", None), ("snaploader, fresh epoch", "fresh", None),
            ("resumed by state", "state", exact["state"]),
            ("resumed by replay (state_protocol=False)", "replay", exact["replay"])]
    return [
        "",
        f"Shard stream: {measured['shards']} tar shards x {measured['per_shard']} samples, "
        f"shuffle buffer {measured['buffer']}, batch {measured['batch_size']}, W={measured['workers']}, "
        f"{measured['read_ms']:g} ms a sample read; resumed after batch {measured['resume_after']} "
        f"of {measured['batches_per_epoch']}",
        f"  {'to the first batch':41s} {'ms':>7s} {'x torch':>8s}  resumed batch exact",
    ] + [
        f"  {label:41s} {ms[case]:7.0f} {ms[case] / torch_ms:8.2f}"
        + ("" if same is None else f"  {'yes' if same else 'NO'}")
        for label, case, same in rows
    ]


def main() -> None:
    """``python -m stress.bench.shards [--quick]``: this measure alone, the full run's sizes
    (``--quick``: its repeats)."""
    import argparse
    import warnings

    from .config import Config

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the --quick run's repeats")
    config = Config.quick() if parser.parse_args().quick else Config.full()
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    measured = measure_shards(*config.shards, config.shards_read_ms, config.shards_fraction,
                              config.shards_repeats, config.seed)
    print("\n".join(shards_text(measured)))


if __name__ == "__main__":
    main()
