"""The targets each run is read against (issue 5's, 11's and 24's), apart from the
measures: each a measured value, a limit and whether it was met. They are reported,
never asserted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .state_dict import describe_pipeline


@dataclass
class Target:
    """One of issue 5's targets: ``measured`` compared with ``limit`` by ``op``."""

    name: str
    measured: float
    op: str  # ">=" or "<="
    limit: float
    unit: str
    note: str = ""
    met: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.op == ">=":
            self.met = self.measured >= self.limit
        elif self.op == "<=":
            self.met = self.measured <= self.limit
        else:
            raise ValueError(f"op should be '>=' or '<=', got {self.op!r}")

    def describe_limit(self) -> str:
        return f"{self.op} {self.limit:g} {self.unit}".rstrip()


def evaluate_targets(report: dict[str, Any]) -> list[Target]:
    """Issue 5's targets, each as measured / limit / met, from the numbers in
    ``report``; a target whose measurement is absent is left out."""
    targets: list[Target] = []
    tw = str(report["config"]["table_workers"])
    workloads = report["workloads"]

    def row(name: str) -> dict[str, Any]:
        found: dict[str, Any] = workloads.get(name, {}).get("by_workers", {}).get(tw, {})
        return found

    for name, limit in (("compute", 1.00), ("tiny", 0.95)):
        if "snaploader" in row(name):
            targets.append(Target(
                f"{name} throughput vs torch (W={tw})",
                row(name)["snaploader"]["ratio_to_torch"], ">=", limit, "x",
            ))
    inline = workloads.get("tiny", {}).get("by_workers", {}).get("0", {})
    if "snaploader" in inline:
        targets.append(Target(
            "tiny throughput vs torch (W=0)", inline["snaploader"]["ratio_to_torch"], ">=", 0.9, "x",
            "issue 11",
        ))
    snap = [(n, w["snapshot"]["snapshot_after_batch_us"]) for n, w in workloads.items() if "snapshot" in w]
    if snap:
        worst_name, worst = max(snap, key=lambda item: item[1])
        share = workloads[worst_name]["snapshot"]["share_of_batch"]
        targets.append(Target(
            "snapshot right after a batch, in a worker", worst, "<=", 20.0, "µs",
            f"worst workload: {worst_name}, {share * 100:.2f}% of its batch",
        ))

    ours = [r for r in report.get("state_dict", []) if r["loader"] == "snaploader"]
    at8 = [r for r in ours if r["workers"] == 8]
    if at8:
        targets.append(Target(
            "state_dict() at W=8", max(r["best_round_us"] for r in at8), "<=", 50.0, "µs",
            f"fastest round's median, worst case; median of all calls up to "
            f"{max(r['median_us'] for r in at8):.1f} µs",
        ))
    if ours:
        biggest = max(ours, key=lambda r: r["size_bytes"])
        targets.append(Target(
            "state_dict() size (torch.save)", biggest["size_bytes"] / 1024, "<=", 64.0, "KB",
            f"largest case: W={biggest['workers']}, length {biggest['dataset_len']:,}, {describe_pipeline(biggest)}",
        ))
        plain = [r for r in ours if r.get("pipeline", "plain") == "plain"]
        lengths = sorted({r["dataset_len"] for r in plain})
        if len(lengths) > 1:
            growth = 0
            for w in {r["workers"] for r in plain}:
                sizes = [r["size_bytes"] for r in sorted(plain, key=lambda r: r["dataset_len"])
                         if r["workers"] == w]
                growth = max(growth, sizes[-1] - sizes[0])
            # a few bytes may go to the length itself in the fingerprint, none per item
            targets.append(Target(
                "state_dict() size growth with dataset length", float(growth), "<=", 256.0, "B",
                f"length {lengths[0]:,} -> {lengths[-1]:,}",
            ))

    restore = report.get("restore", {}).get("loaders", {})
    if "snaploader" in restore:
        ours_r = restore["snaploader"]
        targets.append(Target("restore late / early", ours_r["late_over_early"], "<=", 1.5, "x"))
        if "torch" in restore:
            cold = restore["torch"]["cold_ms"]
            labels = report["restore"]["positions"]
            worst_label = max(labels, key=lambda label: ours_r[f"{label}_ms"])
            worst = ours_r[f"{worst_label}_ms"]
            targets.append(Target(
                "restore to first batch / torch cold start", worst / cold, "<=", 1.0, "x",
                f"slowest position: {worst_label}, {worst:.1f} ms; torch: {cold:.1f} ms",
            ))
        exact = all(ours_r[f"{label}_batch_matches"] for label in report["restore"]["positions"])
        targets.append(Target(
            "restored batch identical to the uninterrupted run", float(exact), ">=", 1.0, "",
            "correctness check: 1 = yes",
        ))

    fds = [
        (row(n)["snaploader"]["peak_fds"] - row(n)["torch"]["peak_fds"], n)
        for n in workloads
        if "snaploader" in row(n) and "torch" in row(n)
    ]
    fds = [(extra, n) for extra, n in fds if math.isfinite(extra)]  # NaN: no /proc
    if fds:
        extra, where = max(fds)
        targets.append(Target(
            f"main process peak fds over torch (W={tw})", extra, "<=", 0.0, "", f"worst workload: {where}",
        ))
    for name in workloads:
        if "snaploader" in row(name) and "torch" in row(name):
            ours_w, theirs = row(name)["snaploader"], row(name)["torch"]
            pss = ours_w.get("end_pss_mb", float("nan")) - theirs.get("end_pss_mb", float("nan"))
            targets.append(Target(
                f"{name}: peak RSS over torch (W={tw})",
                ours_w["peak_rss_mb"] - theirs["peak_rss_mb"], "<=", max(1, int(tw)) * 1.0, "MB",
                f"1 MB per worker; PSS over torch {pss:+.1f} MB",
            ))
    return targets
