#!/usr/bin/env python
"""Plot a policy's choices over training next to the loss curve (PNG).

    python scripts/plot_policy.py LOG_DIR [-o policy.png]

Reads ``LOG_DIR/metrics.csv`` (step, loss, ...) and ``LOG_DIR/policy.csv`` (step, key,
value) written by ``scripts/train.py --log-dir LOG_DIR --accordion ...`` or ``--cat ...``:
top panel the training loss, middle panel the level in force per tensor (Accordion,
``level/<tensor>``) or the chosen budget T per tensor (CAT, ``T/<tensor>``, log scale),
bottom panel (CAT only) the modelled vs measured communication cost per step.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path


def read_series(log_dir: Path):
    loss_steps, losses = [], []
    with open(log_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            loss_steps.append(int(row["step"]))
            losses.append(float(row["loss"]))
    series: dict[str, tuple[list[int], list[float]]] = defaultdict(lambda: ([], []))
    with open(log_dir / "policy.csv", newline="") as f:
        for row in csv.DictReader(f):
            xs, ys = series[row["key"]]
            xs.append(int(row["step"]))
            ys.append(float(row["value"]))
    return (loss_steps, losses), dict(series)


def plot(log_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (loss_steps, losses), series = read_series(log_dir)
    levels = {k: v for k, v in series.items() if k.startswith(("level/", "T/"))}
    costs = {k: v for k, v in series.items() if k.startswith("cat/")}
    panels = 2 + bool(costs)
    fig, axes = plt.subplots(panels, 1, sharex=True, figsize=(9, 2.8 * panels))
    axes[0].plot(loss_steps, losses, lw=1)
    axes[0].set_ylabel("training loss")
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
