#!/usr/bin/env python
"""Time to accuracy: which method reaches the accuracy a user wants first, on their link.

    python scripts/bench_tta.py run --max-minutes 60          # more jobs of the matrix
    python scripts/bench_tta.py run --models cnn --methods ddp hvdc-3lc --seeds 1
    python scripts/bench_tta.py missing                        # what the matrix still lacks
    python scripts/bench_tta.py report --readme                # tables, plots, README

``run`` works through the matrix of (model, method, seed) jobs, each one 4-rank
scripts/train.py run (``hvdc-*``: the simulated world, ``--simulate-ranks 4``, which ends
with the parameters of the real 4-rank run; ``ddp`` and ``torch-*``: torchrun with 4 ranks
and torch's own communication, ``--torch-hook``; ``hvdc-3lc-tuned``, ``hvdc-dqsg-tuned``:
torchrun with 4 ranks and hvdcompress's hook, its tuner choosing each bucket's exchange,
16-bit dense included, on this machine's loopback), and appends one JSON line per finished
job to the results file (default docs/results/accuracy_jobs.jsonl, kept in the
repository): per-epoch test accuracy, steps, bits per value, wall-clock. A job already in
the file is skipped, so the matrix is completed over several sittings (``missing`` lists
what it lacks); ``--max-minutes`` stops starting jobs after that long; a job is killed
after ``--job-minutes`` (15) and recorded as ``timeout``; a killed driver loses only the
job in flight. The matrix's seeds: three on the CNN, one on the ViT and the MLP
(``MODEL_SEEDS``; ``--seeds 1 2 3`` adds more). Seeds go outer: every method's first
seed before any second seed. Several drivers may share the matrix
on one machine (a single-threaded simulated job leaves a core free): each takes the next
job no other driver holds (a lock per job in ``.tta_work/locks``).

``report`` joins the results with the step times of scripts/bench_peers.py (its JSON,
copied to docs/results/peer_steps_<model>.json, same models, rows and batch per rank; several
``--peers`` files merge, a later one's rows replacing an earlier one's, but never a row
timed on the training job by one that was not; by default docs/results/peer_steps*.json
in name order): per model
and link rate, the wall-clock each method needs to reach the target accuracy, the
baseline's (DDP allreduce) mean final accuracy minus 0.3 points (scripts/_bench/tta.py).
Writes docs/results/time_to_accuracy.md, docs/tta_<model>.png (test accuracy against
wall-clock, one panel per rate) and, with ``--readme``, every table into the block of
docs/benchmarks-time-to-accuracy.md between ``<!-- tta:begin -->`` and
``<!-- tta:end -->`` and the headline (per model and rate, hvdcompress's fastest row
against the fastest peer) into the README's between ``<!-- tta:headline:begin -->`` and
``<!-- tta:headline:end -->``; run again on the same data, it writes the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from hvdcompress.training.methods import FIXED_EXCHANGES
from hvdcompress.training.methods import METHODS as HVDC_TABLE

try:  # python scripts/bench_tta.py: scripts/ is first on sys.path
    from _bench import launch, tta, tta_report
    from bench_accuracy import parse_summary, read_curve
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import launch, tta, tta_report
    from scripts.bench_accuracy import parse_summary, read_curve

ROOT = Path(__file__).resolve().parents[1]
# report --readme: every table into this page, the headline table into the README
TTA_PAGE = ROOT / "docs" / "benchmarks-time-to-accuracy.md"
RESULTS = ROOT / "docs" / "results" / "accuracy_jobs.jsonl"
# bench_peers' step times (peer_steps_<what>.json), in name order: a later file's rows
# replace an earlier one's
PEERS = sorted((ROOT / "docs" / "results").glob("peer_steps*.json"))
RANKS = 4
MODELS = ("cnn", "vit", "mlp10m")
# each model's training recipe, the same for every method (only the communication
# differs): train.py's SGD (lr 0.05 x the compressor's declared factor, momentum 0.9),
# batch 64 per rank, the step schedule; epochs such that a job stays under 15 minutes
MODEL_EPOCHS = {"cnn": 10, "vit": 10, "mlp10m": 5}
# epochs per piece, for a model whose whole job runs past the 15-minute job limit: its job
# is several train.py runs (``--until-epoch``), each going on from the last one's
# checkpoint (``--resume``: the same parameters as one uninterrupted run), kept between
# pieces, and between sittings, in WORK
PIECE_EPOCHS = {"vit": 3, "mlp10m": 1}
# the matrix's seeds per model: three on the CNN, one on the two larger models, whose jobs
# take several times longer (``run --seeds 1 2 3`` adds seeds where time allows)
MODEL_SEEDS = {"cnn": (1, 2, 3), "vit": (1,), "mlp10m": (1,)}
WORK = ROOT / ".tta_work"
# torch's PowerSGD as its documentation recommends it: dense (a plain allreduce) for about
# the first 10% of training (``start_powerSGD_iter``), then compressed; the plain rows
# start compressing at step 2, the fewest torch allows
WARM_FRACTION = 0.1
STEPS_PER_EPOCH = 60_000 // (64 * RANKS)  # Fashion-MNIST's training set, batch 64 a rank
POWERSGD_RANKS = (1, 2, 4)
TORCH_WARM = tuple(f"torch-powersgd-r{k}-warm" for k in POWERSGD_RANKS)
# model -> method -> its dense first steps (train.py's ``--powersgd-start-iter``)
WARM_STEPS = {
    model: {m: round(WARM_FRACTION * epochs * STEPS_PER_EPOCH) for m in TORCH_WARM}
    for model, epochs in MODEL_EPOCHS.items()
}  # fmt: skip
# method -> the train.py flags of its communication (a warm one's start: WARM_STEPS)
TORCH_METHODS = {
    "ddp": ["--torch-hook", "allreduce"],
    "torch-bf16": ["--torch-hook", "bf16"],
    **{
        f"torch-powersgd-r{k}{warm}": ["--torch-hook", "powersgd", "--powersgd-rank", str(k)]
        for warm in ("", "-warm") for k in POWERSGD_RANKS
    },
}  # fmt: skip
HVDC_METHODS = (
    "hvdc-3lc", "hvdc-accordion-3lc", "hvdc-powersgd", "hvdc-powersgd-r2",
    "hvdc-dqsg-allgather",
)  # fmt: skip
METHODS = (*TORCH_METHODS, *HVDC_METHODS)  # the report's rows
# hvdcompress's DDP hook under torchrun, 4 real ranks over gloo, ``exchange="auto"`` with
# its tuner timing every option on this machine's loopback: the accuracy of what a tuner
# keeps, the 16-bit dense option among them (the simulated world cannot time a link)
TUNED_METHODS = {"hvdc-3lc-tuned": "3lc", "hvdc-dqsg-tuned": "dqsg"}
# a tuned method's accuracy runs on each compressed exchange its tuner may pick: the
# simulated world cannot time a link (its ``auto`` is not the tuner's pick on a real one),
# so these jobs fix the exchange, and per rate the report takes the runs on the exchange
# that bench_peers saw the tuner pick (tta_report.rows); the jobs are the methods table's
# fixed-exchange variants (``Method.on``, ``FIXED_EXCHANGES``) of the rows that tune
ON_EXCHANGE = {
    f"hvdc-{base}": {x: f"hvdc-{base}-{x}" for x in exchanges}
    for base, exchanges in FIXED_EXCHANGES.items() if f"hvdc-{base}" in HVDC_METHODS
}  # fmt: skip
# the matrix's jobs: the rows' methods, a tuned one's by its fixed-exchange runs instead
JOB_METHODS = (
    *(pinned for m in METHODS for pinned in ON_EXCHANGE.get(m, {m: m}).values()),
    *TUNED_METHODS,
)  # fmt: skip
# the bench_peers row whose step time a method takes where it has none of its own:
# Accordion switches 3LC between sparsity 1.0 and 1.75, and the DDP hook runs no policy
STEP_ROW = {"hvdc-accordion-3lc": "hvdc-3lc", **{m: m.removesuffix("-warm") for m in TORCH_WARM}}
# a fixed-exchange job -> (the bench_peers row whose tuner it stands for, its exchange)
FIXED = {
    pinned: (STEP_ROW.get(tuned, tuned), exchange)
    for tuned, on in ON_EXCHANGE.items() for exchange, pinned in on.items()
}  # fmt: skip


def train_command(
    model: str, method: str, seed: int, log_dir: Path, piece: tuple[int, Path] | None = None,
    real_ranks: bool = False,
) -> list[str]:  # fmt: skip
    """The job's command: train.py with the model's recipe and the method's communication;
    ``piece`` (the epoch to stop at, the checkpoint directory) runs a piece of it, going on
    from the checkpoint there when it holds one. ``real_ranks``: an ``hvdc-`` method on 4
    torchrun ranks with hvdcompress's DDP hook, not in the simulated world."""
    flags = [
        "--model", model, "--epochs", str(MODEL_EPOCHS[model]), "--seed", str(seed),
        "--lr-schedule", "step", "--log-dir", str(log_dir), "--no-progress", "--threads", "1",
    ]  # fmt: skip
    if piece is not None:
        until, checkpoint = piece
        flags += ["--until-epoch", str(until), "--checkpoint", str(checkpoint)]
        if any(checkpoint.glob("*")):
            flags.append("--resume")
    script = str(ROOT / "scripts" / "train.py")
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={RANKS}", script, "--launcher", "torchrun",
    ]  # fmt: skip
    if method in TORCH_METHODS:
        warm = WARM_STEPS[model].get(method)
        warm_flags = [] if warm is None else ["--powersgd-start-iter", str(warm)]
        return [*torchrun, *TORCH_METHODS[method], *warm_flags, *flags]
    if method in TUNED_METHODS:
        return [*torchrun, *HVDC_TABLE[TUNED_METHODS[method]].train_flags(), *flags]
    hvdc = HVDC_TABLE[method.removeprefix("hvdc-")]
    if real_ranks:
        return [*torchrun, *hvdc.train_flags(), *flags]
    return [sys.executable, script, *hvdc.train_flags(), *flags, "--simulate-ranks", str(RANKS)]


