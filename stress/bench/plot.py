"""The throughput-vs-num_workers plot (PNG, needs matplotlib), drawn in a forked child
so that matplotlib never loads into the measuring process."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from .workloads import spec


def plot_throughput(report: dict[str, Any], path: Path) -> str | None:
    """Throughput vs num_workers, one panel per workload, as a PNG at ``path``; returns
    its file name, or None with the reason in ``report["plot_skipped"]``.

    It draws in a forked child where it can: matplotlib then never loads into this
    process, whose backend, global state and open font files stay as they were."""
    if "fork" not in multiprocessing.get_all_start_methods():
        problem = _draw_throughput(report, path)
    else:
        ctx = multiprocessing.get_context("fork")
        receiver, sender = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_draw_in_child, args=(sender, report, path))
        child.start()
        sender.close()
        try:
            problem = receiver.recv() if receiver.poll(300) else "drawing took over 300 s"
        except EOFError:
            problem = f"the drawing process died (exit code {child.exitcode})"
        finally:
            receiver.close()
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()
            child.close()
    if problem is not None:
        report["plot_skipped"] = problem
        return None
    return path.name


def _draw_in_child(conn: Any, report: dict[str, Any], path: Path) -> None:
    try:
        conn.send(_draw_throughput(report, path))
    except BaseException as exc:
        conn.send(f"{type(exc).__name__}: {exc}")


def _draw_throughput(report: dict[str, Any], path: Path) -> str | None:
    """Draws the plot; None, or what went wrong."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib not importable ({type(exc).__name__}: {exc})"
    names = [c for c in report["config"]["contenders"] if report["contenders"][c]["skipped"] is None]
    workloads = report["workloads"]
    cols = 2 if len(workloads) > 1 else 1
    rows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(workloads):]:
        ax.set_visible(False)
    for ax, (name, entry) in zip(flat, workloads.items()):
        ws = sorted(entry["by_workers"], key=int)
        for c in names:
            medians = [entry["by_workers"][w][c]["throughput_bps"] for w in ws]
            runs = [[r["throughput_bps"] for r in entry["by_workers"][w][c]["runs"]] for w in ws]
            lo = [m - min(r) for m, r in zip(medians, runs)]
            hi = [max(r) - m for m, r in zip(medians, runs)]
            ax.errorbar([int(w) for w in ws], medians, yerr=[lo, hi], marker="o", capsize=3, label=c)
        everything = [r["throughput_bps"] for w in ws for c in names for r in entry["by_workers"][w][c]["runs"]]
        ax.set_title(f"{name} (batch {spec(name).batch_size})")
        ax.set_xlabel("num_workers")
        ax.set_xticks([int(w) for w in ws])
        ax.set_ylabel("batches / s")
        if min(everything) > 0 and max(everything) / min(everything) > 20:
            ax.set_yscale("log")  # num_workers=0 of tiny items dwarfs the rest
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, which="both")
    flat[0].legend()
    fig.suptitle(f"Throughput vs num_workers ({report['meta']['cpus']} CPUs; median, bars: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
