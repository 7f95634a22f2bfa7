"""The tables printed on stdout at the end of a run; they read only the report dict
(results.json)."""

from __future__ import annotations

from typing import Any

from .shards import shards_text


def _fmt(value: Any, spec_: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    return format(value, spec_)


def _latency(summary: dict[str, float]) -> str:
    return " / ".join(_fmt(summary[f"{stat}_us"]) for stat in ("median", "p99", "max"))


def _loop_loaders(report: dict[str, Any]) -> tuple[list[str], str]:
    """The stateful contenders measured, and a note naming those skipped."""
    names = [c for c in report["config"]["contenders"] if c != "torch"]
    measured = [c for c in names if report["contenders"][c]["skipped"] is None]
    skipped = [f"{c} not measured ({report['contenders'][c]['skipped']})" for c in names if c not in measured]
    return measured, "; ".join(skipped)


def _own(row: dict[str, Any]) -> str:
    """A state_dict() row's own time (wall less the wait for a CPU), cold / warm, p99 /
    max; n/a where the waits could not be read."""
    if "cold_own" not in row:
        return "n/a"
    return " · ".join(
        f"{_fmt(row[kind]['p99_us'], '.0f')} / {_fmt(row[kind]['max_us'], '.0f')}" for kind in ("cold_own", "warm_own")
    )


def _waited(row: dict[str, Any]) -> str:
    """How many of a row's cold and warm calls waited over 0.1 ms for a CPU."""
    if "cold_waited_calls" not in row:
        return "n/a"
    return f"{row['cold_waited_calls']} of {len(row['cold_us'])} / {row['warm_waited_calls']} of {len(row['warm_us'])}"


def _seed_rows(report: dict[str, Any]) -> list[tuple[str, dict[str, Any], list[str]]]:
    """(W, row, the loaders measured, torch and snaploader first) of the
    seed_per_sample measure."""
    measured = report.get("seed_per_sample") or {}
    return [(w, row, list(row["loaders"])) for w, row in measured.get("loaders", {}).items()]


def _states_line(states: dict[str, Any], unit: str) -> str:
    ordinary = ", ".join(f"{name} {_fmt(us)}" for name, us in states["ordinary_us"].items())
    return (f"a sample's states alone {_fmt(states['global_us'])} {unit} (3 global RNGs),"
            f" {_fmt(states['with_3_objects_us'])} {unit} with 3 generator objects;"
            f" the ordinary seeders measured alongside, {unit} a call: {ordinary}")


def _seed_text(report: dict[str, Any]) -> list[str]:
    rows = _seed_rows(report)
    if not rows:
        return []
    measured = report["seed_per_sample"]
    out = ["", f"seed_per_sample=True, per sample (batch {measured['batch_size']}; wall us, workers' CPU us)",
           f"  {_states_line(measured['states'], 'us')}"]
    for w, row, names in rows:
        line = f"  W={w}: " + "  ".join(
            f"{n} {_fmt(row['loaders'][n]['wall_us'])}"
            + (f" (workers {_fmt(row['loaders'][n]['worker_cpu_us'])})" if w != "0" else "")
            for n in names
        )
        if "added_wall_us" in row:
            line += f"  -> adds {_fmt(row['added_wall_us'], '+.1f')} us"
            if w != "0":
                line += f", workers' CPU {_fmt(row['added_worker_cpu_us'], '+.1f')} us"
        out.append(line)
    return out


def _pinning_text(report: dict[str, Any]) -> list[str]:
    """The report's lines for this measure (none when it did not run)."""
    measured = report.get("pinning")
    if not measured:
        return []
    rates = measured["throughput_bps"]
    return [
        "",
        f"pin_memory=True, stand-in pin {measured['pin_ms']:g} ms a batch, training step "
        f"{measured['step_ms']:g} ms, W={measured['workers']}, median of {measured['repeats']} repeats",
        f"  torch {rates['torch']:.1f} b/s  snaploader {rates['snaploader']:.1f} b/s"
        f"  x torch {measured['ratio_to_torch']:.3f}"
        f"  (per repeat {', '.join(f'{r:.3f}' for r in measured['ratios'])})",
    ]


def _state_dict_text(report: dict[str, Any]) -> list[str]:
    if not report.get("state_dict"):
        return []
    out = [
        "",
        "state_dict() after each batch, us (median / p99 / max)",
        f"  {'loader':11s} {'W':>2s} {'length':>10s} {'pipeline':9s} {'batches':>7s}"
        f" {'cold':>26s} {'warm':>26s} {'size KB':>8s}",
    ]
    for r in report["state_dict"]:
        out.append(
            f"  {r['loader']:11s} {r['workers']:>2d} {r['dataset_len']:>10d} {r['pipeline']:9s} {r['steps']:>7d}"
            f" {_latency(r['cold']):>26s} {_latency(r['warm']):>26s} {r['size_bytes'] / 1024:>8.1f}"
            + (f"  own p99/max {_own(r)}, waited {_waited(r)}" if "cold_own" in r else "")
        )
    return out


def _loop_text(report: dict[str, Any]) -> list[str]:
    if not report.get("training_loop"):
        return []
    stateful, skipped = _loop_loaders(report)
    out = ["", "Training loop, state_dict() after every step (steps/s)"]
    for r in report["training_loop"]:
        line = f"  {r['pipeline']:6s} W={r['workers']}: torch {_fmt(r['loaders'].get('torch', {}).get('without_sps'))}"
        for c in stateful:
            e = r["loaders"][c]
            line += (f"  {c} {_fmt(e['without_sps'])} without, {_fmt(e['with_sps'])} with"
                     f" ({_fmt(e['with_over_without'], '.3f')}x; main CPU {_fmt(e.get('without_main_cpu_us'), '.0f')}"
                     f" / {_fmt(e.get('with_main_cpu_us'), '.0f')} us a step)")
        out.append(line)
    if skipped:
        out.append(f"  {skipped}")
    return out


def render_text(report: dict[str, Any]) -> str:
    """The readable table for stdout."""
    tw = str(report["config"]["table_workers"])
    out = []
    names = [c for c in report["config"]["contenders"] if report["contenders"][c]["skipped"] is None]
    out += [f"{c}: not measured, {report['contenders'][c]['skipped']}" for c in report["config"]["contenders"]
            if c not in names]
    out.append(f"Per workload, num_workers={tw}, median of {report['config']['repeats']} repeats")
    header = (
        f"{'workload':9s} {'loader':11s} {'batches/s':>10s} {'x torch':>8s} {'1st ms':>8s}"
        f" {'main us/b':>10s} {'wrkr us/b':>10s} {'RSS MB':>8s} {'PSS MB':>8s} {'fds':>5s}"
    )
    out.append(header)
    out.append("-" * len(header))
    for name, entry in report["workloads"].items():
        row = entry["by_workers"].get(tw, {})
        for c in names:
            if c not in row:
                continue
            s = row[c]
            out.append(
                f"{name:9s} {c:11s} {_fmt(s['throughput_bps']):>10s} {_fmt(s['ratio_to_torch'], '.3f'):>8s}"
                f" {_fmt(s['first_batch_ms']):>8s} {_fmt(s['cpu_us_per_batch'], '.0f'):>10s}"
                f" {_fmt(s['worker_cpu_us_per_batch'], '.0f'):>10s} {_fmt(s['peak_rss_mb'], '.0f'):>8s}"
                f" {_fmt(s['end_pss_mb'], '.0f'):>8s} {_fmt(s.get('peak_fds'), '.0f'):>5s}"
            )
        snap = entry.get("snapshot")
        if snap:
            out.append(
                f"{'':9s} snapshot {snap['snapshot_after_batch_us']:.1f} us right after a batch,"
                f" {snap['snapshot_us']:.1f} us in a loop (capture_rng {snap['capture_rng_us']:.1f} us,"
                f" {snap['share_of_batch'] * 100:.2f}% of a {snap['batch_us']:.0f} us batch,"
                f" {snap['snapshot_pickled_bytes']} B pickled)"
            )
    out.append("")
    out.append("Throughput (batches/s) vs num_workers")
    for name, entry in report["workloads"].items():
        for c in names:
            cells = [
                f"W={w}: {_fmt(entry['by_workers'][w].get(c, {}).get('throughput_bps'))}"
                for w in entry["by_workers"]
            ]
            out.append(f"  {name:8s} {c:11s} " + "  ".join(cells))
    out += _state_dict_text(report) + _loop_text(report) + _seed_text(report) + _pinning_text(report)
    restore = report.get("restore")
    if restore:
        out.append("")
        out.append(f"Restore to first batch ({restore['items']:,} items, positions {restore['positions']})")
        for c, e in restore["loaders"].items():
            line = f"  {c:11s} cold {e['cold_ms']:.1f} ms"
            if "early_ms" in e:
                line += "".join(f"  {label} {e[f'{label}_ms']:.1f} ms" for label in restore["positions"])
                line += (f"  late/early {e['late_over_early']:.2f}"
                         f"  exact {all(e[f'{label}_batch_matches'] for label in restore['positions'])}")
            out.append(line)
    if report.get("shards"):
        out += shards_text(report["shards"])
    return "\n".join(out)
