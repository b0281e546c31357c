#!/usr/bin/env python
"""Accuracy against compression: every method trained the same way on N ranks of Fashion-MNIST.

    python scripts/bench_accuracy.py                      # docs/benchmarks-accuracy.md
    python scripts/bench_accuracy.py --methods none 3lc --seeds 1 --epochs 2 --real

For each method and seed it runs scripts/train.py with the method's flags (the one table,
``hvdcompress.training.methods.METHODS``), ``--seed S --epochs E`` and the learning-rate
schedule (default ``step``: x0.1 after 50% and 80% of the epochs, 5 and 8 of 10). Same
CNN, batch, rate, data order and epochs for every method; only the compression differs.

Ranks: by default one process plays the N ranks (``train.py --simulate-ranks N``, the
simulated world of docs/design.md, which ends with the parameters of the real N-rank run
with the same seed, bit for bit on the gather path); ``--real`` launches N processes with
``horovodrun -np N`` instead.

Reported per method: final test accuracy (mean, standard deviation and range over the
seeds) and its difference from ``none``; bits per gradient value, averaged over every rank
and every step of the run (what each rank handed to the transport; NDQSG's DQSG and nested
ranks differ, so the mean over ranks is the figure that counts), and how many times fewer
than ``none``; the training time (steps x median step time). Outputs under ``--out``
(default results/accuracy): ``bench_accuracy.md`` (the table and the issue-12 targets
checked against it), ``bench_accuracy.json`` (every run, with its per-epoch curve),
``accuracy_per_epoch.png`` (test accuracy after each epoch, mean ± std over seeds, with
the learning-rate drops), ``bits_per_value_per_epoch.png`` (mean over ranks and seeds),
``accuracy_vs_bits.png`` (final accuracy against the run's mean bits per value) and, for
every method with a policy, ``<method>_policy.png`` (scripts/plot_policy.py on its first
seed: the level per tensor with the rate drops marked).

Runs already finished under ``--out`` (a ``summary:`` line in their log) are reused, so
an interrupted benchmark resumes where it stopped; ``--fresh`` reruns everything.

Wall-clock caveat: on a small machine the ranks share the cores (4 ranks on 2 here), so
wall-clock shows compute and codec cost, not network time (scripts/bench_network.py
measures that).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hvdcompress.training.methods import METHODS

try:  # python scripts/bench_accuracy.py: scripts/ is first on sys.path
    from _bench import launch, report, stats
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import launch, report, stats

ROOT = Path(__file__).resolve().parents[1]

# Accordion and its two fixed levels use the same pair (1.0, 1.75), so "3lc" is
# Accordion's always-low and "3lc-1.75" its always-high; dqsg and ndqsg compare the
# nested code against plain dithered quantisation at the same fine levels.
DEFAULT_METHODS = ["none", "3lc", "3lc-1.75", "accordion-3lc", "dqsg", "ndqsg"]
SUMMARY = re.compile(r"summary: .*")


def parse_summary(text: str) -> dict | None:
    line = None
    for m in SUMMARY.finditer(text):
        line = m.group(0)
    if line is None:
        return None
    words = line.split()[1:]
    out = dict(zip(words[::2], words[1::2], strict=False))
    return {
        "test_accuracy": float(out["test_accuracy"]),
        "bits_per_value_ranks": float(out["bits_per_value_ranks"]),
        "bytes_sent_rank0": float(out["bytes_sent_per_rank"]),
        "steps": int(out["steps"]),
        "param_digest": out["param_digest"],
        # the exchanges that carried the gradients ([] where none of hvdcompress's did)
        "exchanges": [e for e in out.get("exchanges_used", "-").split(",") if e != "-"],
    }


def read_curve(log_dir: Path) -> list[dict]:
    """Per evaluation (after each epoch): step, learning rate, test accuracy, the epoch's
    bits per value over every rank, and training seconds counted as steps x the run's
    median step time (robust to the odd step slowed by another job on a shared machine)."""
    with open(log_dir / "metrics.csv", newline="") as f:
        steps = [float(r["step_s"]) for r in csv.DictReader(f)]
    median_step = statistics.median(steps) if steps else 0.0
    with open(log_dir / "epochs.csv", newline="") as f:
        return [
            {
                "step": int(r["step"]),
                "epoch": int(r["epoch"]),
                "lr": float(r["lr"]),
                "acc": float(r["test_acc"]),
                "bits_per_value": float(r["bits_per_value_ranks"]),
                "seconds": int(r["step"]) * median_step,
            }
            for r in csv.DictReader(f)
        ]


def train_command(method: str, seed: int, args, log_dir: Path) -> list[str]:
    py = sys.executable
    flags = [
        *METHODS[method].train_flags(), "--epochs", str(args.epochs), "--seed", str(seed),
        "--lr-schedule", args.lr_schedule, "--log-dir", str(log_dir), "--no-progress",
    ]  # fmt: skip
    if args.milestones is not None:
        flags += ["--milestones", args.milestones]
    flags += args.train_args
    script = [py, str(ROOT / "scripts" / "train.py"), *flags]
    if args.real:
        horovodrun = str(Path(py).parent / "horovodrun")
        return [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", *script]
    return [*script, "--simulate-ranks", str(args.np)]


def run_one(method: str, seed: int, args, out: Path) -> dict:
    log_dir = out / method / f"seed{seed}"
    log_file = out / method / f"seed{seed}.log"
    if not args.fresh and log_file.is_file():
        summary = parse_summary(log_file.read_text(errors="replace"))
        if summary is not None and (log_dir / "epochs.csv").is_file():
            print(f"bench_accuracy: reusing {log_file}", flush=True)
            return {"method": method, "seed": seed, **summary, "curve": read_curve(log_dir),
                    "wall_s": None}  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = train_command(method, seed, args, log_dir)
    env = launch.root_env()
    print(f"bench_accuracy: {method} seed {seed}: {' '.join(cmd)}", flush=True)
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
        f"bits/value {summary['bits_per_value_ranks']:.4f} ({wall:.0f} s)",
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
                "about": METHODS[m].about,
                "seeds": len(rs),
                **{f"acc_{k}": v for k, v in stats.spread(accs).items()},
                "bits_per_value": statistics.fmean(r["bits_per_value_ranks"] for r in rs),
                "train_s": statistics.fmean(r["curve"][-1]["seconds"] for r in rs),
            }
        )
    base = next((r for r in rows if r["method"] == "none"), None)
    for r in rows:
        r["fewer_bits"] = base["bits_per_value"] / r["bits_per_value"] if base else None
        r["acc_vs_none"] = r["acc_mean"] - base["acc_mean"] if base else None
    return rows


def targets(rows: list[dict]) -> list[str]:
    """The issue-12 targets, checked against the table (those whose methods ran)."""
    by = {r["method"]: r for r in rows}
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'met' if ok else 'NOT met'}: {text}")

    if {"none", "3lc"} <= set(by):
        gap = by["3lc"]["acc_mean"] - by["none"]["acc_mean"]
        line(gap >= -0.15, f"3lc s=1.0 within 0.15 points of none: {gap:+.2f}")
    if {"accordion-3lc", "3lc"} <= set(by):
        acc, low = by["accordion-3lc"], by["3lc"]
        gap = acc["acc_mean"] - low["acc_mean"]
        fewer = low["bits_per_value"] / acc["bits_per_value"]
        line(
            gap >= -0.2 and fewer >= 1.4,
            f"Accordion(1.0, 1.75) within 0.2 points of always-s=1.0 ({gap:+.2f}) with at "
            f"least 1.4x fewer bits ({fewer:.2f}x)",
        )
    if {"dqsg", "ndqsg"} <= set(by):
        d, n = by["dqsg"], by["ndqsg"]
        fewer = 1.0 - n["bits_per_value"] / d["bits_per_value"]
        gap = n["acc_mean"] - d["acc_mean"]
        line(
            fewer >= 0.25 and abs(gap) <= 0.2,
            f"NDQSG at least 25% fewer bits than DQSG ({100 * fewer:.1f}%) and within 0.2 "
            f"points of it ({gap:+.2f})",
        )
    return out


def markdown(rows: list[dict], args, wall_s: float | None) -> str:
    world = f"{args.np} real ranks (horovodrun)" if args.real else f"{args.np} simulated ranks"
    milestones = args.milestones or "50% and 80% of the epochs"
    head = (
        f"{world}, Fashion-MNIST CNN, {args.epochs} epochs, lr schedule {args.lr_schedule}"
        f"{f' (x0.1 after {milestones})' if args.lr_schedule == 'step' else ''}, seeds "
        f"{' '.join(map(str, args.seeds))}; accuracy in %, mean ± std (min-max) over seeds; "
        "bits per value: mean over ranks and over the run\n\n"
    )
    cells = []
    for r in rows:
        vs = "" if r["acc_vs_none"] is None else f"{r['acc_vs_none']:+.2f}"
        fewer = "" if r["fewer_bits"] is None else f"{r['fewer_bits']:.1f}x"
        accuracy = (
            f"{r['acc_mean']:.2f} ± {r['acc_std']:.2f} ({r['acc_min']:.2f}-{r['acc_max']:.2f})"
        )
        cells.append([r["method"], accuracy, vs, f"{r['bits_per_value']:.3f}", fewer,
                      f"{r['train_s']:.0f}"])  # fmt: skip
    columns = ["method", "test accuracy", "vs none (pts)", "bits/value",
               "fewer bits than none", "training s"]  # fmt: skip
    text = head + "\n".join(report.md_table(columns, cells)) + "\n"
    if args.train_args:
        text += f"\nMore train.py flags: {' '.join(args.train_args)}\n"
    checked = targets(rows)
    if checked:
        text += "\nTargets (issue 12):\n\n" + "\n".join(checked) + "\n"
    if wall_s is not None:
        text += f"\nWall-clock of the runs made by this invocation: {wall_s / 60:.1f} min\n"
    return text


def _lr_drops(run: dict) -> list[int]:
    """Epochs (1-based, the x of the per-epoch plots) after which the rate had dropped."""
    curve = run["curve"]
    return [b["epoch"] + 1 for a, b in zip(curve, curve[1:], strict=False) if b["lr"] < a["lr"]]


def plot(runs: list[dict], methods: list[str], out: Path) -> list[Path]:
    plt = report.pyplot()
    paths = []
    for key, ylabel, fname in (
        ("acc", "test accuracy, % (mean ± std over seeds)", "accuracy_per_epoch.png"),
        (
            "bits_per_value",
            "bits per value (mean over ranks, seeds)",
            "bits_per_value_per_epoch.png",
        ),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        scale = 100.0 if key == "acc" else 1.0
        drops: set[int] = set()
        for m in methods:
            rs = [r for r in runs if r["method"] == m]
            if not rs:
                continue
            drops.update(_lr_drops(rs[0]))
            n = min(len(r["curve"]) for r in rs)
            xs = [rs[0]["curve"][i]["epoch"] + 1 for i in range(n)]
            per = [[scale * r["curve"][i][key] for r in rs] for i in range(n)]
            ys = [statistics.fmean(v) for v in per]
            err = [stats.stdev(v) for v in per]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=m)
        for x in sorted(drops):
            ax.axvline(x - 0.5, color="grey", ls="--", lw=0.8)
        if key == "bits_per_value":
            ax.set_yscale("log")
        ax.set_xlabel("epoch (dashed: learning-rate drops)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(report.save_figure(fig, out / fname))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        rs = [r for r in runs if r["method"] == m]
        if rs:
            bits = statistics.fmean(r["bits_per_value_ranks"] for r in rs)
            accs = [100 * r["test_accuracy"] for r in rs]
            err = stats.stdev(accs)
            ax.errorbar([bits], [statistics.fmean(accs)], yerr=[err], marker="o", capsize=3,
                        label=m)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("bits per value (mean over ranks and the run)")
    ax.set_ylabel("final test accuracy, % (mean ± std over seeds)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(report.save_figure(fig, out / "accuracy_vs_bits.png"))
    return paths


def plot_policies(runs: list[dict], methods: list[str], out: Path) -> list[Path]:
    """scripts/plot_policy.py on the first seed of every method with a policy."""
    paths = []
    for m in methods:
        rs = sorted((r for r in runs if r["method"] == m), key=lambda r: r["seed"])
        if METHODS[m].policy is None or not rs:
            continue
        log_dir = out / m / f"seed{rs[0]['seed']}"
        target = out / f"{m}_policy.png"
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "plot_policy.py"), str(log_dir), "-o",
             str(target)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        paths.append(target)
    return paths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=sorted(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr-schedule", choices=["constant", "step", "cosine"], default="step")
    p.add_argument("--milestones", default=None, help="train.py --milestones (default: its own)")
    p.add_argument("--np", type=int, default=4, help="ranks")
    p.add_argument("--real", action="store_true", help="real ranks: horovodrun -np N")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "accuracy")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per run")
    p.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    p.add_argument(
        "--train-args", nargs=argparse.REMAINDER, default=[], help="more train.py flags (last)"
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = [run_one(m, s, args, args.out) for m in args.methods for s in args.seeds]
    made = [r["wall_s"] for r in runs if r["wall_s"] is not None]
    wall = sum(made) if made else None
    rows = aggregate(runs, args.methods)
    table = markdown(rows, args, wall)
    print(table)
    (args.out / "bench_accuracy.md").write_text(table)
    record = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
        "targets": targets(rows),
        "runs": runs,
    }
    report.write_json(args.out / "bench_accuracy.json", record, indent=1)
    for path in [*plot(runs, args.methods, args.out), *plot_policies(runs, args.methods, args.out)]:
        print(f"bench_accuracy: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
