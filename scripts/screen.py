#!/usr/bin/env python
"""Screening of issue 61's candidates: short, resumable jobs against DDP's curve, on the
ViT (the hardest case, the default) or, with ``--model``, the CNN or the 10 M MLP.

    python scripts/screen.py run --methods 3lc-block-allgather --until 3   # a ViT screen
    python scripts/screen.py run --methods 3lc-block-allgather --until 10  # go on to 10
    python scripts/screen.py run --model cnn --methods 3lc-allgather --until 10
    python scripts/screen.py report [--model cnn]     # docs/screening.md's tables

A job is one method of hvdcompress.training.methods.METHODS (reachable by name: its
``train_flags()``) on the time-to-accuracy matrix's recipe for the model
(scripts/bench_tta.py: ``--model M --epochs E --lr-schedule step --threads 1
--simulate-ranks 4``, E 10 for the ViT and the CNN, 5 for the MLP), stopped after
``--until`` epochs (``--until-epoch``: the learning-rate schedule still spans E epochs, so
epoch e is comparable with DDP's epoch e). It runs in pieces of at most
``--piece`` epochs, each a train.py run killed after ``--job-minutes`` (15), each going
on from the last one's checkpoint in ``.tta_work/screen/<model>-<method>-seed<seed>``
(the ViT's without ``<model>-``), which is kept: a screened method continues to the
model's last epoch without running its first epochs again.
One JSON line per finished job is appended to ``docs/results/screening_<model>.jsonl``
(method, its parameters, seed, epochs, the per-epoch curve with each epoch's bits per
value, the run's mean bits per value as train.py counts them on the wire, headers
included, wall_s, the commands); a (method, seed, epochs) already there is skipped.
``--commit`` commits the results file after each job (that file only).

``report`` prints the markdown table of every screened job of a model next to DDP's 3-seed
mean and the matrix's reference rows of docs/results/accuracy_jobs.jsonl, and a mean row
for a candidate run to the end on two or more seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_tta import MODEL_EPOCHS as EPOCHS  # noqa: E402  (the matrix's recipe)

from hvdcompress.training.methods import METHODS  # noqa: E402

# $SCREEN_RESULTS: the results directory of another checkout (a job may run from a
# snapshot of the tree, so that edits to the checkout while it trains do not reach it)
RESULTS_DIR = Path(os.environ.get("SCREEN_RESULTS", ROOT / "docs" / "results"))
MATRIX = ROOT / "docs" / "results" / "accuracy_jobs.jsonl"
WORK = ROOT / ".tta_work" / "screen"  # ignored by git, as bench_tta.py's work
COLUMNS = {"cnn": (1, 2, 3, 5, 6, 10), "vit": (1, 2, 3, 5, 6, 10), "mlp10m": (1, 2, 3, 4, 5)}
RANKS = 4


def results_file(model: str) -> Path:
    return RESULTS_DIR / f"screening_{model}.jsonl"


def job_dir(model: str, name: str, seed: int) -> Path:
    # the ViT's jobs keep the names they had when it was the only model screened
    return WORK / (f"{name}-seed{seed}" if model == "vit" else f"{model}-{name}-seed{seed}")


def method_params(name: str) -> dict:
    m = METHODS[name]
    return {
        "compression": m.compression, "params": dict(m.params), "policy": m.policy,
        "policy_params": dict(m.policy_params), "compress_min_numel": m.compress_min_numel,
        "exchange": m.exchange,
    }  # fmt: skip


def train_command(model: str, name: str, seed: int, until: int, job: Path) -> list[str]:
    flags = [
        "--model", model, "--epochs", str(EPOCHS[model]), "--seed", str(seed),
        "--lr-schedule", "step",
        "--log-dir", str(job / "logs"), "--no-progress", "--threads", "1",
        "--until-epoch", str(until), "--checkpoint", str(job / "checkpoint"),
    ]  # fmt: skip
    if any((job / "checkpoint").glob("*")):
        flags.append("--resume")
    script = str(ROOT / "scripts" / "train.py")
    return [sys.executable, script, *METHODS[name].train_flags(), *flags,
            "--simulate-ranks", str(RANKS)]  # fmt: skip


def read_epochs(log_dir: Path) -> list[dict]:
    with open(log_dir / "epochs.csv", newline="") as f:
        rows = [
            {"epoch": int(r["epoch"]) + 1, "step": int(r["step"]), "acc": float(r["test_acc"]),
             "bits_per_value": float(r["bits_per_value_ranks"])}
            for r in csv.DictReader(f)
        ]  # fmt: skip
    by_epoch = {r["epoch"]: r for r in rows}  # a resumed piece may repeat an evaluation
    return [by_epoch[e] for e in sorted(by_epoch)]


def load_results(model: str) -> list[dict]:
    path = results_file(model)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done(model: str, name: str, seed: int, until: int) -> bool:
    return any(
        r["method"] == name and r["seed"] == seed and r["epochs"] == until and r["status"] == "ok"
        for r in load_results(model)
    )


def epochs_done(job: Path) -> int:
    progress = job / "progress.json"
    return json.loads(progress.read_text())["epochs_done"] if progress.is_file() else 0


def run_job(model: str, name: str, seed: int, until: int, piece: int, timeout_s: float) -> dict:
    job = job_dir(model, name, seed)
    (job / "checkpoint").mkdir(parents=True, exist_ok=True)
    progress_file = job / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else {}
    wall, commands = progress.get("wall_s", 0.0), progress.get("commands", [])
    if progress.get("epochs_done", 0) == 0:  # what a killed first piece left
        for f in (job / "checkpoint").glob("*"):
            f.unlink()
        for f in (job / "logs").glob("*") if (job / "logs").is_dir() else ():
            f.unlink()
    status = "ok"
    while epochs_done(job) < until:
        stop = min(epochs_done(job) + piece, until)
        cmd = train_command(model, name, seed, stop, job)
        print(f"screen: {model} {name} seed {seed} epochs {epochs_done(job)}..{stop}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        except subprocess.TimeoutExpired:
            wall += time.perf_counter() - t0
            status, tail = "timeout", ""
            break
        wall += time.perf_counter() - t0
        commands.append(" ".join(Path(c).name if i < 2 else c for i, c in enumerate(cmd)))
        if proc.returncode != 0:
            status = "failed"
            tail = f"returncode {proc.returncode}: " + (proc.stdout + proc.stderr)[-1500:]
            break
        progress = {"epochs_done": stop, "wall_s": wall, "commands": commands}
        tmp = progress_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(progress))
        os.replace(tmp, progress_file)
    record = {
        "model": model, "method": name, "params": method_params(name), "seed": seed,
        "epochs": until, "ranks": RANKS, "status": status, "wall_s": round(wall, 1),
        "command": commands[-1] if commands else "", "commands": commands,
    }  # fmt: skip
    if status != "ok":
        return {**record, "tail": tail}
    curve = [r for r in read_epochs(job / "logs") if r["epoch"] <= until]
    bits = sum(r["bits_per_value"] for r in curve) / len(curve)  # epochs of equal steps
    return {**record, "curve": curve, "bits_per_value": round(bits, 4)}


def append(record: dict, commit: bool) -> None:
    path = results_file(record["model"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
    if commit:  # in the repository that holds the results file, that file only
        rel = path.name
        accs = "/".join(f"{100 * c['acc']:.2f}" for c in record.get("curve", []))
        msg = (
            f"screening (issue 61): {record['model']} {record['method']} seed {record['seed']}, "
            f"{record['epochs']} epochs, {record['status']}"
            + (f": {accs} at {record['bits_per_value']:.3f} bits/value" if accs else "")
        )
        where = path.parent
        subprocess.run(["git", "add", rel], cwd=where, check=False)
        subprocess.run(["git", "commit", "-q", "-m", msg, "--", rel], cwd=where, check=False)


# ---- report ------------------------------------------------------------------------------
REFERENCES = (  # (accuracy_jobs.jsonl method, seeds, label)
    ("ddp", (1, 2, 3), "DDP, mean of seeds 1-3"),
    ("ddp", (1,), "DDP"),
    ("hvdc-3lc-allgather", (1, 2, 3), "3LC s=1.0, mean of seeds 1-3"),
    ("hvdc-3lc-allgather", (1,), "3LC s=1.0"),
    ("hvdc-accordion-3lc-allgather", (1,), "Accordion-3LC (1.0 / 1.75)"),
    ("hvdc-dqsg-allgather", (1, 2, 3), "DQSG 3 levels, mean of seeds 1-3"),
    ("hvdc-dqsg-allgather", (1,), "DQSG 3 levels"),
)


def reference_rows(model: str) -> list[tuple[str, list[float], float, str]]:
    """(label, mean accuracy per epoch, mean bits per value, seeds) of ``REFERENCES`` that
    the matrix has for ``model`` (DDP's mean first)."""
    rows = [json.loads(x) for x in MATRIX.read_text().splitlines() if x.strip()]
    ok = [r for r in rows if r.get("model") == model and r.get("status") == "ok"]
    out = []
    for method, seeds, label in REFERENCES:
        runs = [r for r in ok if r["method"] == method and r["seed"] in seeds]
        if len(runs) != len(seeds):
            continue
        n = min(len(r["curve"]) for r in runs)
        curve = [sum(r["curve"][e]["acc"] for r in runs) / len(runs) for e in range(n)]
        bits = sum(r["bits_per_value"] for r in runs) / len(runs)
        out.append((f"{label} (matrix)", curve, bits, ",".join(map(str, seeds))))
    return out


def report(model: str = "vit") -> str:
    """The markdown table of ``model``: accuracy after each epoch of its ``COLUMNS`` (in
    brackets: minus DDP's 3-seed mean), mean bits per value over the epochs run, seed,
    wall-clock."""
    columns, epochs = COLUMNS[model], EPOCHS[model]
    head = "| candidate | " + " | ".join(f"epoch {e}" for e in columns)
    lines = [head + " | bits/value | seed | epochs run | wall s |"]
    lines.append("|---" * (len(columns) + 5) + "|")
    refs = reference_rows(model)
    ddp = refs[0][1]
    for label, curve, bits, seeds in refs:
        accs = [f"{100 * curve[e - 1]:.2f}" if e <= len(curve) else "" for e in columns]
        lines.append(
            f"| {label} | " + " | ".join(accs) + f" | {bits:.3f} | {seeds} | {epochs} | - |"
        )
    best: dict[tuple[str, int], dict] = {}  # the longest run of each, in first-run order
    for r in load_results(model):
        if r["status"] == "ok":
            key = (r["method"], r["seed"])
            if key not in best or r["epochs"] > best[key]["epochs"]:
                best[key] = r
    for (name, seed), r in best.items():
        acc = {c["epoch"]: c["acc"] for c in r["curve"]}
        lines.append(
            f"| {name} | {_cells(acc, ddp, columns)} | {r['bits_per_value']:.3f} | {seed} | "
            f"{r['epochs']} | {r['wall_s']:.0f} |"
        )
    for name, runs in _seed_groups(best, epochs).items():  # run to the end on 2+ seeds
        acc = {e: sum(r["curve"][e - 1]["acc"] for r in runs) / len(runs) for e in columns}
        bits = sum(r["bits_per_value"] for r in runs) / len(runs)
        seeds = ",".join(str(r["seed"]) for r in runs)
        lines.append(
            f"| {name}, mean of seeds {seeds} | {_cells(acc, ddp, columns)} | {bits:.3f} | "
            f"{seeds} | {epochs} | - |"
        )
    return "\n".join(lines)


def _cells(acc: dict[int, float], ddp: list[float], columns) -> str:
    """Accuracy after each epoch of ``columns`` (where run), minus DDP's mean in brackets."""
    return " | ".join(
        f"{100 * acc[e]:.2f} ({100 * (acc[e] - ddp[e - 1]):+.2f})" if e in acc else ""
        for e in columns
    )


def _seed_groups(best: dict[tuple[str, int], dict], epochs: int) -> dict[str, list[dict]]:
    """method -> its runs of all ``epochs``, by seed, where there are two or more."""
    groups: dict[str, list[dict]] = {}
    for (name, _), r in sorted(best.items(), key=lambda kv: kv[0][1]):
        if r["epochs"] == epochs:
            groups.setdefault(name, []).append(r)
    return {name: runs for name, runs in groups.items() if len(runs) > 1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--model", choices=sorted(EPOCHS), default="vit")
    run.add_argument("--methods", nargs="+", required=True, choices=sorted(METHODS))
    run.add_argument("--seeds", nargs="+", type=int, default=[1])
    run.add_argument("--until", type=int, default=3, help="epochs (of the model's schedule)")
    run.add_argument("--piece", type=int, default=3, help="epochs per train.py run")
    run.add_argument("--job-minutes", type=float, default=15.0)
    run.add_argument("--commit", action="store_true", help="git commit the results file")
    rep = sub.add_parser("report")
    rep.add_argument("--model", choices=sorted(EPOCHS), default="vit")
    args = p.parse_args(argv)
    if args.cmd == "report":
        print(report(args.model))
        return 0
    if not 1 <= args.until <= EPOCHS[args.model]:
        p.error(f"--until must be in [1, {EPOCHS[args.model]}] for {args.model}")
    for seed in args.seeds:
        for name in args.methods:
            if done(args.model, name, seed, args.until):
                where = results_file(args.model).name
                print(f"screen: {name} seed {seed} {args.until} epochs: in {where}")
                continue
            record = run_job(args.model, name, seed, args.until, args.piece, 60 * args.job_minutes)
            append(record, args.commit)
            print(json.dumps({k: v for k, v in record.items() if k != "commands"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
