#!/usr/bin/env python
"""Workers that allocate memory until they die, inside a memory limit this script sets
up itself; check that the loader respawns them with the stream unchanged, and that a
sample that exhausts memory every time ends in WorkerCrashedError.

    python stress/memory_pressure.py                 # every case, a few rounds
    python stress/memory_pressure.py --quick         # the CI variant (under a minute)
    python stress/memory_pressure.py --mechanism rlimit
    python stress/memory_pressure.py --seed 7        # repeat a run's shuffle order

The limit (``--mechanism``, default ``auto``: the first that works):

- ``cgroup``: a memory cgroup of its own (cgroup v1 ``memory.limit_in_bytes``, or v2
  ``memory.max``) created under this process's memory cgroup when that is writable
  (usually: root in a container). Each worker moves itself into it from its
  ``worker_init_fn``; the kernel's out-of-memory killer then SIGKILLs the worker, as in
  production. The cgroup is removed at the end.
- ``rlimit``: ``resource.setrlimit(RLIMIT_AS)`` in ``worker_init_fn`` (the worker's
  current address space plus ``--limit-mib``). The kernel then refuses the allocation
  (MemoryError) instead of killing the process; the dataset converts that into the
  death the out-of-memory killer would cause (SIGKILL to itself) and says so in a file
  the script counts. The summary reports how many deaths came from the kernel and how
  many were converted, so a run never claims kernel kills it did not see.

Cases (each under fork and spawn, persistent workers off and on):

- transient: sample 13 exhausts memory the first time it is loaded only; the epochs
  must equal an uninterrupted reference and a WorkerRespawnedWarning must name SIGKILL;
- permanent: it does so every time; after exactly ``max_worker_retries`` respawns the
  loader raises WorkerCrashedError naming SIGKILL, the out-of-memory killer and the
  batch, and a ``state_dict()`` taken then resumes a healthy loader at that batch.

``--seed N`` seeds the loaders' generator, so it decides the shuffle order and hence in
which batch, of which worker, sample 13 lands; without it a seed is drawn at random.
The first line of output names the seed, so a failing run can be repeated.

Summary line (the last line of output):

    runs=N kills=N failures=N leaks=N mechanism=... kernel_kills=N converted=N
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import multiprocessing.resource_tracker
import os
import random
import resource
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from snaploader import DataLoader, WorkerCrashedError, WorkerRespawnedWarning
from stress._datasets import LeakCheck, OomOnce, fingerprint  # noqa: E402

_N = 40
_BATCH = 4
_ITEM = 13
_RETRIES = 2


# -- the limit -----------------------------------------------------------------------------


def _own_memory_cgroup() -> tuple[str, Path] | None:
    """("v1" or "v2", the directory of this process's memory cgroup)."""
    mounts = {}
    with open("/proc/mounts") as f:
        for line in f:
            _, where, kind, options = line.split()[:4]
            if kind == "cgroup" and "memory" in options.split(","):
                mounts["v1"] = Path(where)
            elif kind == "cgroup2":
                mounts.setdefault("v2", Path(where))
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(",") and "v1" in mounts:
                return "v1", mounts["v1"] / path.lstrip("/")
            if controllers == "" and "v2" in mounts and "v1" not in mounts:
                return "v2", mounts["v2"] / path.lstrip("/")
    return None


def make_cgroup(limit_bytes: int) -> tuple[str, Path]:
    """Create a memory cgroup limited to ``limit_bytes``; raises OSError if this
    process may not (not root, read-only cgroup fs, no memory controller)."""
    found = _own_memory_cgroup()
    if found is None:
        raise OSError("no memory cgroup found in /proc/self/cgroup")
    version, parent = found
    path = parent / f"snaploader-stress-{os.getpid()}"
    path.mkdir()
    try:
        if version == "v1":
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            (path / "memory.swappiness").write_text("0")
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            (path / "memory.swap.max").write_text("0")
    except OSError:
        path.rmdir()
        raise
    return version, path


def join_cgroup(path: str, worker_id: int) -> None:
    """worker_init_fn: move this worker into the limited cgroup."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def limit_address_space(headroom_bytes: int, worker_id: int) -> None:
    """worker_init_fn: allow this worker ``headroom_bytes`` more address space."""
    with open("/proc/self/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_kib * 1024 + headroom_bytes, hard))


def probe_cgroup(path: Path) -> None:
    """Check that a process can move itself into the cgroup (a v2 parent with processes
    of its own, for one, may refuse)."""
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=join_cgroup, args=(str(path), 0))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise OSError(f"a process could not join {path} (exit code {proc.exitcode})")


# -- the cases -------------------------------------------------------------------------------


def make_loader(dataset: Any, context: str, persistent: bool, init: Any, seed: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=_BATCH,
        shuffle=True,
        num_workers=2,
        worker_init_fn=init,
        multiprocessing_context=context,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=persistent,
        max_worker_retries=_RETRIES,
    )


def epochs(loader: DataLoader, count: int) -> list[list[str]]:
    out = []
    it = None
    try:
        for _ in range(count):
            it = iter(loader)
            out.append([fingerprint(b) for b in it])
    finally:
        if it is not None:
            it.close()
    return out


def run_case(context: str, persistent: bool, permanent: bool, init: Any, tmp: Path,
             converted_dir: str, reference: list[list[str]], seed: int) -> tuple[int, str]:
    """(deaths seen, problem or "")."""
    marker = None if permanent else str(tmp / f"oom-{time.monotonic_ns()}")
    loader = make_loader(OomOnce(_N, _ITEM, marker, converted_dir), context, persistent, init, seed)
    n_epochs = len(reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not permanent:
            got = epochs(loader, n_epochs)
            respawned = [str(w.message) for w in caught if issubclass(w.category, WorkerRespawnedWarning)]
            if got != reference:
                return len(respawned), "the stream differs from the uninterrupted one"
            if len(respawned) != 1 or "SIGKILL" not in respawned[0]:
                return len(respawned), f"expected one respawn after a SIGKILL, got {respawned}"
            return 1, ""
        got_batches: list[str] = []
        it = iter(loader)
        try:
            for b in it:
                got_batches.append(fingerprint(b))
        except WorkerCrashedError as exc:
            error = str(exc)
        else:
            return 0, "a permanent out-of-memory sample did not end in WorkerCrashedError"
        finally:
            it.close()
        respawned = [str(w.message) for w in caught if issubclass(w.category, WorkerRespawnedWarning)]
    failed = next(k for k, fp in enumerate(reference[0]) if _ITEM in map(int, fp.split(":")[0].split(",")))
    deaths = len(respawned) + 1
    if len(respawned) != _RETRIES:
        return deaths, f"{len(respawned)} respawns before the error, expected {_RETRIES}"
    for needle in ("SIGKILL", "out-of-memory", f"batch {failed} of epoch 0"):
        if needle not in error:
            return deaths, f"the error does not say {needle!r}: {error}"
    if got_batches != reference[0][:failed]:
        return deaths, "the batches before the error differ from the uninterrupted ones"
    healthy = make_loader(OomOnce(_N, -1, None, converted_dir), "fork", persistent, None, seed)
    healthy.load_state_dict(loader.state_dict())
    if epochs(healthy, 1)[0] != reference[0][failed:]:
        return deaths, "state_dict() after the error does not resume at the failed batch"
    return deaths, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mechanism", choices=("auto", "cgroup", "rlimit"), default="auto")
    parser.add_argument("--limit-mib", type=int, default=256, help="memory a worker may add")
    parser.add_argument("--rounds", type=int, default=2, help="times to run every case")
    parser.add_argument("--quick", action="store_true", help="the short bounded CI variant")
    parser.add_argument("--seed", type=int, default=None, help="the loaders' generator seed (default: random)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    faulthandler.dump_traceback_later(1800, exit=True)  # never hang CI
    limit = args.limit_mib << 20
    tmp = Path(tempfile.mkdtemp(prefix="snaploader-memory-"))
    converted_dir = tmp / "converted"
    converted_dir.mkdir()
    multiprocessing.resource_tracker.ensure_running()  # a lifelong helper, not a leak
    baseline = LeakCheck()

    cgroup: Path | None = None
    mechanism = ""
    if args.mechanism in ("auto", "cgroup"):
        try:
            version, cgroup = make_cgroup(limit)
            probe_cgroup(cgroup)
            mechanism = f"cgroup-{version}({args.limit_mib}MiB, kernel OOM killer)"
            init: Any = functools.partial(join_cgroup, str(cgroup))
        except OSError as exc:
            if cgroup is not None:
                cgroup.rmdir()
                cgroup = None
            if args.mechanism == "cgroup":
                print(f"cannot set up a memory cgroup: {exc}")
                return 1
            print(f"no memory cgroup ({exc}); using RLIMIT_AS")
    if cgroup is None:
        mechanism = f"rlimit-as(+{args.limit_mib}MiB, MemoryError converted to SIGKILL)"
        init = functools.partial(limit_address_space, limit)
    print(f"memory_pressure: seed={seed} mechanism={mechanism}", flush=True)

    if args.quick:
        cases = [("fork", False, False), ("fork", True, True), ("spawn", True, False)]
        rounds = 1
    else:
        cases = [(c, p, perm) for c in ("fork", "spawn") for p in (False, True) for perm in (False, True)]
        rounds = args.rounds
    references = {
        p: epochs(make_loader(OomOnce(_N, -1, None, str(converted_dir)), "fork", p, None, seed), 2)
        for p in (False, True)
    }
    runs = kills = failures = 0
    try:
        for _ in range(rounds):
            for context, persistent, permanent in cases:
                started = time.monotonic()
                reference = references[persistent] if persistent else references[persistent][:1]
                try:
                    deaths, problem = run_case(context, persistent, permanent, init, tmp, str(converted_dir),
                                               reference, seed)
                except Exception:
                    deaths, problem = 0, traceback.format_exc()
                runs += 1
                kills += deaths
                failures += bool(problem)
                print(f"run {runs:3}: {context:5} persistent={int(persistent)} "
                      f"{'permanent' if permanent else 'transient'}  deaths={deaths} "
                      f"{time.monotonic() - started:5.1f}s  {'ok' if not problem else 'FAIL ' + problem}", flush=True)
    finally:
        leaks = baseline.leaks()
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError as exc:
                leaks.append(f"cgroup {cgroup}: {exc}")
    converted = len(os.listdir(converted_dir))
    for leak in leaks:
        print(f"leak: {leak}")
    print(f"runs={runs} kills={kills} failures={failures} leaks={len(leaks)} "
          f"mechanism={mechanism} kernel_kills={kills - converted} converted={converted}", flush=True)
    return 1 if failures or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
