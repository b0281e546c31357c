#!/usr/bin/env python
"""Every compressor on the Fashion-MNIST CNN's real gradients: bits per value and speed.

One process (a one-rank ``hvdcompress.DistributedOptimizer`` on the mpi4py backend, so
every compressor, summable or not, takes its real path: compress, transport, decode).
For each case it trains the SmallCNN of ``hvdcompress.training.models`` (scripts/train.py's
default model) for ``--steps`` steps with that compressor and reports, averaged after
``--warmup`` steps:

* bits per value on the wire (headers included) and the compression ratio vs fp32,
* encode and decode throughput in GB/s of float32 gradient (compress_s / decode_s of
  ``optimizer.last_stats``; the CNN's tensors are small, so fixed costs show),
* the training loss at the end (a sanity check, not an accuracy benchmark).

    python scripts/bench_compressors.py                  # all registered compressors
    python scripts/bench_compressors.py --cases 3lc 3lc:sparsity=1.75 topk:ratio=0.01
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import hvdcompress
from hvdcompress.compressors import REGISTRY
from hvdcompress.training.data import DATA_DIR, DatasetNotFound, load_fashion_mnist
from hvdcompress.training.methods import parse_case
from hvdcompress.training.models import SmallCNN

try:  # python scripts/bench_compressors.py: scripts/ is first on sys.path
    from _bench import report, steps
except ModuleNotFoundError:  # loaded by file path from the repository root
    from scripts._bench import report, steps


def run_case(case: str, data, args) -> dict:
    name, params = parse_case(case)
    torch.manual_seed(args.seed)
    model = SmallCNN()
    spec = REGISTRY[
        name
    ].spec  # its recommended SGD settings (docs/codecs.md, "Defaults that train")
    momentum = 0.9 if spec.sgd_momentum is None else spec.sgd_momentum
    if name == "dgc":  # DGC applies the momentum itself (momentum correction)
        params.setdefault("momentum", momentum)
        momentum = 0.0
    compressor = hvdcompress.get_compressor(name, **params)
    lr = args.lr * spec.lr_factor(compressor)  # as built: its parameters may change it
    opt = steps.distributed_sgd(model, compressor, "mpi4py", lr=lr, momentum=momentum)
    (x, y), _ = data
    gen = torch.Generator().manual_seed(args.seed)
    bits, enc, dec, losses = [], [], [], []
    for step in range(args.steps):
        idx = torch.randint(0, len(x), (args.batch_size,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        s = opt.last_stats
        if step >= args.warmup:
            bits.append(s.bits_per_value)
            enc.append(s.raw_bytes / max(s.compress_s, 1e-9) / 1e9)
            dec.append(s.raw_bytes / max(s.decode_s, 1e-9) / 1e9)
    cls = REGISTRY[name]
    return {
        "case": case,
        "summable": cls.summable,
        "error_feedback": bool(getattr(compressor, "error_feedback", False)),
        "numel": sum(p.numel() for p in model.parameters()),
        "bits_per_value": statistics.mean(bits),
        "ratio": 32.0 / statistics.mean(bits),
        "encode_gbs": statistics.median(enc),
        "decode_gbs": statistics.median(dec),
        "final_loss": statistics.mean(losses[-10:]),
        "first_loss": statistics.mean(losses[:10]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=None, help="name:key=value,... or a method (all)"
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--lr", type=float, default=0.05, help="times each compressor's sgd_lr_factor"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=DATA_DIR)
    parser.add_argument("--json", type=Path, default=Path("results/bench_compressors.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = args.cases or sorted(REGISTRY)
    try:
        data = load_fashion_mnist(args.data_dir)
    except DatasetNotFound as err:
        raise SystemExit(str(err)) from None
    rows = [run_case(case, data, args) for case in cases]
    print(
        f"| {'compressor':<22} | summable | EF  | bits/value |  ratio | encode GB/s "
        f"| decode GB/s | loss {args.warmup}->{args.steps} |"
    )
    print(
        f"|{'-' * 24}|----------|-----|------------|--------|-------------|-------------|"
        f"{'-' * 16}|"
    )
    for r in rows:
        print(
            f"| {r['case']:<22} | {'yes' if r['summable'] else 'no':<8} | "
            f"{'yes' if r['error_feedback'] else 'no':<3} | {r['bits_per_value']:>10.3f} | "
            f"{r['ratio']:>5.0f}x | {r['encode_gbs']:>11.3f} | {r['decode_gbs']:>11.3f} | "
            f"{r['first_loss']:.2f} -> {r['final_loss']:.2f} |"
        )
    print(
        f"SmallCNN ({rows[0]['numel']} parameters), Fashion-MNIST, 1 rank, "
        f"batch {args.batch_size}, {args.steps} steps; GB/s of float32 gradient."
    )
    report.write_json(args.json, rows, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
