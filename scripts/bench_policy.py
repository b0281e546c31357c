#!/usr/bin/env python
"""Step-time overhead of the adaptive policies (Accordion, CAT) against the same
compressor at a fixed level, measured in one run.

    mpirun -np 2 --oversubscribe python scripts/bench_policy.py [--steps 60]
    python scripts/bench_policy.py            # one rank (mpi4py singleton)

Model: the Fashion-MNIST SmallCNN of hvdcompress.training.models (scripts/train.py's
default, ``--width``) on a fixed synthetic batch. Each pair is a method of the table
hvdcompress.training.methods.METHODS with a policy, at this benchmark's policy settings
(CAT with a fixed cost model, no calibration), against the same compressor without it.
For each pair (fixed compressor, compressor + policy) the two optimizers train copies of
the model step by step in alternation (ABAB..., so machine noise hits both alike) and
the median step time (forward, backward, compress, communicate, decode, policy, update;
the slowest rank's median) is reported with the policy's overhead in percent, plus the
mean step time, which includes the policies' decision steps (Accordion: one small
allgather per interval; CAT: a sort per tensor and one small allgather every S steps).
Rank 0 prints a markdown table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import hvdcompress
from hvdcompress.training.methods import METHODS, Method
from hvdcompress.training.models import MODELS
from hvdcompress.transports import make_transport

try:  # python scripts/bench_policy.py: scripts/ is first on sys.path
    from _bench import report, stats, steps
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import report, stats, steps

ROOT = Path(__file__).resolve().parents[1]

# (label, method with a policy, the policy's settings here)
PAIRS = [
    ("3lc s=1.0 vs Accordion(1.0, 1.75, every 10 steps)", "accordion-3lc", {"interval_steps": 10}),
    ("topk 1% vs CAT(topk, S=200)", "cat-topk", {"recompute_every": 200}),
    ("topk 1% vs CAT(topk, S=10)", "cat-topk", {"recompute_every": 10}),
    ("topkq 1% vs CAT(topk+q, S=10)", "cat-topkq", {"recompute_every": 10}),
    ("gspar 1% vs CAT(randomk, S=10)", "cat-randomk", {"recompute_every": 10}),
]


def make_policy(method: Method, settings: dict):
    if method.policy == "cat":  # a fixed cost model: no calibration, the same on every rank
        settings = {"cost_model": hvdcompress.AffineCost(1e-4, 1e-9), **settings}
    return method.make_policy(**settings)


def make(args, method: Method, policy, transport):
    torch.manual_seed(0)
    model = MODELS["cnn"](args.width)
    opt = steps.distributed_sgd(model, method.compressor(), transport, policy=policy,
                                compress_min_numel=method.compress_min_numel)  # fmt: skip
    return model, opt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="timed steps per optimizer")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench_policy.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    transport = make_transport("mpi4py")
    g = torch.Generator().manual_seed(transport.rank)
    x = torch.randn(args.batch_size, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    rows = []
    for label, name, settings in PAIRS:
        method = METHODS[name]
        fixed = make(args, method.fixed, None, transport)
        adaptive = make(args, method, make_policy(method, settings), transport)
        times = {"fixed": [], "policy": []}
        for i in range(args.warmup + args.steps):
            for key, (model, opt) in (("fixed", fixed), ("policy", adaptive)):
                transport.barrier()
                elapsed = steps.train_step(model, opt, x, y)
                if i >= args.warmup:
                    times[key].append(elapsed)
        gather = transport.allgather_object
        med = {k: stats.slowest_rank(gather, statistics.median(v)) for k, v in times.items()}
        mean = {k: stats.slowest_rank(gather, statistics.fmean(v)) for k, v in times.items()}
        rows.append(
            {
                "pair": label,
                "fixed_median_ms": 1e3 * med["fixed"],
                "policy_median_ms": 1e3 * med["policy"],
                "median_overhead_pct": 100 * (med["policy"] / med["fixed"] - 1),
                "fixed_mean_ms": 1e3 * mean["fixed"],
                "policy_mean_ms": 1e3 * mean["policy"],
                "mean_overhead_pct": 100 * (mean["policy"] / mean["fixed"] - 1),
            }
        )
    if transport.rank == 0:
        print(
            f"{transport.size} rank(s), CNN width {args.width}, batch {args.batch_size}, "
            f"{args.steps} timed steps each (alternating)\n"
        )
        head = [
            "fixed vs adaptive",
            "fixed median ms",
            "adaptive median ms",
            "overhead (median)",
            "fixed mean ms",
            "adaptive mean ms",
            "overhead (mean)",
        ]
        cells = [[r["pair"], f"{r['fixed_median_ms']:.1f}", f"{r['policy_median_ms']:.1f}",
                  f"{r['median_overhead_pct']:+.1f}%", f"{r['fixed_mean_ms']:.1f}",
                  f"{r['policy_mean_ms']:.1f}", f"{r['mean_overhead_pct']:+.1f}%"]
                 for r in rows]  # fmt: skip
        print("\n".join(report.md_table(head, cells)))
        report.write_json(args.out, {"ranks": transport.size, "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