def _train(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess | None:
    """The finished train.py run, None when it was killed after ``timeout_s``."""
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=launch.root_env(),
            cwd=ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None


def _outcome(record: dict, done, log_dir: Path) -> dict:
    """The finished job's record from its last train.py run and its log directory."""
    summary = parse_summary(done.stdout + done.stderr)
    if done.returncode != 0 or summary is None or not (log_dir / "epochs.csv").is_file():
        tail = (done.stdout + done.stderr)[-1500:]
        return {**record, "status": "failed", "returncode": done.returncode, "tail": tail}
    curve = [{"epoch": c["epoch"], "step": c["step"], "acc": c["acc"]} for c in read_curve(log_dir)]
    return {
        **record, "status": "ok", "curve": curve, "steps": summary["steps"],
        "bits_per_value": summary["bits_per_value_ranks"],
        "param_digest": summary["param_digest"], "exchanges": summary["exchanges"],
    }  # fmt: skip


def _base_record(model: str, method: str, seed: int, cmd: list[str]) -> dict:
    return {
        "model": model, "method": method, "seed": seed, "ranks": RANKS,
        "command": " ".join(Path(c).name if i < 2 else c for i, c in enumerate(cmd)),
        "load_avg_start": os.getloadavg()[0],
    }  # fmt: skip


def run_job(model: str, method: str, seed: int, timeout_s: float, work: Path = WORK) -> dict:
    """Run one job, or its next piece (``PIECE_EPOCHS``); its record (``status``: ok,
    failed, timeout, or ``piece`` when more pieces are to come: not a result)."""
    if model in PIECE_EPOCHS:
        return run_piece(model, method, seed, timeout_s, work)
    with tempfile.TemporaryDirectory(prefix="hvdc-tta-") as tmp:
        log_dir = Path(tmp)
        cmd = train_command(model, method, seed, log_dir)
        record = _base_record(model, method, seed, cmd)
        t0 = time.perf_counter()
        done = _train(cmd, timeout_s)
        record["wall_s"] = time.perf_counter() - t0
        return {**record, "status": "timeout"} if done is None else _outcome(record, done, log_dir)


def run_piece(model: str, method: str, seed: int, timeout_s: float, work: Path) -> dict:
    """The job's next piece, in ``work/<job>`` (checkpoints, logs, ``progress.json``: the
    epochs done and the wall-clock of the pieces so far). The last piece's record is the
    job's, its ``wall_s`` the sum of the pieces'; the job's directory then goes."""
    job_dir = work / tta.job_key(model, method, seed).replace("/", "-")
    progress_file = job_dir / "progress.json"
    progress = {"epochs_done": 0, "wall_s": 0.0, "pieces": 0}
    if progress_file.is_file():
        progress = json.loads(progress_file.read_text())
    if progress["epochs_done"] == 0:  # what a first piece killed mid-way left
        shutil.rmtree(job_dir / "checkpoint", ignore_errors=True)
    (job_dir / "checkpoint").mkdir(parents=True, exist_ok=True)
    until = min(progress["epochs_done"] + PIECE_EPOCHS[model], MODEL_EPOCHS[model])
    log_dir = job_dir / "logs"
    cmd = train_command(model, method, seed, log_dir, (until, job_dir / "checkpoint"))
    record = _base_record(model, method, seed, cmd)
    t0 = time.perf_counter()
    done = _train(cmd, timeout_s)
    wall = time.perf_counter() - t0
    if done is None:  # the same piece runs again next time, from the same checkpoint
        return {**record, "status": "timeout", "wall_s": wall, "until_epoch": until}
    record = {**record, "wall_s": progress["wall_s"] + wall, "pieces": progress["pieces"] + 1}
    if done.returncode != 0:
        return _outcome(record, done, log_dir)
    if until < MODEL_EPOCHS[model]:
        progress = {"epochs_done": until, "wall_s": record["wall_s"], "pieces": record["pieces"]}
        tmp = progress_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(progress))
        os.replace(tmp, progress_file)  # a kill leaves the old progress or the new one
        return {**record, "status": "piece", "until_epoch": until}
    result = _outcome(record, done, log_dir)
    if result["status"] == "ok":
        shutil.rmtree(job_dir)
    return result


