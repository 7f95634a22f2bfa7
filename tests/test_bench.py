"""The benchmark (the package stress/bench/) on tiny settings: every measurement runs and the outputs have the
expected shape. No timing is asserted here; the benchmark reports targets, never
fails on them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from stress.bench.__main__ import run
from stress.bench.config import Config
from stress.bench.contenders import available, find_contenders
from stress.bench.report import render_markdown, render_text


def tiny_config() -> Config:
    return Config(
        mode="test",
        workers=(0, 1),
        repeats=1,
        trial_s=0.2,
        workloads={"compute": 4, "tiny": 8, "large": 4, "sleep": 4},
        snapshot_calls=20,
        state_dict_cases=((1, 100, "plain"), (2, 100_000, "plain"), (2, 200, "rng")),
        state_dict_calls=10,
        state_dict_rounds=2,
        state_dict_span_s=0.01,
        restore_items=2_000,
        restore_batch_size=16,
        restore_late_fraction=0.9,
        restore_repeats=1,
        table_workers=1,
    )


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_run_writes_every_output(tmp_path: Path) -> None:
    config = tiny_config()
    report = run(config, tmp_path, log=lambda line: None)

    saved = json.loads((tmp_path / "results.json").read_text())
    for key in ("meta", "config", "contenders", "workloads", "state_dict", "restore", "targets", "timing_s"):
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
    for row in saved["state_dict"]:
        assert _positive(row["median_us"]) and row["size_bytes"] > 0
        assert 0 < row["best_round_us"] <= row["median_us"] <= row["p90_us"]

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

    names = {t["name"] for t in saved["targets"]}
    assert any("throughput" in n for n in names) and any("snapshot" in n for n in names)
    assert "tiny throughput vs torch (W=0)" in names  # issue 11's row
    assert any("peak fds" in n for n in names)
    assert all(isinstance(t["met"], bool) for t in saved["targets"])

    markdown = (tmp_path / "results.md").read_text()
    assert markdown == render_markdown(report)
    assert f"took {report['timing_s']['total'] / 60:.1f} min" in markdown.splitlines()[0]
    rows = [line for line in markdown.splitlines() if line.startswith("| ")]
    for name in config.workloads:
        assert sum(line.startswith(f"| {name} |") for line in rows) == 1, name
    assert "| target |" in markdown
    assert "| num_workers=0, tiny items |" in markdown
    assert "| loader | cold start ms | early ms | 10% ms | 50% ms | late (90%) ms |" in markdown
    assert render_text(report)  # the stdout table renders

    if report["plot"] is not None:
        assert (tmp_path / report["plot"]).stat().st_size > 0
    else:
        assert "matplotlib" in report["plot_skipped"]


def test_markdown_names_a_skipped_contender() -> None:
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
    assert "torchdata: not importable (test)" in render_markdown(report)
