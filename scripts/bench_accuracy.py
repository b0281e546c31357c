#!/usr/bin/env python
"""Accuracy against traffic: every method trained the same way on 4 ranks of Fashion-MNIST.

    python scripts/bench_accuracy.py [--methods none 3lc ...] [--seeds 1 2 3] [--epochs 2]

For each method and seed it runs ``horovodrun -np N -H localhost:N python scripts/train.py
... --seed S --epochs E`` (same model, batch, learning rate, data order and epochs for
every method; only the compression differs), then reports per method the final test
accuracy (mean, standard deviation and range over the seeds), the bytes each rank sent
over the whole run (from the payload sizes the optimizer actually produced, through the
ring model of docs/design.md section 7: what an allreduce / allgather moves per rank), the reduction
against ``none``, and the training wall-clock. Outputs under ``--out`` (default
results/accuracy): ``bench_accuracy.md`` (table), ``bench_accuracy.json`` (every run),
``accuracy_vs_bytes.png`` and ``accuracy_vs_wallclock.png`` (test accuracy after each
epoch against the cumulative bytes / training seconds = steps x median step time, mean
over seeds).

Runs already finished under ``--out`` (a ``summary:`` line in their log) are reused, so
an interrupted benchmark resumes where it stopped; ``--fresh`` reruns everything.

Wall-clock caveat: on a small machine the ranks share the cores (4 ranks on 2 here) and
the link is shared memory, so wall-clock shows compute and codec cost, not network time
(scripts/bench_network.py measures that).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hvdcompress.training.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]

# Methods of the one table; each run is train.py with ``METHODS[name].train_flags()``.
# Accordion and its two fixed levels use the same pair (1.0, 1.75), so "3lc" is
# Accordion's always-low and "3lc-1.75" its always-high.
DEFAULT_METHODS = ["none", "fp16", "3lc", "3lc-1.75", "accordion-3lc", "topk", "cat-topk"]
SUMMARY = re.compile(r"summary: .*")


def parse_summary(text: str) -> dict | None:
    line = None
    for m in SUMMARY.finditer(text):
        line = m.group(0)
    if line is None:
        return None
    words = line.split()[1:]
    out = {}
    for key, value in zip(words[::2], words[1::2], strict=False):
        out[key] = value
    return {
        "test_accuracy": float(out["test_accuracy"]),
        "bytes_sent_per_rank": float(out["bytes_sent_per_rank"]),
        "uncompressed_allreduce_bytes": float(out["uncompressed_allreduce_bytes"]),
        "steps": int(out["steps"]),
    }


def read_curve(log_dir: Path) -> list[dict]:
    """Test accuracy after each epoch with the cumulative bytes per rank and training
    seconds, counted as steps x the run's median step time: robust to the odd step slowed
    by another job (or a paused run) on a shared machine."""
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    median_step = statistics.median(float(r["step_s"]) for r in rows) if rows else 0.0
    curve, wire = [], 0.0
    for row in rows:
        wire += float(row["bytes_sent"])
        if row["test_acc"]:
            step = int(row["step"])
            curve.append(
                {"step": step, "acc": float(row["test_acc"]), "bytes": wire,
                 "seconds": step * median_step, "median_step_s": median_step}
            )  # fmt: skip
    return curve


def run_one(method: str, seed: int, args, out: Path) -> dict:
    log_dir = out / method / f"seed{seed}"
    log_file = out / method / f"seed{seed}.log"
    if not args.fresh and log_file.is_file():
        summary = parse_summary(log_file.read_text(errors="replace"))
        if summary is not None and (log_dir / "metrics.csv").is_file():
            print(f"bench_accuracy: reusing {log_file}", flush=True)
            return {"method": method, "seed": seed, **summary, "curve": read_curve(log_dir),
                    "wall_s": None}  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    cmd = [
        str(Path(py).parent / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}",
        py, str(ROOT / "scripts" / "train.py"), *METHODS[method].train_flags(),
        "--epochs", str(args.epochs), "--seed", str(seed), "--log-dir", str(log_dir),
        "--no-progress", *args.train_args,
    ]  # fmt: skip
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    print(f"bench_accuracy: {method} seed {seed}: {' '.join(cmd[4:])}", flush=True)
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    summary = parse_summary(log_file.read_text(errors="replace"))
    if rc != 0 or summary is None:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"bench_accuracy: {method} seed {seed} failed (exit {rc}):\n{tail}")
    print(
        f"bench_accuracy: {method} seed {seed}: accuracy {summary['test_accuracy']:.4f} "
        f"bytes/rank {summary['bytes_sent_per_rank']:.4g} ({wall:.0f} s)",
        flush=True,
    )
    return {"method": method, "seed": seed, **summary, "curve": read_curve(log_dir),
            "wall_s": wall}  # fmt: skip


def aggregate(runs: list[dict], methods: list[str]) -> list[dict]:
    rows = []
    for m in methods:
        rs = [r for r in runs if r["method"] == m]
        if not rs:
            continue
        accs = [100.0 * r["test_accuracy"] for r in rs]
        rows.append(
            {
                "method": m,
                "seeds": len(rs),
                "acc_mean": statistics.fmean(accs),
                "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "acc_min": min(accs),
                "acc_max": max(accs),
                "bytes_per_rank": statistics.fmean(r["bytes_sent_per_rank"] for r in rs),
                "train_s": statistics.fmean(r["curve"][-1]["seconds"] for r in rs),
            }
        )
    base = next((r for r in rows if r["method"] == "none"), None)
    for r in rows:
        r["bytes_reduction"] = base["bytes_per_rank"] / r["bytes_per_rank"] if base else None
        r["acc_vs_none"] = r["acc_mean"] - base["acc_mean"] if base else None
    return rows


def markdown(rows: list[dict], args) -> str:
    head = (
        f"{args.np} ranks, Fashion-MNIST CNN, {args.epochs} epochs, seeds "
        f"{' '.join(map(str, args.seeds))}; accuracy in %, mean ± std (min-max) over seeds\n\n"
        "| method | test accuracy | vs none (pts) | bytes sent per rank | fewer bytes than none "
        "| training s |\n|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        vs = "" if r["acc_vs_none"] is None else f"{r['acc_vs_none']:+.2f}"
        red = "" if r["bytes_reduction"] is None else f"{r['bytes_reduction']:.1f}x"
        lines.append(
            f"| {r['method']} | {r['acc_mean']:.2f} ± {r['acc_std']:.2f} "
            f"({r['acc_min']:.2f}-{r['acc_max']:.2f}) | {vs} | {r['bytes_per_rank']:,.0f} "
            f"| {red} | {r['train_s']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(runs: list[dict], methods: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, xlabel, fname, logx in (
        ("bytes", "bytes sent per rank (cumulative)", "accuracy_vs_bytes.png", True),
        (
            "seconds",
            "training time, s (steps x median step time)",
            "accuracy_vs_wallclock.png",
            False,
        ),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in methods:
            rs = [r for r in runs if r["method"] == m]
            if not rs:
                continue
            n = min(len(r["curve"]) for r in rs)
            xs = [statistics.fmean(r["curve"][i][key] for r in rs) for i in range(n)]
            ys = [100 * statistics.fmean(r["curve"][i]["acc"] for r in rs) for i in range(n)]
            err = [
                100 * statistics.stdev([r["curve"][i]["acc"] for r in rs]) if len(rs) > 1 else 0
                for i in range(n)
            ]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=m)
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy, % (after each epoch; mean ± std over seeds)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--np", type=int, default=4, help="ranks")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "accuracy")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    p.add_argument(
        "--train-args", nargs=argparse.REMAINDER, default=[], help="more train.py flags (last)"
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    runs = [run_one(m, s, args, args.out) for m in args.methods for s in args.seeds]
    rows = aggregate(runs, args.methods)
    table = markdown(rows, args)
    print(table)
    (args.out / "bench_accuracy.md").write_text(table)
    record = {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "runs": runs}
    (args.out / "bench_accuracy.json").write_text(json.dumps(record, indent=1))
    for path in plot(runs, args.methods, args.out):
        print(f"bench_accuracy: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
