#!/usr/bin/env python
"""Codec throughput beside memcpy, measured in the same run.

For each size and compressor: encode (compress, with error feedback, header and
checksum: what a rank does per gradient) and decode (validate + decode a payload
into a new tensor, and the gather path's decode-and-accumulate), in GB/s of float32
input, next to ``dst.copy_(x)`` of the same tensor into a preallocated one. Ratios
to memcpy are what to compare across machines; absolute GB/s are noisy. Beside them,
for gather-only compressors, the public path and the bucket path side by side, each
in multiples of the same memcpy's time: ``compress`` + ``decode`` into a new tensor
(the per-tensor API) against ``compress_bucket`` + ``decode_frame`` of a bucket of one
tensor into an accumulator (what the allgather exchange runs), and their ratio
(issue 31's target: public / bucket <= 2 for every codec).

    python scripts/bench_codec.py                      # CPU, one thread, 1e4..1e8
    python scripts/bench_codec.py --device cuda        # GPU (CuPy kernels)
    python scripts/bench_codec.py --sizes 1e6 1e7 --json results/bench_codec.json
    python scripts/bench_codec.py --targets            # issue 11's targets, 1e7, one thread
    python scripts/bench_codec.py --overhead           # 160 tensors vs one of the same size
    python scripts/bench_codec.py --overhead --device cuda   # the same on a GPU

``--threads`` sets torch's threads and the CPU codecs' (``HVDC_NUM_THREADS``; default 1).
``--targets`` times the target cases at 1e7 and prints each target as a multiple of the
same run's memcpy, met or not. ``--overhead`` times compress + decode of a 160-tensor
bucket (sizes log-uniform, seeded, like a ResNet-50's parameter list) per tensor
(``compress`` / ``decode_parsed`` in a loop) and per bucket (``compress_bucket`` /
``decode_frame``, what the allgather exchange runs), each against one tensor of the same
total size.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from pathlib import Path

import torch

import hvdcompress
from hvdcompress import framing, wire
from hvdcompress.compressors import GatherCompressor, SummableCompressor, registry
from hvdcompress.training.methods import parse_case  # "name:key=value,..." or a method

try:  # python scripts/bench_codec.py: scripts/ is first on sys.path
    from _bench import report, stats
except ModuleNotFoundError:  # loaded by file path from the repository root
    from scripts._bench import report, stats


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


def gradient(n: int, device: torch.device, seed: int) -> torch.Tensor:
    """A Gaussian stand-in for a gradient (no heavy tail, so 3LC's bits are not flattered)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen).to(device)


def _matrix_shape(n: int) -> tuple[int, int]:
    rows = int(n**0.5)
    while n % rows:
        rows -= 1
    return rows, n // rows


def _phases(comp, t: torch.Tensor, side: torch.Tensor | None):
    """(encode, decode into a new tensor, bits per value). A summable multi-phase
    compressor (PowerSGD: P, then Q from the summed P) is timed as on one rank: encode is
    its first phase, decode the later phases plus decompress. side: the side information
    of a compressor that decodes with it (NDQSG), else None."""
    phases = comp.phases if isinstance(comp, SummableCompressor) else 1

    def encode():
        return comp.compress(t, "bench")

    def decode(payload, ctx):
        sent = payload.numel() * payload.element_size()
        for phase in range(1, phases):
            payload = comp.next_phase(payload, ctx, phase)
            sent += payload.numel() * payload.element_size()
        if side is not None:
            return comp.decode(payload, expect=ctx, side_info=side), sent
        return comp.decompress(payload, ctx), sent

    payload, ctx = encode()
    if phases == 1:
        bits = comp.bits_per_value(payload)
    else:
        bits = 8.0 * decode(payload, ctx)[1] / t.numel()
    return encode, decode, bits


def _bucket_path(comp_for, t: torch.Tensor, run, reps: int, rank: int) -> float:
    """Seconds of ``compress_bucket`` + ``decode_frame`` (into an accumulator) of a bucket
    of the one tensor ``t``, by a compressor of its own (``comp_for()``), warmed up like
    the public path. ``rank``: the sender (NDQSG decodes rank 1's frame with acc / 1)."""
    comp = comp_for()
    acc = torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
    for _ in range(3):
        frame, ctxs = framing.compress_bucket(comp, [t], ["bench"])
        framing.decode_frame(comp, frame, [acc], ctxs, rank=rank)
    encode = run(lambda: framing.compress_bucket(comp, [t], ["bench"]), reps)
    frame, ctxs = framing.compress_bucket(comp, [t], ["bench"])
    decode = run(lambda: framing.decode_frame(comp, frame, [acc], ctxs, rank=rank), reps)
    return encode + decode


def bench_size(n: int, cases: list[str], device: torch.device, run, min_time: float) -> list:
    x = gradient(n, device, seed=n % 9973)
    dst = torch.empty_like(x)
    dst.copy_(x)
    reps = stats.repeats(run, lambda: dst.copy_(x), min_time, 200)
    rows = []
    gb = n * 4 / 1e9
    for case in cases:
        # memcpy again beside every case: on a shared machine the load drifts between cases
        memcpy = run(lambda: dst.copy_(x), reps)
        # a new tensor's allocation and first write, which the public decode pays and the
        # bucket path (an accumulator kept from step to step) does not
        zeros = run(lambda: torch.zeros(n, device=device), reps)
        name, params = parse_case(case)
        comp = hvdcompress.get_compressor(name, **params)
        # NDQSG: the nested code, which every rank after the DQSG-coded first ones sends
        # (rank 1 of 2), decoded with the input itself as the side information
        side = x if isinstance(comp, GatherCompressor) and comp.uses_side_info else None
        comp.bind(0, 1) if side is None else comp.bind(1, 2)
        t = x.view(_matrix_shape(n)) if needs_matrix(name) else x
        encode_fn, decode_fn, first_bits = _phases(comp, t, side)
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
            decode = accumulate = bucket = None
        else:

            def comp_for(name=name, params=params, side=side):
                c = hvdcompress.get_compressor(name, **params)
                c.bind(0, 1) if side is None else c.bind(1, 2)
                return c

            bucket = _bucket_path(comp_for, t, run, reps, 0 if side is None else 1)
            acc = torch.zeros(n, dtype=torch.float32, device=device)
            decode = run(
                lambda comp=comp, p=payload, a=acc, y=side: comp.decode(p, out=a, side_info=y),
                reps,
            )
            accumulate = run(
                lambda comp=comp, p=payload, a=acc, y=side: comp.decode(
                    p, out=a, accumulate=True, side_info=y
                ),
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
                # time in multiples of memcpy's: public = compress + decode into a new
                # tensor, bucket = compress_bucket + decode_frame (a bucket of one)
                "public_x_memcpy": None if bucket is None else (encode + new) / memcpy,
                "bucket_x_memcpy": None if bucket is None else bucket / memcpy,
                "public_vs_bucket": None if bucket is None else (encode + new) / bucket,
                "new_zeros_x_memcpy": zeros / memcpy,
                "reps": reps,
            }
        )
    return rows


