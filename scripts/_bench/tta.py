"""Time to accuracy: the results file of the accuracy jobs and the arithmetic that joins
it with the peer benchmark's step times (scripts/bench_tta.py).

The results file is JSON lines, one per finished job, appended and synced as each job
ends: a driver killed mid-job loses that job only, and a line cut short by the kill is
skipped when the file is read. A job is keyed by (model, method, seed).

Time to accuracy of a method on a link = the steps its mean test-accuracy curve (over its
seeds, per epoch) needs to reach the target x its median step time on that link, the
steps its run spent otherwise counted at their own cost (``time_to``'s ``lead``: the
tuner's trial steps, a dense warm-up). The target of a model is the mean final accuracy of
the baseline (DDP's allreduce) over its seeds minus ``MARGIN`` (0.3 points; the report
also reads ``MARGINS``). Accuracy is read after each epoch, so the steps are those of the
first epoch whose mean accuracy reaches the target: a row that reaches it at epoch e moves
by 1/e of its time if it reaches it one epoch sooner or later.

A step time is the median over bench_peers' launches (``step_spread``: their fastest and
slowest median give a time's low and high end). Two times are a tie when their ratio is
within ``TIE_BAND`` or when the spread of either could reverse it (``judge``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

RATES = ("100mbit", "1gbit", "unlimited")  # bench_peers' links, the report's columns
RATE_NAMES = {"100mbit": "100 Mbit/s", "1gbit": "1 Gbit/s", "unlimited": "unlimited"}
MARGIN = 0.003  # 0.3 points of accuracy below the baseline's final mean
MARGINS = (0.002, 0.003, 0.005)  # the margins of the report's margin table
# a ratio of two times within this factor either way is a tie: about the step time's
# spread between launches of one bench on this machine (docs/benchmarks-time-to-accuracy.md)
TIE_BAND = 1.10
NEAR_TARGET = 0.003  # a row whose final accuracy is this close to the target needs 3 seeds
SEEDS_NEAR_TARGET = (1, 2, 3)
BASELINE = "ddp"
DENSE = frozenset({"dense", "bf16", "fp16"})  # a tuned row's options that send no codec payload


def job_key(model: str, method: str, seed: int) -> str:
    return f"{model}/{method}/seed{seed}"


def append_result(path: Path, record: dict) -> None:
    """Append one job's record as a line and sync it to disk before returning. A line a
    killed writer left unfinished is ended first, so the new record has a line of its own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(record, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def read_records(path: Path, fields: frozenset[str]) -> list[dict]:
    """The JSON-line records of ``path`` (none if it is missing) that hold ``fields``, in
    file order; lines that do not parse as such a record (the tail a killed writer left)
    are skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and fields <= record.keys():
            records.append(record)
    return records


def load_results(path: Path) -> dict[str, dict]:
    """The records by key (a later line of the same key wins; ``read_records``)."""
    return {
        job_key(r["model"], r["method"], r["seed"]): r
        for r in read_records(path, frozenset({"model", "method", "seed"}))
    }


def finished(records: dict[str, dict], model: str, method: str) -> list[dict]:
    """The method's successful runs on ``model``, by seed."""
    runs = [
        r for r in records.values()
        if r["model"] == model and r["method"] == method and r.get("status") == "ok"
    ]  # fmt: skip
    return sorted(runs, key=lambda r: r["seed"])


def final_accuracy(runs: list[dict]) -> dict | None:
    """Mean, standard deviation (0 for one seed), min and max of the runs' final accuracy."""
    if not runs:
        return None
    finals = [r["curve"][-1]["acc"] for r in runs]
    return {
        "mean": statistics.fmean(finals),
        "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
        "min": min(finals),
        "max": max(finals),
        "seeds": [r["seed"] for r in runs],
    }


def target(
    records: dict[str, dict], model: str, baseline: str = BASELINE, margin: float = MARGIN
) -> float | None:  # fmt: skip
    """The model's target accuracy: the baseline's mean final accuracy minus ``margin``."""
    acc = final_accuracy(finished(records, model, baseline))
    return None if acc is None else acc["mean"] - margin


def near_target(records: dict[str, dict], model: str, method: str) -> bool:
    """Whether the method's mean final accuracy lies within ``NEAR_TARGET`` of the model's
    target, either side: one seed cannot say on which side it ends."""
    goal, acc = target(records, model), final_accuracy(finished(records, model, method))
    return goal is not None and acc is not None and abs(acc["mean"] - goal) <= NEAR_TARGET


def mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
    """(step, mean accuracy over the runs) per evaluation that every run has."""
    if not runs:
        return []
    length = min(len(r["curve"]) for r in runs)
    return [
        (runs[0]["curve"][i]["step"], statistics.fmean(r["curve"][i]["acc"] for r in runs))
        for i in range(length)
    ]


def steps_to(curve: list[tuple[int, float]], goal: float) -> int | None:
    """The step of the first evaluation at or above ``goal``; None if none reaches it."""
    return next((step for step, acc in curve if acc >= goal), None)


def time_to(
    steps: int | None, step_s: float | None, lead: tuple[tuple[int, float], ...] = ()
) -> float | None:  # fmt: skip
    """Seconds for ``steps`` steps: the first ones those of ``lead`` ((steps, seconds a
    step) in the order the run takes them: the tuner's trial steps, a dense warm-up), the
    rest at ``step_s``; None where the target is not reached or the step time unknown."""
    if steps is None or step_s is None or not math.isfinite(step_s):
        return None
    seconds, left = 0.0, steps
    for n, each in lead:
        taken = min(n, left)
        seconds, left = seconds + taken * each, left - taken
    return seconds + left * step_s


def timed_on_training_job(peer_row: dict | None) -> bool:
    """Whether a bench_peers row timed the training job (``recipe`` "training": train.py's
    model, SGD and batches), not the random batch of the files before it."""
    return peer_row is not None and peer_row.get("recipe") == "training"


def step_time(peer_row: dict) -> float:
    """A bench_peers row's seconds a step: its period (the timed steps' wall-clock from
    barrier to barrier over their number: what a run of them takes) where the row has it,
    else the median of the slowest rank's step times (rows from before the period was
    timed; it counts every step at its slowest rank, an upper bound)."""
    return float(peer_row.get("period_s", peer_row["step_s"]))


def step_spread(peer_row: dict) -> tuple[float, float, int]:
    """(fastest, slowest, launches) of a bench_peers row's step time (``step_time``): the
    range over its launches (``period_runs_s``, else ``step_runs_s``); a row of one launch
    gives the range of its timed steps instead (wider: one launch cannot show the
    launch-to-launch spread)."""
    runs = peer_row.get("period_runs_s") or peer_row.get("step_runs_s")
    if runs:
        return float(min(runs)), float(max(runs)), len(runs)
    median = float(peer_row["step_s"])
    return (float(peer_row.get("step_min_s", median)), float(peer_row.get("step_max_s", median)),
            1)  # fmt: skip


def tuning_lead(peer_row: dict) -> tuple[tuple[int, float], ...]:
    """The tuner's trial steps of a timed row at their measured cost (``tuning_s`` over
    ``tuning_steps``), as ``time_to``'s ``lead``; none where the row did not record it."""
    n, seconds = peer_row.get("tuning_steps") or 0, peer_row.get("tuning_s")
    return ((n, seconds / n),) if n and seconds is not None else ()


def judge(ours: tuple[float, float, float], theirs: tuple[float, float, float]) -> dict:
    """Two times to the target, each (median, fastest, slowest) seconds: ``ratio`` theirs
    over ours, ``low`` (ours at its slowest, theirs at its fastest) and ``high``, and the
    ``winner``: "ours" where the ratio is above ``TIE_BAND`` and ``low`` still above 1,
    "theirs" the other way round, else "tie"."""
    ratio = theirs[0] / ours[0]
    low, high = theirs[1] / ours[2], theirs[2] / ours[1]
    if ratio >= TIE_BAND and low > 1:
        winner = "ours"
    elif ratio <= 1 / TIE_BAND and high < 1:
        winner = "theirs"
    else:
        winner = "tie"
    return {"ratio": ratio, "low": low, "high": high, "winner": winner}


def peer_rows(peers: dict) -> dict[tuple[str, str, str], dict]:
    """{(model, row, rate): the row} of bench_peers.json's rows."""
    return {(r["model"], r["row"], r["rate"]): r for r in peers.get("rows", [])}


def step_times(peers: dict) -> dict[tuple[str, str, str], float]:
    """{(model, row, rate): seconds a step (``step_time``)} from bench_peers.json's rows."""
    return {key: step_time(r) for key, r in peer_rows(peers).items()}


def sent_dense(peer_row: dict | None) -> bool:
    """Whether the row's tuner (``exchange="auto"``) sent every compressed bucket
    uncompressed: that run trains as an allreduce of the gradients (after its tuning
    steps), so the baseline's accuracy curve, not the codec's, is the one its step time
    goes with."""
    exchanges = set(peer_row.get("exchanges") or []) if peer_row is not None else set()
    return bool(exchanges) and exchanges <= DENSE


# the accuracy runs that a row sent all dense trains like: all on the 16-bit allreduce, the
# bf16 hook's (the same casts and sum, torch's bf16_compress_hook); otherwise DDP's
HALF_STAND_IN = "torch-bf16"


def dense_stand_in(peer_row: dict | None) -> str:
    """The method whose accuracy curve goes with a row that ``sent_dense``: torch's bf16
    hook where every bucket took the bf16 allreduce, else the baseline (float32)."""
    exchanges = set(peer_row.get("exchanges") or []) if peer_row is not None else set()
    return HALF_STAND_IN if exchanges == {"bf16"} else BASELINE


def partly_dense(peer_row: dict | None) -> bool:
    """Some buckets sent uncompressed, others compressed: the codec's curve is kept."""
    exchanges = set([] if peer_row is None else peer_row.get("exchanges") or [])
    return bool(exchanges & DENSE) and bool(exchanges - DENSE)


def compressed_exchange(peer_row: dict | None) -> str | None:
    """The one compressed exchange the timed row's buckets took ("allgather", ...), None
    where they took none (all dense, torch's hooks) or several."""
    exchanges = set(peer_row.get("exchanges") or []) - DENSE if peer_row else set()
    return next(iter(exchanges)) if len(exchanges) == 1 else None


def run_exchanges(runs: list[dict], declared: str | None = None) -> set[str] | None:
    """The exchanges the runs' gradients travelled by: as recorded (train.py's
    ``exchanges_used``, of a job's last piece), else the method's fixed ``declared``
    exchange, else None (a run from before they were recorded, ``exchange="auto"``)."""
    recorded = [set(r["exchanges"]) for r in runs if r.get("exchanges")]
    if recorded and len(recorded) == len(runs):
        return set().union(*recorded)
    return {declared} if declared else None


def exchange_mark(job: set[str] | None, peer_row: dict | None) -> str:
    """ "" where the timed run and the accuracy run used the same exchanges (or the timed
    row names none: torch's hooks), "≠" where they differ, "?" where the accuracy run's
    are unknown: its curve may not be the one of the exchange that was timed."""
    timed = set(peer_row.get("exchanges") or []) if peer_row else set()
    if not timed:
        return ""
    if job is None:
        return "?"
    return "" if timed == job else "≠"
