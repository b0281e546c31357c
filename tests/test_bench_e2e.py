"""scripts/bench_e2e.py: a cell's curve with its training seconds read from train.py's
logs, the epoch it stops at, and the comparison with the time-to-accuracy estimate (the
mean curve, the seed-1 curve, the bench step time with its lead) on tiny fake files."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("_bench_e2e", ROOT / "scripts" / "bench_e2e.py")
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)
from scripts._bench import tta  # noqa: E402


def _record(model, method, seed, accs, steps_per_epoch=100):
    curve = [{"epoch": i, "step": (i + 1) * steps_per_epoch, "acc": a} for i, a in enumerate(accs)]
    return {"model": model, "method": method, "seed": seed, "status": "ok", "curve": curve,
            "bits_per_value": 1.0}  # fmt: skip


def _records():
    recs = [
        _record("cnn", "ddp", 1, [0.80, 0.88, 0.910, 0.912]),
        _record("cnn", "ddp", 2, [0.80, 0.88, 0.914, 0.912]),  # target 0.909
        _record("cnn", "hvdc-dqsg-allgather", 1, [0.85, 0.90, 0.91, 0.92]),  # step 300
        _record("cnn", "hvdc-dqsg-allgather", 2, [0.85, 0.92, 0.91, 0.92]),  # mean: step 200
    ]
    return {tta.job_key(r["model"], r["method"], r["seed"]): r for r in recs}


def test_a_cells_curve_carries_the_training_seconds_up_to_each_evaluation(tmp_path):
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["step", "step_s"])
        w.writeheader()
        w.writerows({"step": i + 1, "step_s": 0.1 if i < 3 else 0.2} for i in range(6))
    with open(tmp_path / "epochs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["step", "epoch", "test_acc"])
        w.writeheader()
        w.writerows([{"step": 3, "epoch": 0, "test_acc": 0.5},
                     {"step": 6, "epoch": 1, "test_acc": 0.7}])  # fmt: skip
    curve = e2e.timed_curve(tmp_path)
    assert [(p["epoch"], p["step"], p["acc"]) for p in curve] == [(0, 3, 0.5), (1, 6, 0.7)]
    assert [p["train_s"] for p in curve] == [pytest.approx(0.3), pytest.approx(0.9)]
    assert [p["wall_s"] for p in curve] == [None, None]  # no step logs
    # rank 0's step logs: a step every 0.25 s, evaluations (after steps 3 and 6) 2 s each
    walls = {1: 10.0, 2: 10.25, 3: 12.5, 4: 12.75, 5: 13.0, 6: 15.25}
    curve = e2e.timed_curve(tmp_path, walls)
    assert [p["wall_s"] for p in curve] == [pytest.approx(0.75), pytest.approx(1.5)]


def test_step_logs_are_read_from_tensorboard_and_a_run_without_them_has_none(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    for step in (1, 2, 3):
        writer.add_scalar("train/loss", 1.0 / step, step, walltime=100.0 + step)
    writer.close()
    assert e2e.step_walls(tmp_path / "run") == {1: 101.0, 2: 102.0, 3: 103.0}
    (tmp_path / "empty").mkdir()
    assert e2e.step_walls(tmp_path / "empty") == {}


def test_the_training_wall_clock_leaves_the_evaluations_out():
    """From the first step's log to the evaluation step's, plus the first step, less each
    evaluation's excess over the median step interval; an evaluation step without a log
    (a run cut short) has no entry."""
    # a step every 0.5 s, an evaluation of 3 s before the logs of steps 10 and 20
    walls = {s: 100.0 + 0.5 * s + 3.0 * (s >= 10) + 3.0 * (s >= 20) for s in range(1, 21)}
    assert e2e.training_wall(walls, [10, 20, 30]) == {10: pytest.approx(5.0),
                                                       20: pytest.approx(10.0)}  # fmt: skip
    assert e2e.training_wall({}, [10]) == {}


def test_a_cell_stops_one_epoch_after_its_seed_1_run_reached_the_target():
    records = _records()
    # seed 1 reaches 0.909 after its third epoch (index 2): train 4 epochs
    assert e2e.until_epoch(records, "cnn", "hvdc-dqsg-allgather") == 4
    assert e2e.until_epoch(records, "cnn", "torch-bf16") == 10  # no run: the whole job
    del records["cnn/ddp/seed1"], records["cnn/ddp/seed2"]
    assert e2e.until_epoch(records, "cnn", "hvdc-dqsg-allgather") == 10  # no target


def test_a_cell_is_compared_with_the_mean_curve_and_the_seed_1_estimates():
    """The estimate: the mean curve's 200 steps (seeds 1-2 average 0.91 after epoch 2) x
    the bench's 0.1 s; seed 1 alone needs 300 steps. The cell reached the target after 300
    steps and 36 s of training: 1.8x the estimate, 1.2x seed 1's."""
    records = _records()
    peers = {"rows": [{"model": "cnn", "row": "hvdc-dqsg-allgather", "rate": "100mbit",
                       "step_s": 0.1, "step_runs_s": [0.09, 0.1, 0.11],
                       "exchanges": ["allgather"]}]}  # fmt: skip
    cell = {"model": "cnn", "method": "hvdc-dqsg-allgather", "rate": "100mbit", "seed": 1,
            "status": "ok", "wall_s": 60.0, "load_avg_start": 0.5, "load_avg_end": 4.0,
            "curve": [{"epoch": 0, "step": 100, "acc": 0.85, "train_s": 12.0},
                      {"epoch": 1, "step": 200, "acc": 0.90, "train_s": 24.0},
                      {"epoch": 2, "step": 300, "acc": 0.911, "train_s": 36.0}]}  # fmt: skip
    c = e2e.compare(cell, records, peers)
    assert (c["steps"], c["estimate_steps"], c["seed_steps"]) == (300, 200, 300)
    assert c["seconds"] == c["sum_s"] == 36.0 and c["step_s"] == pytest.approx(0.12)
    # with the wall-clock of the steps (evaluations out), that is the measured time
    walled = {**cell, "curve": [{**p, "wall_s": p["train_s"] * 1.1} for p in cell["curve"]]}
    c_wall = e2e.compare(walled, records, peers)
    assert c_wall["seconds"] == pytest.approx(39.6) and c_wall["sum_s"] == 36.0
    assert c_wall["ratio"] == pytest.approx(1.98)
    assert c["estimate_s"] == pytest.approx(20.0) and c["seed_estimate_s"] == pytest.approx(30.0)
    assert c["ratio"] == pytest.approx(1.8) and c["seed_ratio"] == pytest.approx(1.2)
    cell["curve"] = cell["curve"][:2]  # never reached
    c = e2e.compare(cell, records, peers)
    assert c["seconds"] is None and c["ratio"] is None