def _gbs(value: float | None) -> str:
    return f"{'-':>8}" if value is None else f"{value:>7.2f}G"


def _pct(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>6.0%}"


def _times(value: float | None) -> str:
    return f"{'-':>7}" if value is None else f"{value:>6.2f}x"


def print_table(rows: list) -> None:
    head = (
        f"{'case':<24} {'numel':>9} {'bits/val':>8} {'1st call':>8} {'ratio':>7} {'memcpy':>8} "
        f"{'encode':>8} {'enc/mc':>7} {'decode':>8} {'dec/mc':>7} {'dec+acc':>8} {'acc/mc':>7} "
        f"{'new/mc':>7} {'public':>7} {'bucket':>7} {'pub/bkt':>7} {'zeros':>7}"
    )
    report.print_fixed(
        head,
        (
            f"{r['case']:<24} {r['numel']:>9.0e} {r['bits_per_value']:>8.3f} "
            f"{r['first_call_bits_per_value']:>8.3f} "
            f"{r['ratio']:>6.0f}x {r['memcpy_gbs']:>7.2f}G {r['encode_gbs']:>7.2f}G "
            f"{r['encode_vs_memcpy']:>6.0%} {_gbs(r['decode_gbs'])} "
            f"{_pct(r['decode_vs_memcpy'])} {_gbs(r['accumulate_gbs'])} "
            f"{_pct(r['accumulate_vs_memcpy'])} {r['decode_new_tensor_vs_memcpy']:>6.0%} "
            f"{_times(r['public_x_memcpy'])} {_times(r['bucket_x_memcpy'])} "
            f"{_times(r['public_vs_bucket'])} {_times(r['new_zeros_x_memcpy'])}"
            for r in rows
        ),
    )
    print(
        f"Input: {INPUT}.\n"
        "bits/val: bits per value (header included) of the timed payloads, after the\n"
        "warm-up and timed calls (error feedback built up); 1st call: the first payload's.\n"
        "GB/s of float32 input; x/mc = throughput relative to memcpy into a preallocated tensor,\n"
        "timed just before each case in this run. encode: compress with error feedback, header\n"
        "and checksum. decode: into a preallocated tensor; dec+acc: added into one (the gather\n"
        "path); new: into a new tensor.\n"
        "public / bucket: time of compress + decode into a new tensor (the per-tensor API)\n"
        "and of compress_bucket + decode_frame into an accumulator (a bucket of one, what the\n"
        "allgather exchange runs), in multiples of memcpy's time; pub/bkt: their ratio.\n"
        "zeros: torch.zeros of the size (a new tensor's allocation and first write, part of\n"
        "every decode into a new tensor), in multiples of memcpy's time.\n"
        "Summable compressors are decoded after the allreduce: only 'new' applies (PowerSGD:\n"
        "encode = P, new = Q from P + decompress, on one rank). NDQSG: rank 1 of 2 (the nested\n"
        "code), decoded with the input as side information."
    )


