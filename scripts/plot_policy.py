#!/usr/bin/env python
"""Plot a policy's choices over training next to the loss curve (PNG).

    python scripts/plot_policy.py LOG_DIR [-o policy.png]

Reads ``LOG_DIR/metrics.csv`` (step, loss, ...) and ``LOG_DIR/policy.csv`` (step, key,
value) written by ``scripts/train.py --log-dir LOG_DIR --accordion ...`` or ``--cat ...``:
top panel the training loss with the learning rate (right axis, log scale; from the
``lr`` column, when the run logged one), middle panel the level in force per tensor
(Accordion, ``level/<tensor>``) or the chosen budget T per tensor (CAT, ``T/<tensor>``,
log scale), bottom panel (CAT only) the modelled vs measured communication cost per
step, or (Accordion, when train.py wrote ``accordion.json``) the norm-change trace: per
tensor and interval end, |n_prev - n_cur| / n_prev of the gradient norms averaged over
ranks, against eta (at or above eta: critical, low compression).
Dashed vertical lines mark the steps where the learning rate dropped: Accordion returns
to its low-compression level after each (its critical regime).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path


def read_series(log_dir: Path):
    """((steps, losses, rates or None), {key: (steps, values)}) of a training log."""
    loss_steps, losses, rates = [], [], []
    with open(log_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            loss_steps.append(int(row["step"]))
            losses.append(float(row["loss"]))
            if row.get("lr"):
                rates.append(float(row["lr"]))
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    with open(log_dir / "policy.csv", newline="") as f:
        for row in csv.DictReader(f):
            xs, ys = series[row["key"]]
            xs.append(int(row["step"]))
            ys.append(float(row["value"]))
    return (loss_steps, losses, rates if len(rates) == len(losses) else None), dict(series)


def norm_changes(trace: dict) -> dict[str, tuple[list[int], list[float]]]:
    """Per tensor, (steps, |n_prev - n_cur| / n_prev) at each interval end that had a
    previous one (Accordion's criterion; a zero previous norm is left out)."""
    out: dict[str, tuple[list[int], list[float]]] = {n: ([], []) for n in trace["names"]}
    prev = None
    for decision in trace["decisions"]:
        cur = decision["norms"]
        if cur is None:  # a decision at the first gradient after a rate drop: no norms
            continue
        if prev is not None:
            for name, p, c in zip(trace["names"], prev, cur, strict=True):
                if p > 0:
                    out[name][0].append(decision["step"])
                    out[name][1].append(abs(p - c) / p)
        prev = cur
    return out


def lr_drops(steps: list[int], rates: list[float]) -> list[int]:
    """The first step run at each lower rate."""
    return [s for s, a, b in zip(steps[1:], rates, rates[1:], strict=False) if b < a]


def plot(log_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (loss_steps, losses, rates), series = read_series(log_dir)
    levels = {k: v for k, v in series.items() if k.startswith(("level/", "T/"))}
    costs = {k: v for k, v in series.items() if k.startswith("cat/")}
    trace_path = log_dir / "accordion.json"
    trace = json.loads(trace_path.read_text()) if trace_path.is_file() else None
    panels = 2 + bool(costs or trace)
    fig, axes = plt.subplots(panels, 1, sharex=True, figsize=(9, 2.8 * panels))
    axes[0].plot(loss_steps, losses, lw=1)
    axes[0].set_ylabel("training loss")
    if rates:
        lr_axis = axes[0].twinx()
        lr_axis.plot(loss_steps, rates, color="tab:red", lw=1)
        lr_axis.set_yscale("log")
        lr_axis.set_ylabel("learning rate", color="tab:red")
        for step in lr_drops(loss_steps, rates):
            for ax in axes:
                ax.axvline(step, color="grey", ls="--", lw=0.8)
    for key, (xs, ys) in sorted(levels.items()):
        axes[1].step(xs, ys, where="post", lw=1, label=key.split("/", 1)[1])
    is_cat = any(k.startswith("T/") for k in levels)
    axes[1].set_ylabel("budget T" if is_cat else "level in force")
    if is_cat:
        axes[1].set_yscale("log")
    if 0 < len(levels) <= 12:
        axes[1].legend(fontsize=7, ncol=2)
    if costs:
        for key, (xs, ys) in sorted(costs.items()):
            axes[2].plot(xs, ys, lw=1, label=key.split("/", 1)[1])
        axes[2].set_ylabel("seconds per step")
        axes[2].legend(fontsize=7)
    elif trace:
        for name, (xs, ys) in sorted(norm_changes(trace).items()):  # colours as above
            axes[2].plot(xs, ys, marker=".", lw=0.8, label=name)
        axes[2].axhline(trace["eta"], color="black", lw=1, label=f"eta {trace['eta']:g}")
        axes[2].set_yscale("log")
        axes[2].set_ylabel("norm change per interval")
        axes[2].legend(fontsize=7, ncol=2)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("log_dir", type=Path)
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="PNG (default LOG_DIR/policy.png)"
    )
    args = p.parse_args(argv)
    for name in ("metrics.csv", "policy.csv"):
        if not (args.log_dir / name).is_file():
            raise SystemExit(
                f"{args.log_dir / name} is missing: run scripts/train.py with "
                "--log-dir and --accordion or --cat"
            )
    out = plot(args.log_dir, args.output or args.log_dir / "policy.png")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