def plan(
    models, methods, seeds=None, peers: dict | None = None, records: dict | None = None
) -> list[tuple[str, str, int]]:  # fmt: skip
    """Seeds outer, then models, then methods: a half-done matrix has whole first seeds.
    ``seeds`` None: each model's ``MODEL_SEEDS``, and with ``records`` (the results so
    far) three seeds (``tta.SEEDS_NEAR_TARGET``) for a method whose mean final accuracy
    lies within ``tta.NEAR_TARGET`` of the target: one seed cannot say which side it is on.
    With ``peers`` (bench_peers' rows), a fixed-exchange job of a tuned method
    (``ON_EXCHANGE``) only where the tuner picked that exchange at some rate: no other
    step time goes with its curve (a model whose row has no step time yet: every job)."""
    timed: dict[tuple[str, str], set[str]] = {}  # (model, row) -> the exchanges it took
    for (model, row, _), r in tta.peer_rows(peers or {}).items():
        timed.setdefault((model, row), set()).update(r.get("exchanges") or [])

    def wanted(model: str, method: str) -> bool:
        if peers is None or method not in FIXED:
            return True
        row, exchange = FIXED[method]
        return (model, row) not in timed or exchange in timed[(model, row)]

    def seeds_of(model: str, method: str) -> tuple[int, ...]:
        if seeds is not None:
            return tuple(seeds)
        near = records is not None and tta.near_target(records, model, method)
        return tuple(sorted({*MODEL_SEEDS[model], *(tta.SEEDS_NEAR_TARGET if near else ())}))

    chosen = {(m, k): seeds_of(m, k) for m in models for k in methods if wanted(m, k)}
    every = sorted({s for picked in chosen.values() for s in picked})
    return [
        (m, k, s) for s in every for m in models for k in methods
        if (m, k) in chosen and s in chosen[(m, k)]
    ]  # fmt: skip