# issue 11's targets: (case, what, bound); what: "enc" encode / memcpy throughput (>=),
# "acc" decode into a preallocated accumulator / memcpy (>=), "x" (encode + accumulate
# time) / memcpy time (<=).
TARGETS = [
    ("3lc:sparsity=1.0", "enc", 0.5),
    ("3lc:sparsity=1.0", "acc", 1.0),
    ("3lc:sparsity=1.75", "enc", 0.5),
    ("3lc:sparsity=1.75", "acc", 1.0),
    ("signsgd", "x", 4.0),
    ("efsignsgd", "x", 4.0),
    ("qsgd:levels=16", "x", 8.0),
    ("terngrad", "x", 8.0),
    ("topk:ratio=0.01", "x", 10.0),
]


# issue 31's target: the public path (compress + decode) at most this many times the
# bucket path's time, for every gather-only case
PUBLIC_VS_BUCKET = 2.0


def target_rows(rows: list) -> list:
    """Each target of TARGETS against the rows of the largest size benchmarked, then the
    public / bucket target of every gather-only case benchmarked at that size."""
    n = max(r["numel"] for r in rows)
    by_case = {r["case"]: r for r in rows if r["numel"] == n}
    out = []
    for case, what, bound in TARGETS:
        r = by_case.get(case)
        if r is None:
            continue
        if what == "x":
            value = 1.0 / r["encode_vs_memcpy"] + 1.0 / r["accumulate_vs_memcpy"]
            met = value <= bound
            text = f"encode + decode-accumulate = {value:.2f}x memcpy (target <= {bound:g}x)"
        else:
            value = r["encode_vs_memcpy" if what == "enc" else "accumulate_vs_memcpy"]
            met = value >= bound
            name = "encode with EF" if what == "enc" else "decode into an accumulator"
            text = f"{name} = {value:.0%} of memcpy (target >= {bound:.0%})"
        out.append({"case": case, "numel": n, "metric": what, "value": value,
                    "bound": bound, "met": met, "text": text})  # fmt: skip
    for case, r in by_case.items():
        value = r["public_vs_bucket"]
        if value is None:
            continue
        text = (
            f"public / bucket = {value:.2f}x ({r['public_x_memcpy']:.2f}x vs "
            f"{r['bucket_x_memcpy']:.2f}x memcpy; target <= {PUBLIC_VS_BUCKET:g}x)"
        )
        out.append({"case": case, "numel": n, "metric": "pub", "value": value,
                    "bound": PUBLIC_VS_BUCKET, "met": value <= PUBLIC_VS_BUCKET,
                    "text": text})  # fmt: skip
    return out


