#!/usr/bin/env python
"""Fusion on a model with many small tensors: one collective per bucket vs one per tensor.

Run under MPI (each rank one process), for example

    mpirun -np 4 --oversubscribe python scripts/bench_fusion.py --backend mpi4py
    horovodrun -np 4 python scripts/bench_fusion.py --backend horovod

The model is ``--layers`` Linear(16, 16) layers (2 tensors each). For each compressor,
the median time of ``synchronize()`` (compress, communicate, decode, average) is measured
with fusion on (Horovod's 64 MiB threshold: one bucket) and off (threshold 0: one
collective per tensor), in the same run. Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from hvdcompress.buckets import DEFAULT_FUSION_THRESHOLD

try:  # python scripts/bench_fusion.py: scripts/ is first on sys.path
    from _bench import report, stats, steps
except ModuleNotFoundError:  # loaded by file path from the repository root
    from scripts._bench import report, stats, steps


def measure(args, compression: str, threshold: int, comm) -> tuple[float, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(args.layers)])
    opt = steps.distributed_sgd(model, compression, args.backend, fusion_threshold=threshold)
    x = torch.randn(4, 16)
    times = []
    for i in range(args.warmup + args.steps):
        opt.zero_grad()
        model(x).sum().backward()
        comm.Barrier()
        t0 = time.perf_counter()
        opt.synchronize()
        elapsed = time.perf_counter() - t0
        with opt.skip_synchronize():
            opt.step()
        if i >= args.warmup:
            times.append(elapsed)
    # the slowest rank decides the step time
    return stats.slowest_rank(comm.allgather, statistics.median(times)), opt.last_stats.collectives


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpi4py", choices=["mpi4py", "horovod"])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compression", nargs="+", default=["3lc", "fp16"])
    parser.add_argument("--json", type=Path, default=Path("results/bench_fusion.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.backend == "horovod":
        import horovod.torch as hvd

        hvd.init()
    rows = []
    for compression in args.compression:
        fused, n_fused = measure(args, compression, DEFAULT_FUSION_THRESHOLD, comm)
        unfused, n_unfused = measure(args, compression, 0, comm)
        rows.append(
            {
                "backend": args.backend,
                "ranks": comm.size,
                "compression": compression,
                "tensors": 2 * args.layers,
                "collectives_fused": n_fused,
                "collectives_unfused": n_unfused,
                "sync_ms_fused": 1e3 * fused,
                "sync_ms_unfused": 1e3 * unfused,
                "speedup": unfused / fused,
            }
        )
    if comm.rank == 0:
        print(
            f"{'backend':<8} {'ranks':>5} {'compression':<12} {'tensors':>7} "
            f"{'fused':>14} {'unfused':>16} {'speedup':>7}"
        )
        for r in rows:
            print(
                f"{r['backend']:<8} {r['ranks']:>5} {r['compression']:<12} {r['tensors']:>7} "
                f"{r['sync_ms_fused']:>8.1f} ms/{r['collectives_fused']:<3} "
                f"{r['sync_ms_unfused']:>8.1f} ms/{r['collectives_unfused']:<5} "
                f"{r['speedup']:>6.1f}x"
            )
        print("median synchronize() time of the slowest rank / collectives per step")
        report.write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
