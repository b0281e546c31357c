#!/usr/bin/env python
"""One cell of the time-to-accuracy matrix run end to end: the training job itself on an
emulated link, its measured time to the target against the estimate of
scripts/bench_tta.py (accuracy runs x bench_peers' step times). Run as root:

    python scripts/bench_e2e.py run --model cnn --rates 100mbit \
        --methods hvdc-dqsg-allgather torch-powersgd-r4
    python scripts/bench_e2e.py report --write   # the table into the time-to-accuracy page

``run`` trains each (rate, method) once: train.py with the matrix's recipe for the model
and method (``bench_tta.train_command``, seed 1), on 4 torchrun ranks (an ``hvdc-``
method through hvdcompress's DDP hook, not the simulated world), inside a network
namespace whose loopback has the rate (tc tbf, scripts/_bench/netns.py; the namespace and
every process in it are removed afterwards, also on a kill). It stops one epoch after the
one where the matrix's run of that seed reached the target (``--until-epoch``: the
learning-rate schedule still spans the whole job), or at the end of the job. One JSON line
a finished cell in the results file (default docs/results/e2e_cells.jsonl): the curve with,
at each evaluation, the training seconds so far (the sum of rank 0's step times: forward,
backward, the hook's exchange and the optimizer; evaluation and logging left out), the
job's wall-clock and the load. A cell already there is skipped; a job is killed after
``--job-minutes``.

``report`` puts each cell beside its estimate: the steps to the target of its own curve and
of the matrix's seed-1 run, its median step time against bench_peers' row (the median of
its launches, with their range), its time to the target against the estimate
(``tta_report.rows`` on the same files as ``bench_tta.py report``: the mean curve over
seeds) and against the seed-1 estimate; within ``AGREE`` (15%) is agreement.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

try:  # python scripts/bench_e2e.py: scripts/ is first on sys.path
    import bench_tta
    from _bench import launch, netns, tta, tta_report
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts import bench_tta
    from scripts._bench import launch, netns, tta, tta_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "e2e_cells.jsonl"
# report --write: the table into this page, between ``<!-- e2e:begin -->`` and the end marker
E2E_BLOCK = re.compile(r"(<!-- e2e:begin -->\n).*?(<!-- e2e:end -->)", re.S)
PREFIX = "hvdc-e2e-"
SEED = 1
AGREE = 0.15  # a measured time within 15% of the estimate agrees with it


def cell_key(model: str, method: str, rate: str) -> str:
    return f"{model}/{method}/{rate}"


def until_epoch(records: dict, model: str, method: str) -> int:
    """One epoch past the one where the matrix's seed-1 run reached the target (the job's
    last epoch where it did not, or has no run)."""
    last = bench_tta.MODEL_EPOCHS[model]
    run = records.get(tta.job_key(model, method, SEED))
    goal = tta.target(records, model)
    if run is None or goal is None:
        return last
    reached = next((p["epoch"] for p in run["curve"] if p["acc"] >= goal), None)
    return last if reached is None else min(last, reached + 2)  # epochs count from 0


def step_walls(log_dir: Path) -> dict[int, float]:
    """Rank 0's wall-clock at each step's log (the ``train/loss`` events train.py writes to
    TensorBoard after every step, stamped with ``time.time()``); none where the run wrote
    no such events (TensorBoard missing): the cell then counts the sum of its step times."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import (
            SCALARS,
            EventAccumulator,
        )
    except ImportError:
        return {}
    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    events.Reload()
    if "train/loss" not in events.Tags().get("scalars", []):
        return {}
    return {e.step: e.wall_time for e in events.Scalars("train/loss")}


def training_wall(walls: dict[int, float], evaluations: list[int]) -> dict[int, float]:
    """Per evaluation step, the job's training wall-clock up to it: from the first step's
    log to that step's, plus the first step (one median interval), less every evaluation so
    far (an evaluation runs between its step and the step's log: its interval's excess over
    the median interval of the steps without one)."""
    steps = sorted(walls)
    gaps = {s: walls[s] - walls[p] for p, s in zip(steps, steps[1:], strict=False)}
    plain = [g for s, g in gaps.items() if s not in evaluations]
    step_gap = statistics.median(plain) if plain else 0.0
    out, evaluating = {}, 0.0
    for k in sorted(evaluations):
        if k not in walls:
            continue
        evaluating += max(0.0, gaps.get(k, step_gap) - step_gap)
        out[k] = walls[k] - walls[steps[0]] + step_gap - evaluating
    return out