def test_the_report_marks_agreement_within_15_percent(tmp_path):
    records = _records()
    results = tmp_path / "cells.jsonl"
    base = {"model": "cnn", "method": "hvdc-dqsg-allgather", "seed": 1, "status": "ok",
            "wall_s": 60.0, "load_avg_start": 0.5, "load_avg_end": 1.0}  # fmt: skip
    for rate, seconds in (("100mbit", 22.0), ("1gbit", 40.0)):
        tta.append_result(results, {**base, "rate": rate, "curve": [
            {"epoch": 1, "step": 200, "acc": 0.91, "train_s": seconds}]})  # fmt: skip
    tta.append_result(results, {**base, "rate": "unlimited", "status": "timeout"})
    peers_file = tmp_path / "peers.json"
    peers_file.write_text(__import__("json").dumps({"rows": [
        {"model": "cnn", "row": "hvdc-dqsg-allgather", "rate": rate, "step_s": 0.1,
         "exchanges": ["allgather"]} for rate in ("100mbit", "1gbit")]}))  # fmt: skip
    results_file = e2e.bench_tta.RESULTS
    try:
        e2e.bench_tta.RESULTS = tmp_path / "jobs.jsonl"
        for r in records.values():
            tta.append_result(e2e.bench_tta.RESULTS, r)
        text = e2e.report(type("A", (), {"results": results, "peers": [peers_file]}))
    finally:
        e2e.bench_tta.RESULTS = results_file
    lines = text.splitlines()
    assert len(lines) == 4  # the timed-out cell has no row
    assert lines[2].startswith("| cnn | 100mbit | hvdc-dqsg-allgather | 200 / 200 / 300 | "
                               "0.110 / 0.100 | 22; 22 | 20 | 1.10 ✓ | 30 | 0.73 |")  # fmt: skip
    assert "| 2.00 ✗ |" in lines[3]  # 40 s against 200 x 0.1 s
