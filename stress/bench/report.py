"""The report's two renderings: the markdown tables docs/performance.md shows, and the
readable table printed on stdout. Both read only the report dict (results.json)."""

from __future__ import annotations

from typing import Any

from .shards import shards_markdown
from .state_dict import describe_pipeline


def _fmt(value: Any, spec_: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    return format(value, spec_)


def _position_name(label: str, k: int, total: int) -> str:
    if label in ("early", "late"):
        return f"{label} ({k / total:.0%})" if label == "late" else label
    return label


def _latency(summary: dict[str, float]) -> str:
    return " / ".join(_fmt(summary[f"{stat}_us"]) for stat in ("median", "p99", "max"))


def _loop_loaders(report: dict[str, Any]) -> tuple[list[str], str]:
    """The stateful contenders measured, and a note naming those skipped."""
    names = [c for c in report["config"]["contenders"] if c != "torch"]
    measured = [c for c in names if report["contenders"][c]["skipped"] is None]
    skipped = [f"{c} not measured ({report['contenders'][c]['skipped']})" for c in names if c not in measured]
    return measured, "; ".join(skipped)


def _state_dict_markdown(report: dict[str, Any]) -> list[str]:
    if not report.get("state_dict"):
        return []
    lines = [
        "",
        "| state_dict() | W | dataset length | pipeline | batches (epochs) | cold µs (median / p99 / max)"
        " | warm µs (median / p99 / max) | own time, cold / warm µs (p99 / max) | calls that waited for a CPU"
        " | torch.save size KB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["state_dict"]:
        lines.append(
            f"| {r['loader']} | {r['workers']} | {r['dataset_len']:,} | {describe_pipeline(r)} | "
            f"{r['steps']} ({r['epochs']}) | {_latency(r['cold'])} | {_latency(r['warm'])} | "
            f"{_own(r)} | {_waited(r)} | {_fmt(r['size_bytes'] / 1024)} |"
        )
    return lines


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


def _loop_markdown(report: dict[str, Any]) -> list[str]:
    if not report.get("training_loop"):
        return []
    stateful, skipped = _loop_loaders(report)
    lines = [
        "",
        "| training loop, state_dict() after every step | W | steps | torch steps/s | "
        + " | ".join(
            f"{c} steps/s without / with | {c} with / without | {c} main-process CPU µs a step without / with"
            for c in stateful
        ) + " |",
        "|" + " --- |" * (4 + 3 * len(stateful)),
    ]
    for r in report["training_loop"]:
        cells = [
            f"{_fmt(r['loaders'][c]['without_sps'])} / {_fmt(r['loaders'][c]['with_sps'])} | "
            f"{_fmt(r['loaders'][c]['with_over_without'], '.3f')}× | "
            f"{_fmt(r['loaders'][c].get('without_main_cpu_us'), '.0f')} / {_fmt(r['loaders'][c].get('with_main_cpu_us'), '.0f')}"
            for c in stateful
        ]
        lines.append(
            f"| {describe_pipeline(r)} | {r['workers']} | {r['steps']} | "
            f"{_fmt(r['loaders'].get('torch', {}).get('without_sps'))} | " + " | ".join(cells) + " |"
        )
    if skipped:
        lines += ["", f"Training loop: {skipped}."]
    return lines


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


def _seed_markdown(report: dict[str, Any]) -> list[str]:
    rows = _seed_rows(report)
    if not rows:
        return []
    measured = report["seed_per_sample"]
    names = rows[0][2]
    slash = " / ".join(names)
    lines = [
        "",
        f"seed_per_sample=True: {measured['items']:,} items, batch {measured['batch_size']}, shuffle, each item"
        " drawing one value from each of the 3 global RNGs; µs per sample (wall, first batch to last) and"
        " the workers' CPU µs per sample; added = with the option less without, per repeat, median;"
        f" {_states_line(measured['states'], 'µs')}.",
        "",
        f"| seed_per_sample=True | W | µs/sample ({slash}) | × torch ({slash}) | added µs/sample"
        f" | workers' CPU µs/sample ({slash}) | added workers' CPU µs/sample |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w, row, _ in rows:
        loaders = row["loaders"]
        workers = w != "0"
        lines.append(
            f"| per sample | {w} | " + " / ".join(_fmt(loaders[n]["wall_us"]) for n in names)
            + " | " + " / ".join(_fmt(loaders[n].get("wall_over_torch"), ".2f") for n in names)
            + f" | {_fmt(row.get('added_wall_us'), '+.1f')} | "
            + (" / ".join(_fmt(loaders[n]["worker_cpu_us"]) for n in names) if workers else "— (no workers)")
            + f" | {_fmt(row.get('added_worker_cpu_us'), '+.1f') if workers else '—'} |"
        )
    return lines


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


def render_markdown(report: dict[str, Any]) -> str:
    """The tables docs/performance.md shows, from one run."""
    tw = str(report["config"]["table_workers"])
    names = [c for c in report["config"]["contenders"] if report["contenders"][c]["skipped"] is None]
    others = [c for c in names if c != "torch"]
    total_s = report.get("timing_s", {}).get("total")  # how long the whole run took
    lines = [
        f"Run: {report['meta']['started']} · mode `{report['config']['mode']}` · "
        f"{report['meta']['cpus']} CPUs · torch {report['meta']['torch']} · "
        + " · ".join(f"{c} {report['contenders'][c]['version']}" for c in others)
        + f" · median of {report['config']['repeats']} interleaved repeats · num_workers={tw}"
        + (f" · took {total_s / 60:.1f} min" if total_s is not None else ""),
        "",
    ]
    skipped = [f"{c}: {v['skipped']}" for c, v in report["contenders"].items() if v["skipped"]]
    if skipped:
        lines += ["Not measured: " + "; ".join(skipped), ""]
    slash = " / ".join(names)
    lines += [
        f"| workload | torch batches/s | "
        + " | ".join(f"{c} × torch" for c in others)
        + f" | first batch ms ({slash}) | main CPU µs/batch ({slash})"
        f" | worker CPU µs/batch ({slash}) | peak RSS MB ({slash}) | PSS MB ({slash})"
        f" | main process peak fds ({slash}) | snapshot µs/batch (after a batch / in a loop) |",
        "|" + " --- |" * (9 + len(others)),
    ]
    for name, entry in report["workloads"].items():
        row = entry["by_workers"].get(tw, {})
        if not row:
            continue
        lines.append(
            f"| {name} | {_fmt(row['torch']['throughput_bps'])} | "
            + " | ".join(f"{_fmt(row[c]['ratio_to_torch'], '.2f')}×" for c in others)
            + " | " + " / ".join(_fmt(row[c]["first_batch_ms"]) for c in names)
            + " | " + " / ".join(_fmt(row[c]["cpu_us_per_batch"], ".0f") for c in names)
            + " | " + " / ".join(_fmt(row[c]["worker_cpu_us_per_batch"], ".0f") for c in names)
            + " | " + " / ".join(_fmt(row[c]["peak_rss_mb"], ".0f") for c in names)
            + " | " + " / ".join(_fmt(row[c]["end_pss_mb"], ".0f") for c in names)
            + " | " + " / ".join(_fmt(row[c].get("peak_fds"), ".0f") for c in names)
            + f" | {_fmt(entry.get('snapshot', {}).get('snapshot_after_batch_us'))}"
            + f" / {_fmt(entry.get('snapshot', {}).get('snapshot_us'))} |"
        )
    inline = report["workloads"].get("tiny", {}).get("by_workers", {}).get("0", {})
    if "torch" in inline and others:
        lines += [
            "",
            "| num_workers=0, tiny items | torch batches/s | "
            + " | ".join(f"{c} × torch" for c in others) + " |",
            "|" + " --- |" * (2 + len(others)),
            f"| batch 64, a Python int per item | {_fmt(inline['torch']['throughput_bps'])} | "
            + " | ".join(f"{_fmt(inline[c]['ratio_to_torch'], '.2f')}×" for c in others if c in inline)
            + " |",
        ]
    lines += _state_dict_markdown(report) + _loop_markdown(report) + _seed_markdown(report)
    pinning = report.get("pinning")
    if pinning:
        rates = pinning["throughput_bps"]
        lines += [
            "",
            f"| `pin_memory=True`, stand-in pin {pinning['pin_ms']:g} ms, step {pinning['step_ms']:g} ms, "
            f"W={pinning['workers']} | torch batches/s | snaploader batches/s | snaploader × torch (per repeat) |",
            "| --- | --- | --- | --- |",
            f"| {pinning['batches']} steps, median of {pinning['repeats']} | {_fmt(rates['torch'])} | "
            f"{_fmt(rates['snaploader'])} | {pinning['ratio_to_torch']:.2f}× "
            f"({', '.join(f'{r:.2f}' for r in pinning['ratios'])}) |",
        ]
    restore = report.get("restore")
    if restore:
        pos = restore["positions"]
        total = restore["batches_per_epoch"]
        lines += [
            "",
            f"Restore: {restore['items']:,} items, batch {restore['batch_size']}, shuffle, "
            f"W={restore['workers']}; load_state_dict() to first batch, resuming after batch "
            + ", ".join(f"{k} ({label})" for label, k in pos.items()) + f" of {total}.",
            "",
            "| loader | cold start ms | "
            + " | ".join(f"{_position_name(label, k, total)} ms" for label, k in pos.items())
            + " | late / early | restored batch exact |",
            "|" + " --- |" * (len(pos) + 4),
        ]
        for c, e in restore["loaders"].items():
            if "early_ms" in e:
                exact = "yes" if all(e[f"{label}_batch_matches"] for label in pos) else "NO"
                lines.append(
                    f"| {c} | {_fmt(e['cold_ms'])} | "
                    + " | ".join(_fmt(e[f"{label}_ms"]) for label in pos)
                    + f" | {_fmt(e['late_over_early'], '.2f')} | {exact} |"
                )
            else:
                lines.append(f"| {c} | {_fmt(e['cold_ms'])} |" + " — |" * (len(pos) + 2))
    if report.get("shards"):
        lines += shards_markdown(report["shards"])
    if report.get("targets"):
        lines += ["", "| target | measured | limit | met |", "| --- | --- | --- | --- |"]
        for t in report["targets"]:
            note = f" ({t['note']})" if t["note"] else ""
            lines.append(
                f"| {t['name']}{note} | {_fmt(t['measured'], '.2f')} {t['unit']} |"
                f" {t['op']} {t['limit']:g} {t['unit']} | {'met' if t['met'] else '**missed**'} |"
            )
    if report.get("plot"):
        lines += ["", f"![throughput vs num_workers]({report['plot']})"]
    return "\n".join(lines) + "\n"


def render_text(report: dict[str, Any]) -> str:
    """The readable table for stdout."""
    tw = str(report["config"]["table_workers"])
    out = []
    names = [c for c in report["config"]["contenders"] if report["contenders"][c]["skipped"] is None]
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
        out += shards_markdown(report["shards"])
    if report.get("targets"):
        out.append("")
        out.append("Targets")
        for t in report["targets"]:
            note = f"; {t['note']}" if t["note"] else ""
            out.append(
                f"  [{'met' if t['met'] else 'MISSED':6s}] {t['name']}: {t['measured']:.2f} {t['unit']}"
                f" (target {t['op']} {t['limit']:g} {t['unit']}{note})"
            )
    return "\n".join(out)
