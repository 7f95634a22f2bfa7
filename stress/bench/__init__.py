"""Side-by-side benchmark: snaploader vs torch's DataLoader (vs torchdata's
StatefulDataLoader when it is installed), on the workloads of issue 5.

    python stress/bench.py            # the full run (over 9 minutes on a quiet 2-core machine)
    python stress/bench.py --quick    # the CI smoke test (2-3 minutes)
    python stress/bench.py --out DIR  # where results go (default: bench-results/)

What it measures (``docs/performance.md`` explains the method and each number):

- four workloads (compute-bound items, tiny items, large tensors, sleeping items), each
  run by every contender at every ``num_workers`` of the sweep, interleaved
  (A B C, B C A, C A B, ... ) and repeated; medians are reported: throughput and its
  ratio to torch, first-batch latency, main-process CPU time per batch, peak RSS of the
  main process plus its workers;
- snaploader's per-batch snapshot cost, timed in a forked worker-like process;
- ``state_dict()`` as users call it, after every batch of a running loop (a cold
  call, then warm ones): median, p99 and max, and the ``torch.save`` size, at W = 2
  and 8 on a short and a 10**7-item dataset, and at W = 8 with persistent workers for
  issue 24's light and heavy pipelines (items drawing from the three global RNGs);
- a training loop calling ``state_dict()`` after every step at W = 8, against the same
  loop without the call;
- what ``seed_per_sample=True`` costs per sample (issue 26): setting a sample's
  states alone, and a loader's time per sample with and without it beside torch's,
  at W = 0 and with worker processes;
- the time from ``load_state_dict`` to the first batch when resuming early and late in
  a long shuffled epoch, beside torch's own cold start (``iter()`` to first batch).
- a tar-shard stream (``snaploader.shards.ShardStream``) resumed at 90% of its epoch,
  through its state and by replay, to the first batch, with a simulated 5 ms read per
  sample, beside a fresh epoch's first batch (snaploader's and torch's).

Outputs: ``results.json`` in ``--out`` (every number, every repeat) and plain tables on
stdout. Nothing is asserted: the exit status is 0 whatever the timings.

The package holds one concern a module: ``config`` (the sizes of a run),
``workloads`` (the datasets), ``contenders`` (the loaders compared), one module per
measure (``throughput`` with first-batch latency and CPU time, ``memory``'s sampler
beside it, ``snapshot``, ``state_dict``, ``training_loop``, ``seed_per_sample``, ``restore``, ``shards``),
``report`` (the printed tables), and ``__main__`` (the orchestration,
``run()``, and the command line, ``main()``). Probes shared with the other stress
scripts live in ``stress/_probes.py``.
"""