def missing(jobs, results: Path) -> list[tuple[str, str, int]]:
    """The jobs without a finished (ok) record in ``results``."""
    done = tta.load_results(results)
    return [j for j in jobs if done.get(tta.job_key(*j), {}).get("status") != "ok"]


@contextlib.contextmanager
def claimed(lock_dir: Path | None, key: str):
    """Hold the job ``key`` for this driver while the block runs (True), or False when
    another driver on this machine holds it: several drivers share one matrix, each
    taking the next job nobody holds. The lock (``flock`` on ``lock_dir/<job>.lock``)
    goes with the process, so a killed driver leaves nothing held."""
    if lock_dir is None:
        yield True
        return
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / (key.replace("/", "-") + ".lock"), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def run_jobs(
    jobs, results: Path, runner, max_minutes: float, retry_failed: bool = False,
    lock_dir: Path | None = None,
) -> int:  # fmt: skip
    """Run the jobs not yet in ``results`` (failed ones too with ``retry_failed``) and
    not held by another driver (``lock_dir``: ``claimed``), appending each record as it
    finishes; no job starts after ``max_minutes``. Returns how many ran."""
    start, ran = time.monotonic(), 0

    def out_of_time() -> bool:
        if (time.monotonic() - start) / 60 < max_minutes:
            return False
        print(f"bench_tta: --max-minutes {max_minutes:g} reached: stopping", flush=True)
        return True

    def to_run(key: str) -> bool:
        done = tta.load_results(results).get(key)
        return done is None or (done.get("status") != "ok" and retry_failed)

    for model, method, seed in jobs:
        key = tta.job_key(model, method, seed)
        if not to_run(key):
            continue
        if out_of_time():
            break
        with claimed(lock_dir, key) as mine:
            if not mine:
                print(f"bench_tta: {model} {method} seed {seed}: another driver has it", flush=True)
                continue
            if not to_run(key):  # finished by another driver since the first look
                continue
            print(f"bench_tta: {model} {method} seed {seed} ...", flush=True)
            record = runner(model, method, seed)
            while record.get("status") == "piece":  # not a result: the job's next piece
                print(f"bench_tta:   epochs 1-{record['until_epoch']} done", flush=True)
                if out_of_time():
                    return ran
                record = runner(model, method, seed)
            record["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
            tta.append_result(results, record)
        ran += 1
        acc = record["curve"][-1]["acc"] if record.get("status") == "ok" else None
        print(f"bench_tta:   {record['status']} acc {acc} in {record.get('wall_s', 0):.0f} s",
              flush=True)  # fmt: skip
    return ran


def merge_peers(paths: list[Path]) -> dict:
    """The rows of several bench_peers JSON files (a missing file has none), a later
    file's (model, row, rate) replacing an earlier one's, except that a row timed on the
    training job (``recipe`` "training": the timed job is the trained job) is never
    replaced by one that was not; their headers, in order."""
    rows, headers = {}, []
    for path in paths:
        if not path.is_file():
            continue
        peers = json.loads(path.read_text())
        headers.append(peers.get("header", ""))
        for r in peers.get("rows", []):
            key = (r["model"], r["row"], r["rate"])
            if tta.timed_on_training_job(rows.get(key)) <= tta.timed_on_training_job(r):
                rows[key] = r
    return {"header": " / ".join(h for h in headers if h), "rows": list(rows.values())}


def declared_exchanges() -> dict[str, str]:
    """The exchange an hvdc method's accuracy runs used where they did not record it: the
    one it fixes, or for a summable codec its only compressed exchange, the allreduce."""
    declared = {}
    for m in {*HVDC_METHODS, *JOB_METHODS} - TORCH_METHODS.keys() - TUNED_METHODS.keys():
        hvdc = HVDC_TABLE[m.removeprefix("hvdc-")]
        if hvdc.exchange != "auto":
            declared[m] = hvdc.exchange
        elif hvdc.compressor().summable:
            declared[m] = "allreduce"
    return declared


def matrix() -> tta_report.Matrix:
    """The report's rows: ``METHODS`` with the step rows they borrow, the exchanges they
    declare, the fixed-exchange runs of the tuned ones, the warm-ups, the tuned runs."""
    return tta_report.Matrix(
        METHODS, STEP_ROW, declared_exchanges(), ON_EXCHANGE, WARM_STEPS, tuple(TUNED_METHODS)
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the jobs of the matrix not yet in the results file")
    left = sub.add_parser("missing", help="list the jobs of the matrix not yet finished")
    for p in (run, left):
        p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
        p.add_argument(
            "--methods", nargs="+", choices=list(dict.fromkeys((*METHODS, *JOB_METHODS))),
            default=list(JOB_METHODS),
        )  # fmt: skip
        p.add_argument("--seeds", nargs="+", type=int, help="default: the model's MODEL_SEEDS")
        p.add_argument("--results", type=Path, default=RESULTS)
    run.add_argument("--max-minutes", type=float, default=60.0, help="start no job after")
    run.add_argument("--job-minutes", type=float, default=15.0, help="kill a job after")
    run.add_argument("--retry-failed", action="store_true")
    rep = sub.add_parser("report", help="tables and plots from the results file")
    rep.add_argument("--results", type=Path, default=RESULTS)
    rep.add_argument(
        "--peers", type=Path, nargs="+", default=PEERS,
        help="bench_peers JSON files; a later file's row replaces an earlier one's",
    )  # fmt: skip
    rep.add_argument("--out", type=Path, default=ROOT / "docs")
    rep.add_argument(
        "--readme", action="store_true",
        help="rewrite the README's headline and the tables of docs/benchmarks-time-to-accuracy.md",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.command in ("run", "missing"):
        jobs = plan(args.models, args.methods, args.seeds, merge_peers(PEERS),
                    tta.load_results(args.results))  # fmt: skip
    if args.command == "missing":
        left = missing(jobs, args.results)
        for model, method, seed in left:
            print(f"{model} {method} seed {seed}")
        print(f"bench_tta: {len(jobs) - len(left)} of {len(jobs)} jobs of the matrix finished")
        return 0
    if args.command == "run":
        timeout = 60 * args.job_minutes
        run_jobs(jobs, args.results, lambda *job: run_job(*job, timeout), args.max_minutes,
                 args.retry_failed, lock_dir=WORK / "locks")  # fmt: skip
        return 0
    text = tta_report.write_report(
        tta.load_results(args.results), merge_peers(args.peers), args.out, MODELS, matrix(),
        ROOT / "README.md" if args.readme else None, TTA_PAGE if args.readme else None,
    )  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
