"""snaploader's per-batch snapshot cost, timed in a forked process set up like one of
its workers: right after each of a few real fetches (cold caches), and in a loop."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Final

import torch
from torch.utils.data import default_collate

from stress._probes import median, per_call_us

from .workloads import make_dataset, spec

_SNAPSHOT_BATCHES: Final = 32  # batches fetched, each followed by a timed snapshot


def _snapshot_child(conn: Any, name: str, batch_size: int, compute_rounds: int, calls: int) -> None:
    """Runs in a forked process set up like a snaploader worker: time ``calls``
    snapshots, ``calls`` bare capture_rng() calls, and whole batches for scale."""
    try:
        import pickle

        from snaploader._workers.messages import Task, WorkerSetup
        from snaploader._rng.capture import capture_rng
        from snaploader._workers.logical_worker import WorkerRuntime

        torch.set_num_threads(1)
        dataset = make_dataset(name, 64 * batch_size, compute_rounds)
        setup = WorkerSetup(
            dataset=dataset,
            iterable=False,
            auto_collation=True,
            batch_size=batch_size,
            drop_last=False,
            collate_fn=default_collate,
            worker_init_fn=None,
            logical=2,
            base_seed=12345,
        )
        runtime = WorkerRuntime(setup, 0, in_main_process=False)
        runtime.initialize()
        runtime.run(Task(0, list(range(batch_size))))
        # In place: the snapshot right after each batch's fetch, as run() takes it. The
        # fetch has just left the caches cold (and a sleeping one the core idle), so
        # this is what a batch really pays; the loop below, states unchanged and caches
        # warm, is the code's own cost.
        batch_s = []
        after_s = []
        for k in range(1, _SNAPSHOT_BATCHES + 1):
            indices = list(range(k * batch_size, (k + 1) * batch_size))
            t0 = time.perf_counter()
            runtime._fetch_map(indices, None, k)  # no per-sample seed: the ordinary fetch
            t1 = time.perf_counter()
            runtime.snapshot()
            t2 = time.perf_counter()
            batch_s.append(t2 - t0)
            after_s.append(t2 - t1)

        snap_us = []
        cap_us = []
        for _ in range(3):
            snap_us.append(per_call_us(runtime.snapshot, max(1, calls // 5)))
            cap_us.append(per_call_us(capture_rng, max(1, calls // 5)))
        snapshot = runtime.snapshot()
        conn.send(
            {
                "snapshot_us": median(snap_us),
                "snapshot_after_batch_us": median([s * 1e6 for s in after_s]),
                "capture_rng_us": median(cap_us),
                "batch_us": median([s * 1e6 for s in batch_s]),
                "snapshot_pickled_bytes": len(pickle.dumps(snapshot)),
                "rng_bytes": len(snapshot.rng),  # type: ignore[arg-type]
            }
        )
    except BaseException as exc:  # report it; the parent raises
        conn.send({"error": f"{type(exc).__name__}: {exc}"})


def measure_snapshot(name: str, compute_rounds: int, calls: int) -> dict[str, Any]:
    """snaploader's per-batch snapshot cost for workload ``name``, in µs per batch."""
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_snapshot_child, args=(child, name, spec(name).batch_size, compute_rounds, calls)
    )
    proc.start()
    child.close()
    try:
        if not parent.poll(300):
            raise RuntimeError(f"snapshot measurement for {name!r} did not answer in 300 s")
        result: dict[str, Any] = parent.recv()
    finally:
        parent.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        proc.close()
    if "error" in result:
        raise RuntimeError(f"snapshot measurement for {name!r} failed: {result['error']}")
    result["share_of_batch"] = result["snapshot_after_batch_us"] / result["batch_us"]
    return result