def print_targets(targets: list) -> None:
    print("\nTargets (same run's memcpy, one tensor, steady state):")
    for t in targets:
        print(f"  {'MET ' if t['met'] else 'MISS'} {t['case']:<20} {t['text']}")


def bucket_sizes(total: int, count: int, seed: int = 0) -> list[int]:
    """``count`` tensor sizes, log-uniform between 64 and total / 8 (seeded), scaled to add
    up to ``total``."""
    gen = torch.Generator().manual_seed(seed)
    logs = torch.rand(count, generator=gen, dtype=torch.float64)
    raw = torch.exp(math.log(64) + logs * (math.log(max(total // 8, 65)) - math.log(64)))
    sizes = [max(1, int(v)) for v in (raw / raw.sum() * total).tolist()]
    sizes[-1] += total - sum(sizes)
    return sizes


def _overhead_case(comp_for, tensors, names, run, min_time: float, rank: int = 0) -> dict:
    """Seconds per step of compress + decode-accumulate: the bucket as one tensor, as
    ``count`` payloads one by one, and through the bucket API. ``rank``: the sender, whose
    frame a compressor with side information decodes with the gather path's (acc / rank).
    Everything on the tensors' device (frames too: what a transport that moves device
    tensors hands back)."""
    whole = torch.cat(tensors)
    accs = [torch.zeros_like(t) for t in tensors]
    acc_one = torch.zeros_like(whole)
    one_c, loop_c, bucket_c = comp_for(), comp_for(), comp_for()

    def side(acc):
        return acc / rank if one_c.uses_side_info and rank else None

    def one():
        payload, ctx = one_c.compress(whole, "whole")
        one_c.decode(payload, expect=ctx, out=acc_one, accumulate=True, side_info=side(acc_one))

    def loop():
        frame = wire.frame([loop_c.compress(t, n)[0] for t, n in zip(tensors, names, strict=True)])
        parsed = wire.unframe_parsed(frame, rank, names, frame.device)
        for (header, payload), acc, n in zip(parsed, accs, names, strict=True):
            framing.decode_parsed(
                loop_c, header, payload, name=n, out=acc, accumulate=True, side_info=side(acc)
            )

    def bucket():  # what the allgather exchange runs per bucket and rank
        frame, ctxs = framing.compress_bucket(bucket_c, tensors, names)
        framing.decode_frame(bucket_c, frame, accs, ctxs, rank=rank)

    times = {}
    for key, fn in (("one", one), ("loop", loop), ("bucket", bucket)):
        for _ in range(3):
            fn()
        times[key] = run(fn, stats.repeats(run, fn, min_time, 100))
    return times


def _overhead_row(label: str, count: int, total: int, t: dict) -> dict:
    return {
        "case": label,
        "tensors": count,
        "total_numel": total,
        "one_ms": 1e3 * t["one"],
        "loop_ms": 1e3 * t["loop"],
        "bucket_ms": 1e3 * t["bucket"],
        "loop_vs_one": t["loop"] / t["one"],
        "bucket_vs_one": t["bucket"] / t["one"],
        "per_tensor_us_loop": 1e6 * (t["loop"] - t["one"]) / count,
        "per_tensor_us_bucket": 1e6 * (t["bucket"] - t["one"]) / count,
    }


def bench_overhead(
    cases: list[str], total: int, count: int, run, min_time: float, device: torch.device
) -> list:
    """compress + decode of one tensor vs ``count`` tensors of the same total size."""
    sizes = bucket_sizes(total, count)
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=gen).to(device) for n in sizes]
    names = [f"layer{i}" for i in range(count)]
    rows = []
    for case in cases:
        name, params = parse_case(case)
        cls = registry.REGISTRY[name]
        if cls.summable:
            continue
        # rank 0 of 1; a compressor with side information (NDQSG) also as rank 1 of 2,
        # which sends its nested code and decodes with the side information
        binds = [(0, 1)] + ([(1, 2)] if cls.uses_side_info else [])
        for rank, size in binds:

            def comp_for(name=name, params=params, rank=rank, size=size):
                comp = hvdcompress.get_compressor(name, **params)
                comp.bind(rank, size)
                return comp

            t = _overhead_case(comp_for, tensors, names, run, min_time, rank)
            label = case if rank == 0 else f"{case} (rank {rank} of {size})"
            rows.append(_overhead_row(label, count, total, t))
    head = (
        f"{'case':<24} {'tensors':>7} {'one':>9} {'loop':>9} {'bucket':>9} "
        f"{'loop/one':>8} {'bkt/one':>8} {'us/t loop':>9} {'us/t bkt':>9}"
    )
    report.print_fixed(
        head,
        (
            f"{r['case']:<24} {r['tensors']:>7} {r['one_ms']:>7.2f}ms {r['loop_ms']:>7.2f}ms "
            f"{r['bucket_ms']:>7.2f}ms {r['loop_vs_one']:>7.2f}x {r['bucket_vs_one']:>7.2f}x "
            f"{r['per_tensor_us_loop']:>9.0f} {r['per_tensor_us_bucket']:>9.0f}"
            for r in rows
        ),
    )
    where = "one thread" if device.type == "cpu" else str(device)
    print(
        f"compress + decode-accumulate per step, {where}: {count} tensors (sizes "
        f"log-uniform, seeded, total {total:.0e}) one by one (loop) and through the bucket "
        "API (bucket), vs one tensor of that size; target: bucket/one <= 1.3x"
    )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6, 1e7, 1e8])
    parser.add_argument(
        "--cases", nargs="+", default=DEFAULT_CASES, help="name:key=value,... or a method name"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch and CPU codec threads (default 1)"
    )
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    parser.add_argument("--json", type=Path, default=None, help="default results/<mode>.json")
    parser.add_argument("--targets", action="store_true", help="issue 11's targets at 1e7")
    parser.add_argument("--overhead", action="store_true", help="160 tensors vs one")
    parser.add_argument("--tensors", type=int, default=160, help="--overhead: tensors")
    parser.add_argument("--total", type=float, default=1e7, help="--overhead: total numel")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    os.environ["HVDC_NUM_THREADS"] = str(args.threads)
    if args.targets:
        args.cases = list(dict.fromkeys(case for case, _, _ in TARGETS))
        if args.sizes == parser.get_default("sizes"):
            args.sizes = [1e7]
    mode = "bench_overhead" if args.overhead else "bench_codec"
    json_path = args.json or Path(f"results/{mode}.json")
    device = torch.device(args.device)
    if device.type == "cuda":
        from hvdcompress.backends.cuda import gpu_unavailable_reason

        reason = gpu_unavailable_reason()
        if reason:
            print(f"bench_codec: no GPU benchmark: {reason}")
            return 2
    run = stats.timer(device)
    if args.overhead:
        rows = bench_overhead(args.cases, int(args.total), args.tensors, run, args.min_time, device)
        meta = {"threads": args.threads, "device": str(device)}
        report.write_json(json_path, {**meta, "rows": rows}, indent=2)
        print(f"wrote {json_path}")
        return 0
    rows = []
    for size in args.sizes:
        rows += bench_size(int(size), args.cases, device, run, args.min_time)
    print_table(rows)
    targets = target_rows(rows)
    if targets:
        print_targets(targets)
    meta = {
        "input": " ".join(INPUT.split()),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads": args.threads,
        **report.versions(),
    }
    report.write_json(json_path, {"meta": meta, "rows": rows, "targets": targets}, indent=2)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
