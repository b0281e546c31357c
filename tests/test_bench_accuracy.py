"""scripts/bench_accuracy.py: the runs it launches (simulated world by default, horovodrun
with --real), its defaults (the long-run table) and the issue-12 targets it checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "_bench_accuracy", ROOT / "scripts" / "bench_accuracy.py"
)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_defaults_are_the_long_run_table():
    args = bench.build_parser().parse_args([])
    assert (args.epochs, args.seeds, args.np, args.lr_schedule, args.real) == (
        10, [1, 2, 3], 4, "step", False,
    )  # fmt: skip
    assert args.methods == ["none", "3lc", "3lc-1.75", "accordion-3lc", "dqsg", "ndqsg"]


def test_runs_are_simulated_by_default_and_real_with_the_flag(tmp_path):
    args = bench.build_parser().parse_args(["--seeds", "2"])
    cmd = bench.train_command("accordion-3lc", 2, args, tmp_path)
    assert cmd[-2:] == ["--simulate-ranks", "4"] and "horovodrun" not in " ".join(cmd)
    for flag in (["--seed", "2"], ["--epochs", "10"], ["--lr-schedule", "step"],
                 ["--accordion", "1.0", "1.75"]):  # fmt: skip
        assert any(cmd[i : i + len(flag)] == flag for i in range(len(cmd))), flag
    real = bench.build_parser().parse_args(["--real", "--np", "2"])
    cmd = bench.train_command("3lc", 1, real, tmp_path)
    assert Path(cmd[0]).name == "horovodrun" and cmd[1:3] == ["-np", "2"]
    assert "--simulate-ranks" not in cmd


def _run(method, seed, acc, bits):
    return {"method": method, "seed": seed, "test_accuracy": acc, "bits_per_value_ranks": bits,
            "curve": [{"seconds": 10.0}]}  # fmt: skip


def test_aggregate_and_targets():
    runs = [
        _run("none", 1, 0.9100, 32.0), _run("none", 2, 0.9120, 32.0),
        _run("3lc", 1, 0.9095, 0.25), _run("3lc", 2, 0.9105, 0.25),
        _run("accordion-3lc", 1, 0.9090, 0.16), _run("accordion-3lc", 2, 0.9060, 0.16),
        _run("dqsg", 1, 0.90, 3.0), _run("ndqsg", 1, 0.899, 2.0),
    ]  # fmt: skip
    rows = bench.aggregate(runs, bench.DEFAULT_METHODS)
    by = {r["method"]: r for r in rows}
    assert by["none"]["acc_mean"] == pytest.approx(91.10)
    assert by["3lc"]["fewer_bits"] == pytest.approx(128.0)
    assert by["3lc"]["acc_vs_none"] == pytest.approx(-0.10)
    lines = bench.targets(rows)
    assert lines[0].startswith("- met: 3lc s=1.0 within 0.15")  # -0.10
    assert lines[1].startswith("- NOT met: Accordion")  # -0.25 points, 1.56x fewer bits
    assert "1.56x" in lines[1] and "-0.25" in lines[1]
    assert lines[2].startswith("- met: NDQSG") and "33.3%" in lines[2]