def timed_curve(log_dir: Path, walls: dict[int, float] | None = None) -> list[dict]:
    """Per evaluation: epoch, step, test accuracy, the training seconds up to it as the sum
    of rank 0's step times (metrics.csv: forward, backward, the exchange, the optimizer) and
    as wall-clock (``training_wall`` of ``walls``, rank 0's step logs: everything the job
    did between steps too, evaluations out)."""
    with open(log_dir / "metrics.csv", newline="") as f:
        step_s = [float(r["step_s"]) for r in csv.DictReader(f)]
    with open(log_dir / "epochs.csv", newline="") as f:
        evaluations = list(csv.DictReader(f))
    wall = training_wall(walls or {}, [int(r["step"]) for r in evaluations])
    return [
        {"epoch": int(r["epoch"]), "step": int(r["step"]), "acc": float(r["test_acc"]),
         "train_s": sum(step_s[: int(r["step"])]), "wall_s": wall.get(int(r["step"]))}
        for r in evaluations
    ]  # fmt: skip


def run_cell(model: str, method: str, rate: str, ns: str, until: int, timeout_s: float) -> dict:
    """Train one cell inside the namespace ``ns`` at ``rate``; its record."""
    netns.sh("ip", "netns", "exec", ns, *netns.tc_rate_command(rate), check=False)
    with tempfile.TemporaryDirectory(prefix="hvdc-e2e-") as tmp:
        log_dir = Path(tmp)
        cmd = bench_tta.train_command(model, method, SEED, log_dir, real_ranks=True)
        cmd += ["--until-epoch", str(until)]
        record = {
            "model": model, "method": method, "rate": rate, "seed": SEED, "until_epoch": until,
            "ranks": bench_tta.RANKS, "load_avg_start": os.getloadavg()[0],
            "command": " ".join(Path(c).name if i < 2 else c for i, c in enumerate(cmd)),
        }  # fmt: skip
        t0 = time.perf_counter()
        try:
            done = subprocess.run(
                ["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True,
                timeout=timeout_s, env=launch.root_env(OMP_NUM_THREADS="1"), cwd=ROOT,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            netns.ns_kill(ns)
            return {**record, "status": "timeout", "wall_s": time.perf_counter() - t0}
        record["wall_s"] = time.perf_counter() - t0
        record["load_avg_end"] = os.getloadavg()[0]
        if done.returncode != 0 or not (log_dir / "epochs.csv").is_file():
            tail = (done.stdout + done.stderr)[-1500:]
            return {**record, "status": "failed", "returncode": done.returncode, "tail": tail}
        return {**record, "status": "ok", "curve": timed_curve(log_dir, step_walls(log_dir))}


def run(args) -> int:
    reason = netns.netns_available()
    if reason:
        print(f"bench_e2e: {reason}", file=sys.stderr)
        return 2
    netns.cleanup_stale(PREFIX, Path(__file__).name)
    records = tta.load_results(bench_tta.RESULTS)
    done = _load(args.results)
    cells = [(r, m) for r in args.rates for m in args.methods
             if done.get(cell_key(args.model, m, r), {}).get("status") != "ok"]  # fmt: skip
    ns = f"{PREFIX}{os.getpid()}"

    def body() -> None:
        for rate, method in cells:
            until = args.until_epoch or until_epoch(records, args.model, method)
            print(f"bench_e2e: {args.model} {method} at {rate}, epochs 1-{until} ...", flush=True)
            record = run_cell(args.model, method, rate, ns, until, 60 * args.job_minutes)
            record["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
            tta.append_result(args.results, record)
            print(f"bench_e2e:   {record['status']} in {record['wall_s']:.0f} s", flush=True)

    interrupted = netns.in_namespace(ns, PREFIX, body)
    return 1 if interrupted else 0


def _load(path: Path) -> dict[str, dict]:
    """The cells of the results file by key (a later line wins; a cut line is skipped)."""
    return {
        cell_key(r["model"], r["method"], r["rate"]): r
        for r in tta.read_records(path, frozenset({"model", "method", "rate"}))
    }


def compare(
    cell: dict, records: dict, peers: dict, matrix: tta_report.Matrix | None = None
) -> dict:  # fmt: skip
    """A finished cell against its estimates: the steps to the target and the training
    time to it measured (its wall-clock with evaluations out where the cell has it, else
    the sum of its step times; ``sum_s``: that sum), the estimate's (mean curve,
    ``tta_report.rows``) and the seed-1 run's steps at bench_peers' step time (with its
    lead: tuning, warm-up), and the ratios measured / estimate. ``matrix``: the report's
    rows (default ``bench_tta.matrix()``)."""
    model, method, rate = cell["model"], cell["method"], cell["rate"]
    goal = tta.target(records, model)
    reached = next((p for p in cell["curve"] if goal is not None and p["acc"] >= goal), None)
    only = dataclasses.replace(matrix or bench_tta.matrix(), methods=(method,))
    row = next(iter(tta_report.rows(records, peers, model, only)), None)
    seed_run = records.get(tta.job_key(model, method, SEED))
    seed_steps = None
    if seed_run is not None and goal is not None:
        seed_steps = tta.steps_to([(p["step"], p["acc"]) for p in seed_run["curve"]], goal)
    estimate = row["seconds"][rate] if row else None
    seed_estimate = None
    if row and row["step_s"][rate] is not None:
        seed_estimate = tta.time_to(seed_steps, row["step_s"][rate], row["lead"][rate])
    last = cell["curve"][-1]

    def seconds(point: dict) -> float:
        return point["train_s"] if point.get("wall_s") is None else point["wall_s"]

    measured = None if reached is None else seconds(reached)
    return {
        "model": model, "method": method, "rate": rate, "target": goal,
        "steps": None if reached is None else reached["step"],
        "seconds": measured, "sum_s": None if reached is None else reached["train_s"],
        "step_s": seconds(last) / last["step"],
        "bench_step_s": row["step_s"][rate] if row else None,
        "estimate_steps": row["steps"] if row else None, "estimate_s": estimate,
        "seed_steps": seed_steps, "seed_estimate_s": seed_estimate,
        "ratio": None if measured is None or not estimate else measured / estimate,
        "seed_ratio": None if measured is None or not seed_estimate else measured / seed_estimate,
        "wall_s": cell["wall_s"], "load": (cell["load_avg_start"], cell.get("load_avg_end")),
    }  # fmt: skip


def _fmt(x, spec: str = ".0f", none: str = "-") -> str:
    return none if x is None else f"{x:{spec}}"


def report(args) -> str:
    records = tta.load_results(bench_tta.RESULTS)
    peers = bench_tta.merge_peers(args.peers)
    lines = [
        "| model | rate | method | steps to target (e2e / estimate / seed 1) | s a step (e2e "
        "/ bench) | time to target, s (e2e; its steps' sum) | estimate, s | e2e / estimate "
        "| seed-1 estimate, s | e2e / seed-1 estimate | job wall-clock, s | load (start, end) |",
        "|---" * 12 + "|",
    ]  # fmt: skip
    matrix = bench_tta.matrix()
    for cell in _load(args.results).values():
        if cell.get("status") != "ok":
            continue
        c = compare(cell, records, peers, matrix)
        agree = "" if c["ratio"] is None else " ✓" if abs(c["ratio"] - 1) <= AGREE else " ✗"
        lines.append(
            f"| {c['model']} | {c['rate']} | {c['method']} | "
            f"{_fmt(c['steps'], 'd', none='not reached')} / {_fmt(c['estimate_steps'], 'd')} / "
            f"{_fmt(c['seed_steps'], 'd')} | "
            f"{c['step_s']:.3f} / {_fmt(c['bench_step_s'], '.3f')} | "
            f"{_fmt(c['seconds'])}; {_fmt(c['sum_s'])} | {_fmt(c['estimate_s'])} | "
            f"{_fmt(c['ratio'], '.2f')}{agree} | {_fmt(c['seed_estimate_s'])} | "
            f"{_fmt(c['seed_ratio'], '.2f')} | {c['wall_s']:.0f} | "
            f"{c['load'][0]:.1f}, {_fmt(c['load'][1], '.1f')} |"
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="train the cells not yet in the results file")
    run_p.add_argument("--model", choices=bench_tta.MODELS, default="cnn")
    run_p.add_argument("--rates", nargs="+", type=netns.rate_arg, default=["100mbit", "1gbit"])
    run_p.add_argument("--methods", nargs="+", required=True,
                       choices=[*bench_tta.TORCH_METHODS, *bench_tta.HVDC_METHODS])  # fmt: skip
    run_p.add_argument("--job-minutes", type=float, default=15.0, help="kill a job after")
    run_p.add_argument(
        "--until-epoch", type=int, help="stop after this epoch (a trial of the set-up)"
    )
    rep = sub.add_parser("report", help="each cell against its estimate")
    rep.add_argument("--peers", type=Path, nargs="+", default=bench_tta.PEERS)
    rep.add_argument(
        "--write", action="store_true",
        help="rewrite the table in docs/benchmarks-time-to-accuracy.md's e2e block",
    )  # fmt: skip
    for p in (run_p, rep):
        p.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.command == "run":
        return run(args)
    text = report(args)
    if args.write:
        tta_report.rewrite_block(bench_tta.TTA_PAGE, E2E_BLOCK, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
