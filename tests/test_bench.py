"""The benchmark (the package stress/bench/) on tiny settings: every measurement runs and
results.json and the printed tables have the expected shape. No timing is asserted here;
the benchmark reports, it never fails on a timing."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from stress.bench.__main__ import run
from stress.bench.config import Config, LoopCase, StateDictCase
from stress.bench.contenders import available, build_loader, find_contenders
from stress.bench.report import render_text
from stress.bench.seed_per_sample import SEEDED, seeded_contender
from stress.bench.workloads import NoiseItems


def tiny_config() -> Config:
    return Config(
        mode="test",
        workers=(0, 1),
        repeats=1,
        trial_s=0.2,
        workloads={"compute": 4, "tiny": 8, "large": 4, "sleep": 4},
        snapshot_calls=20,
        # the light case spans two epochs of persistent workers; the heavy one is short
        state_dict_cases=(
            StateDictCase(1, 100, "plain", 3), StateDictCase(2, 100_000, "plain", 3),
            StateDictCase(2, 64, "light", 6), StateDictCase(2, 32, "heavy", 2),
        ),
        loop_cases=(LoopCase("light", 4),),
        loop_repeats=1,
        checkpoint_workers=2,
        restore_items=2_000,
        restore_batch_size=16,
        restore_late_fraction=0.9,
        restore_repeats=1,
        table_workers=1,
        seed_workers=(0, 1),
        seed_repeats=2,
        seed_batches=6,
        seed_states_calls=2,
        shards=(3, 8, 4, 4, 1),
        shards_read_ms=0.5,
        shards_repeats=1,
        pin_repeats=2,
        pin_batches=4,
    )


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_run_writes_every_output(tmp_path: Path) -> None:
    config = tiny_config()
    report = run(config, tmp_path, log=lambda line: None)

    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("meta", "config", "contenders", "workloads", "state_dict", "seed_per_sample", "pinning", "restore", "shards",
                "timing_s"):
        assert key in saved, key
    measured = [c for c, v in saved["contenders"].items() if v["skipped"] is None]
    assert {"torch", "snaploader"} <= set(measured)
    if "torchdata" not in measured:
        assert saved["contenders"]["torchdata"]["skipped"]  # says why

    assert set(saved["workloads"]) == set(config.workloads)
    for name, entry in saved["workloads"].items():
        assert set(entry["by_workers"]) == {str(w) for w in config.workers}, name
        for row in entry["by_workers"].values():
            assert set(row) == set(measured)
            for summary in row.values():
                assert _positive(summary["ratio_to_torch"])
                assert _positive(summary["throughput_bps"])
                assert _positive(summary["first_batch_ms"])
                assert _positive(summary["peak_rss_mb"])
                assert summary["cpu_us_per_batch"] >= 0 and summary["worker_cpu_us_per_batch"] >= 0
                assert len(summary["runs"]) == config.repeats
                assert _positive(summary["peak_fds"])  # Linux: /proc/self/fd
        snapshot = entry["snapshot"]
        assert _positive(snapshot["snapshot_us"]) and _positive(snapshot["capture_rng_us"])
        assert _positive(snapshot["snapshot_after_batch_us"]) and 0 < snapshot["share_of_batch"] < 1
        assert snapshot["snapshot_pickled_bytes"] > snapshot["rng_bytes"] > 0

    stateful = [c for c in measured if c != "torch"]
    assert len(saved["state_dict"]) == len(config.state_dict_cases) * len(stateful)
    for row, case in zip(saved["state_dict"], [c for c in config.state_dict_cases for _ in stateful]):
        assert (row["workers"], row["dataset_len"], row["pipeline"]) == (case.workers, case.dataset_len, case.pipeline)
        assert row["steps"] == case.steps == len(row["cold_us"])
        assert len(row["warm_us"]) == case.steps * config.state_dict_warm_calls
        for kind in ("cold", "warm"):
            assert 0 < row[kind]["median_us"] <= row[kind]["p99_us"] <= row[kind]["max_us"]
            if sys.platform == "linux":  # the waits for a CPU are read from /proc
                own = row[f"{kind}_own"]
                assert 0 <= own["median_us"] <= own["p99_us"] <= own["max_us"] <= row[kind]["max_us"]
                assert 0 <= row[f"{kind}_waited_calls"] <= len(row[f"{kind}_us"])
        assert row["size_bytes"] == max(row["sizes_bytes"]) > 0
    light = [r for r in saved["state_dict"] if r["pipeline"] == "light"]
    assert light and all(r["epochs"] == 2 and r["persistent"] for r in light)

    assert len(saved["training_loop"]) == len(config.loop_cases)
    loop = saved["training_loop"][0]
    assert loop["workers"] == config.checkpoint_workers and set(loop["loaders"]) == set(measured)
    assert _positive(loop["loaders"]["torch"]["without_sps"]) and "with_sps" not in loop["loaders"]["torch"]
    for name in stateful:
        entry = loop["loaders"][name]
        assert _positive(entry["without_sps"]) and _positive(entry["with_sps"])
        assert _positive(entry["with_over_without"])
        assert _positive(entry["without_main_cpu_us"]) and _positive(entry["with_main_cpu_us"])

    seeded = saved["seed_per_sample"]
    assert set(seeded["loaders"]) == {str(w) for w in config.seed_workers}
    for w, row in seeded["loaders"].items():
        assert set(row["loaders"]) == {"torch", "snaploader", SEEDED}  # torchdata has no such option
        for entry in row["loaders"].values():
            assert _positive(entry["wall_us"]) and len(entry["wall_runs_us"]) == config.seed_repeats
            assert _positive(entry["wall_over_torch"])
            if w == "0":  # no worker processes: their CPU is nil
                assert entry["worker_cpu_us"] == 0
            else:
                assert entry["worker_cpu_us"] >= 0
        assert math.isfinite(row["added_wall_us"]) and math.isfinite(row["added_worker_cpu_us"])
    states = seeded["states"]
    assert _positive(states["global_us"]) and _positive(states["with_3_objects_us"])
    assert len(states["ordinary_us"]) == 4 and all(_positive(us) for us in states["ordinary_us"].values())

    restore = saved["restore"]["loaders"]
    assert set(restore) == set(measured)
    positions = saved["restore"]["positions"]
    assert list(positions) == ["early", "10%", "50%", "late"]  # 125 batches: 1, 12, 62, 112
    assert list(positions.values()) == sorted(set(positions.values()))
    for name in stateful:
        assert _positive(restore[name]["late_over_early"])
        for label in positions:
            assert _positive(restore[name][f"{label}_ms"])
            assert isinstance(restore[name][f"{label}_batch_matches"], bool)
    assert all(restore["snaploader"][f"{label}_batch_matches"] for label in positions)
    assert _positive(restore["torch"]["cold_ms"])
    shards = saved["shards"]  # issue 35's row: both resumes yield the uninterrupted batch
    assert shards["exact"] == {"state": True, "replay": True}
    assert all(_positive(shards["ms"][case]) for case in ("torch", "fresh", "state", "replay"))
    text = render_text(report)  # the printed tables
    assert "Shard stream" in text and "resumed by replay (state_protocol=False)" in text

    pinning = saved["pinning"]  # issue 34: both loaders through the stand-in pin
    assert pinning["workers"] == 2 and len(pinning["ratios"]) == config.pin_repeats
    assert _positive(pinning["ratio_to_torch"]) and set(pinning["throughput_bps"]) == {"torch", "snaploader"}
    assert "pin_memory=True, stand-in pin 4 ms a batch" in text

    lines = text.splitlines()
    for name in config.workloads:  # one summary row per workload and loader, its ratio to torch
        for c in measured:
            assert sum(line.startswith(f"{name:9s} {c:11s} ") for line in lines) == 1, (name, c)
        assert sum(line.startswith(f"  {name:8s} snaploader ") and "W=0:" in line for line in lines) == 1, name
    assert "Restore to first batch" in text and "late/early" in text
    first = lines.index("state_dict() after each batch, us (median / p99 / max)") + 2
    state_rows = lines[first:first + len(saved["state_dict"])]  # a row per case: cold and warm
    assert [line.split()[0] for line in state_rows] == [row["loader"] for row in saved["state_dict"]]
    assert all(line.count(" / ") >= 4 for line in state_rows)
    assert "Training loop, state_dict() after every step" in text
    assert "seed_per_sample=True, per sample" in text and "a sample's states alone" in text
    assert sum(line.startswith(f"  W={w}: torch ") for line in lines for w in config.seed_workers) == 2
    assert not list(tmp_path.glob("*.md")) and not list(tmp_path.glob("*.png"))  # results.json only


def test_the_tables_name_a_skipped_contender() -> None:
    contenders = find_contenders(["torch", "snaploader", "torchdata"])
    contenders["torchdata"].skipped = "not importable (test)"
    contenders["torchdata"].make = None
    assert [c.name for c in available(contenders)] == ["torch", "snaploader"]
    report = {
        "meta": {"started": "now", "cpus": 2, "torch": "x"},
        "config": {"mode": "test", "repeats": 1, "table_workers": 2,
                   "contenders": ["torch", "snaploader", "torchdata"]},
        "contenders": {c.name: {"version": c.version, "skipped": c.skipped} for c in contenders.values()},
        "workloads": {},
    }
    assert "torchdata: not measured, not importable (test)" in render_text(report)


def test_seeded_contender_reads_with_seed_per_sample() -> None:
    """The benchmark's "with the option" loader has it: its samples are the same read by
    the main process or by 2 workers taking turns; the plain loader's are not."""

    def values(contender: Any, workers: int) -> torch.Tensor:
        return torch.cat(list(build_loader(contender, NoiseItems(16, (1,)), 4, workers, seed=3)))

    seeded = seeded_contender()
    assert torch.equal(values(seeded, 0), values(seeded, 2))
    plain = find_contenders(["snaploader"])["snaploader"]
    assert not torch.equal(values(plain, 0), values(plain, 2))


def test_own_time_is_wall_less_the_wait_for_a_cpu() -> None:
    from stress.bench.state_dict import _own_times

    # (wall, waited) in ns: a call that waited 5 ms of its 5.2 ms, one that did not wait
    assert _own_times([(5_200_000, 5_000_000), (150_000, 0), (300_000, 150_000)]) == ([200_000, 150_000, 150_000], 2)
    assert _own_times([(5_200_000, 5_000_000), (150_000, None)]) is None  # a wait not read: no own time

