#!/usr/bin/env python
"""The long run of the payload mutation fuzzer (tests/fuzz; docs/wire-format.md,
"Validation and errors").

For every gather-only compressor in the registry, ``--per-codec`` mutated payloads
(default 100000) drawn from its example payloads (scripts/_bench/payloads.py: every example
configuration at several shapes and dtypes, plus a non-finite input). Each payload gets
one to four mutations (bit flips, byte sets, truncation, extension, zero-run bytes, and
overwrites of numel / ndim / shape / body_len / params_len / codec id / dtype / version /
flags, consistent resizes, non-finite forgeries); 35 % keep the stale checksum, 55 % get
it recomputed (forgeries that reach the body decoders), 10 % are a valid header with a
random body. Every payload is decoded as the optimizer does (``expect``), without an
expectation (``max_numel``) and into an ``out`` accumulator, under the allocation meter
of scripts/_bench/payloads.py (tests/fuzz's checks). Per compressor the table gives:

    payloads       mutated payloads decoded
    errors         every decode raised PayloadError (clean rejection)
    exact          the bytes were unchanged and decoded bit for bit as the original
    valid          a decode of the expected shape (forged, self-consistent payloads)
    crashes        any other exception (or a check of the harness that failed)
    over_bound     an allocation past the receiver's bound (harness.alloc_bound)
    hangs          one payload's decodes took longer than --hang-seconds
    largest_alloc  the largest single allocation of any decode, in bytes
    max_ops        the most aten operations of any decode

    python scripts/fuzz_payloads.py                          # 1e5 per codec
    python scripts/fuzz_payloads.py --per-codec 2000 --seed 3 --json /tmp/fuzz.json

Exit status 1 when any payload crashed, went over the bound or hung.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

try:  # python scripts/fuzz_payloads.py: scripts/ is first on sys.path
    from _bench import payloads as harness
    from _bench import report
except ModuleNotFoundError:  # loaded by file path from the repository root
    from scripts._bench import payloads as harness
    from scripts._bench import report

COLUMNS = [
    "payloads",
    "errors",
    "exact",
    "valid",
    "crashes",
    "over_bound",
    "hangs",
    "largest_alloc",
    "max_ops",
]


def fuzz_codec(name, cases, described, per_codec, seed, hang_seconds, examples=5):
    rng = random.Random(f"{seed}:{name}")
    row = dict.fromkeys(COLUMNS, 0)
    failures = []
    slowest = 0.0
    for _ in range(per_codec):
        i = rng.randrange(len(cases))
        case = cases[i]
        family = rng.random()
        ops = harness.random_ops(rng)
        side = harness.side_kwargs(case)
        start = time.perf_counter()
        kind = None
        try:
            if family < 0.35:
                out = harness.raw_mutation_case(case, ops, **side)
            elif family < 0.90:
                out = harness.forged_mutation_case(case, ops, **side)
            else:
                ops = [("body", rng.randbytes(rng.randint(0, 300)), 0)]
                out = harness.random_body_case(case, ops[0][1], **side)
            kind = {"error": "errors", "exact": "exact", "valid": "valid"}[out.kind]
            row["largest_alloc"] = max(row["largest_alloc"], out.largest)
            row["max_ops"] = max(row["max_ops"], out.ops)
        except harness.AllocationRefused as err:
            kind, why = "over_bound", str(err)
        except AssertionError as err:
            text = str(err)
            kind = "over_bound" if text.startswith("(") else "crashes"
            why = f"check failed: {text[:300]}"
        except Exception as err:  # noqa: BLE001 - the point: anything but PayloadError
            kind, why = "crashes", f"{type(err).__name__}: {str(err)[:300]}"
        elapsed = time.perf_counter() - start
        slowest = max(slowest, elapsed)
        row["payloads"] += 1
        row[kind] += 1
        if elapsed > hang_seconds:
            row["hangs"] += 1
            kind, why = "hangs", f"{elapsed:.1f} s"
        if kind in ("crashes", "over_bound", "hangs") and len(failures) < examples:
            failures.append({"kind": kind, "why": why, "payload": described[i], "ops": repr(ops)})
    row["slowest_ms"] = round(1e3 * slowest, 2)
    return row, failures


def table(rows: dict[str, dict]) -> str:
    cells = [[name, *(str(row[c]) for c in COLUMNS)] for name, row in rows.items()]
    return "\n".join(report.md_table(["codec", *COLUMNS], cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-codec", type=float, default=1e5, help="mutated payloads per codec")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--codecs", nargs="*", help="only these (default: every gather-only one)")
    ap.add_argument("--hang-seconds", type=float, default=10.0, help="a hang: slower than this")
    args = ap.parse_args(argv)
    per_codec = int(args.per_codec)
    cases, described = harness.build_cases(args.seed)
    names = args.codecs or list(cases)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        ap.error(f"not gather-only compressors: {unknown}; choose from {sorted(cases)}")
    rows, failures = {}, {}
    t0 = time.time()
    for name in names:
        t = time.time()
        rows[name], failures[name] = fuzz_codec(
            name, cases[name], described[name], per_codec, args.seed, args.hang_seconds
        )
        rows[name]["seconds"] = round(time.time() - t, 1)
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    print(table(rows))
    for name, fails in failures.items():
        for f in fails:
            print(f"{name}: {f}")
    bad = sum(r["crashes"] + r["over_bound"] + r["hangs"] for r in rows.values())
    if args.json:
        result = {
            "per_codec": per_codec,
            "seed": args.seed,
            "seconds": round(time.time() - t0, 1),
            **report.versions(),
            "machine": platform.machine(),
            "bounds": {
                "fuzz_max_numel": harness.FUZZ_MAX_NUMEL,
                "refuse_bytes": harness.REFUSE_BYTES,
                "max_ops": harness.MAX_OPS,
                "alloc_bound": "largest <= 8 limit + 2 len + 64 KiB; "
                "total <= 64 limit + 16 len + 1 MiB",
            },
            "codecs": rows,
            "failures": failures,
        }
        report.write_json(args.json, result, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
