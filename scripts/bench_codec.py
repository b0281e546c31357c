#!/usr/bin/env python
"""Codec throughput beside memcpy, measured in the same run.

For each size and compressor: encode (compress, with error feedback, header and
checksum: what a rank does per gradient) and decode (validate + decode a payload
into a new tensor, and the gather path's decode-and-accumulate), in GB/s of float32
input, next to ``dst.copy_(x)`` of the same tensor into a preallocated one. Ratios
to memcpy are what to compare across machines; absolute GB/s are noisy.

    python scripts/bench_codec.py                      # CPU, one thread, 1e4..1e8
    python scripts/bench_codec.py --device cuda        # GPU (CuPy kernels)
    python scripts/bench_codec.py --sizes 1e6 1e7 --json results/bench_codec.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import hvdcompress
from hvdcompress import registry
from hvdcompress.compressors import SummableCompressor
from hvdcompress.training.methods import parse_case  # "name:key=value,..." or a method


def case_text(name: str, params: dict) -> str:
    return name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


# Every registered compressor's benchmark configurations (``benchmarks``, registry).
DEFAULT_CASES = [case_text(name, params) for name, params in registry.bench_cases()]


INPUT = (
    "one N(0, 1) float32 tensor per size (seeded), compressed again at every call, so an\n"
    "error-feedback residual accumulates as it would for a gradient that does not change"
)


def needs_matrix(name: str) -> bool:
    """Multi-phase low-rank compressors (PowerSGD) are timed on a square-ish matrix."""
    cls = registry.REGISTRY.get(name)
    return cls is not None and cls.summable and cls.phases > 1


def timer(device: torch.device):
    if device.type == "cuda":

        def run(fn, reps):
            times = []
            for _ in range(reps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)

    else:

        def run(fn, reps):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

    return run


def gradient(n: int, device: torch.device, seed: int) -> torch.Tensor:
    """A Gaussian stand-in for a gradient (no heavy tail, so 3LC's bits are not flattered)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(device)


def _matrix_shape(n: int) -> tuple[int, int]:
    rows = int(n**0.5)
    while n % rows:
        rows -= 1
    return rows, n // rows


def _phases(comp, t: torch.Tensor):
    """(encode, decode into a new tensor, bits per value). A summable multi-phase
    compressor (PowerSGD: P, then Q from the summed P) is timed as on one rank: encode is
    its first phase, decode the later phases plus decompress."""
    phases = comp.phases if isinstance(comp, SummableCompressor) else 1

    def encode():
        return comp.compress(t, "bench")

    def decode(payload, ctx):
        sent = payload.numel() * payload.element_size()
        for phase in range(1, phases):
            payload = comp.next_phase(payload, ctx, phase)
            sent += payload.numel() * payload.element_size()
        return comp.decompress(payload, ctx), sent

    payload, ctx = encode()
    if phases == 1:
        bits = comp.bits_per_value(payload)
    else:
        bits = 8.0 * decode(payload, ctx)[1] / t.numel()
    return encode, decode, bits


def bench_size(n: int, cases: list[str], device: torch.device, run, min_time: float) -> list:
    x = gradient(n, device, seed=n % 9973)
    dst = torch.empty_like(x)
    dst.copy_(x)
    probe = max(run(lambda: dst.copy_(x), 1), 1e-6)
    reps = int(min(max(min_time / probe, 3), 200))
    memcpy = run(lambda: dst.copy_(x), reps)
    rows = []
    gb = n * 4 / 1e9
    for case in cases:
        name, params = parse_case(case)
        comp = hvdcompress.get_compressor(name, **params)
        comp.bind(0, 1)
        t = x.view(_matrix_shape(n)) if needs_matrix(name) else x
        encode_fn, decode_fn, first_bits = _phases(comp, t)
        for _ in range(3):  # warm-up: allocates the residual, which then reaches steady state
            decode_fn(*encode_fn())
        encode = run(encode_fn, reps)
        # Bits per value of what was timed: the payload after the timed calls, error
        # feedback built up (3LC's first call sends far fewer bits than its steady state).
        payload, ctx = encode_fn()
        if isinstance(comp, SummableCompressor) and comp.phases > 1:
            bits = 8.0 * decode_fn(payload, ctx)[1] / t.numel()
            new = run(lambda e=encode_fn, d=decode_fn: d(*e()), reps) - encode
        else:
            bits = first_bits if comp.summable else comp.bits_per_value(payload)
            new = run(lambda d=decode_fn, p=payload, c=ctx: d(p, c), reps)
        if comp.summable:  # decoded after the allreduce: no gather-path decode to measure
            decode = accumulate = None
        else:
            acc = torch.zeros(n, dtype=torch.float32, device=device)
            decode = run(lambda comp=comp, p=payload, a=acc: comp.decode(p, out=a), reps)
            accumulate = run(
                lambda comp=comp, p=payload, a=acc: comp.decode(p, out=a, accumulate=True),
                reps,
            )
        rows.append(
            {
                "case": case,
                "numel": n,
                "bits_per_value": bits,
                "first_call_bits_per_value": first_bits,
                "ratio": 32.0 / bits,
                "memcpy_gbs": gb / memcpy,
                "encode_gbs": gb / encode,
                "decode_gbs": None if decode is None else gb / decode,
                "decode_new_tensor_gbs": gb / new,
                "accumulate_gbs": None if accumulate is None else gb / accumulate,
                "encode_vs_memcpy": memcpy / encode,
                "decode_vs_memcpy": None if decode is None else memcpy / decode,
                "decode_new_tensor_vs_memcpy": memcpy / new,
                "accumulate_vs_memcpy": None if accumulate is None else memcpy / accumulate,
                "reps": reps,
            }
        )
    return rows


def _gbs(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>7.2f}G"


def _pct(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>6.0%}"


def print_table(rows: list) -> None:
    head = (
        f"{'case':<24} {'numel':>9} {'bits/val':>8} {'1st call':>8} {'ratio':>7} {'memcpy':>8} "
        f"{'encode':>8} {'enc/mc':>7} {'decode':>8} {'dec/mc':>7} {'dec+acc':>8} {'acc/mc':>7} "
        f"{'new/mc':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['case']:<24} {r['numel']:>9.0e} {r['bits_per_value']:>8.3f} "
            f"{r['first_call_bits_per_value']:>8.3f} "
            f"{r['ratio']:>6.0f}x {r['memcpy_gbs']:>7.2f}G {r['encode_gbs']:>7.2f}G "
            f"{r['encode_vs_memcpy']:>6.0%} {_gbs(r['decode_gbs'])} "
            f"{_pct(r['decode_vs_memcpy'])} {_gbs(r['accumulate_gbs'])} "
            f"{_pct(r['accumulate_vs_memcpy'])} {r['decode_new_tensor_vs_memcpy']:>6.0%}"
        )
    print(
        f"Input: {INPUT}.\n"
        "bits/val: bits per value (header included) of the timed payloads, after the\n"
        "warm-up and timed calls (error feedback built up); 1st call: the first payload's.\n"
        "GB/s of float32 input; x/mc = throughput relative to memcpy into a preallocated tensor\n"
        "in this run. encode: compress with error feedback, header and checksum. decode: into a\n"
        "preallocated tensor; dec+acc: added into one (the gather path); new: into a new tensor.\n"
        "Summable compressors are decoded after the allreduce: only 'new' applies (PowerSGD:\n"
        "encode = P, new = Q from P + decompress, on one rank)."
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6, 1e7, 1e8])
    parser.add_argument(
        "--cases", nargs="+", default=DEFAULT_CASES, help="name:key=value,... or a method name"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--json", type=Path, default=Path("results/bench_codec.json"))
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        from hvdcompress.backends.cuda import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason:
            print(f"bench_codec: no GPU benchmark: {reason}")
            return 2
    run = timer(device)
    rows = []
    for size in args.sizes:
        rows += bench_size(int(size), args.cases, device, run, args.min_time)
    print_table(rows)
    meta = {
        "input": " ".join(INPUT.split()),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
