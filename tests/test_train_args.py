"""scripts/train.py: every bad argument is a one-line argparse error (exit status 2) before
training starts; checkpoints are verified, kept last-K, and resume picks the newest one
that verifies."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvdcompress.training.data import DATA_DIR, FILES

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"


def _train_module():
    spec = importlib.util.spec_from_file_location("_script_train_args", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _train_module()

BAD = [
    (["--batch-size", "0"], r"--batch-size: expected an int >= 1, got 0"),
    (["--batch-size", "-1"], r"--batch-size: expected an int >= 1, got -1"),
    (["--steps", "0"], r"--steps: expected an int >= 1, got 0"),
    (["--epochs", "0"], r"--epochs: expected an int >= 1, got 0"),
    (["--lr", "nan"], r"--lr: expected a finite number in \(0.0, inf\], got nan"),
    (["--lr", "0"], r"--lr: expected a finite number"),
    (["--lr", "inf"], r"--lr: expected a finite number"),
    (["--width", "0"], r"--width: expected an int >= 1, got 0"),
    (["--width", "x"], r"--width: expected an int, got 'x'"),
    (["--momentum", "1.5"], r"--momentum: expected a finite number in \[0.0, 1.0\)"),
    (["--sparsity", "2.5"], r"--sparsity: expected a finite number in \[1.0, 2.0\)"),
    (["--keep-checkpoints", "0"], r"--keep-checkpoints: expected an int >= 1"),
    (["--checkpoint-every", "-1"], r"--checkpoint-every: expected an int >= 0"),
    (
        ["--accordion", "1.0", "2.5"],
        r"--accordion HIGH: 3lc sparsity must be float in \[1.0, 2.0\)",
    ),
    (
        ["--compression", "powersgd", "--accordion", "2", "1.5"],
        r"--accordion HIGH: powersgd matrix_rank must be int in \[1, 64\], got 1.5",
    ),
    (
        ["--compression", "topk", "--accordion", "0.99", "0"],
        r"--accordion HIGH: topk ratio must be float in \(0.0, 1.0\]",
    ),
    (["--compression", "dqsg", "--accordion", "1", "2"], r"dqsg has no per-tensor level"),
    (["--accordion", "1", "1.5", "--cat", "topk"], r"--accordion and --cat are exclusive"),
    (
        ["--compression", "topk", "--cat", "topk", "--cat-cost", "garbage"],
        r"--cat-cost takes C0,C1\[,PACKET_BITS\], got 'garbage'",
    ),
    (
        ["--compression", "topk", "--cat", "topk", "--cat-cost", "1e-5,nan"],
        r"--cat-cost takes",
    ),
    (["--compression", "3lc", "--cat", "topk"], r"--cat topk needs --compression topk"),
    (["--compression-param", "ratio"], r"--compression-param takes KEY=VALUE"),
    (["--compression", "topk", "--compression-param", "ratio=2"], r"--compression topk: "),
    (["--resume"], r"--resume needs --checkpoint DIR"),
    (["--cat-every", "0"], r"--cat-every: expected an int >= 1"),
    (
        ["--lr-schedule", "cosine", "--milestones", "5"],
        r"--milestones apply to --lr-schedule step, not cosine",
    ),
    (["--milestones", "8,5"], r"--milestones: milestones must increase strictly"),
    (["--milestones", "x"], r"--milestones: expected comma-separated epochs"),
    (["--warmup-epochs", "-1"], r"--warmup-epochs: expected a finite number"),
    (["--lr-gamma", "0"], r"--lr-gamma: expected a finite number in \(0.0, 1.0\]"),
    (["--lr-schedule", "linear"], r"--lr-schedule: invalid choice"),
    (["--simulate-ranks", "0"], r"--simulate-ranks: expected an int >= 1"),
    (
        ["--simulate-ranks", "2", "--launcher", "torchrun"],
        r"--simulate-ranks runs every rank in this process: no --launcher",
    ),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.strip().splitlines()[-1].startswith("train.py: error: ")


def test_good_arguments_parse():
    args = train.parse_args(
        ["--compression", "powersgd", "--accordion", "2", "1", "--lr", "0.1", "--steps", "3"]
    )
    assert (args.accordion, args.lr, args.steps) == ([2.0, 1.0], 0.1, 3)
    assert train.parse_args([]).keep_checkpoints == 3


def test_default_schedule_drops_tenfold_after_half_and_four_fifths_of_the_epochs():
    s = train.make_schedule(train.parse_args(["--epochs", "10"]), steps_per_epoch=100)
    assert (s.kind, s.milestones, s.gamma, s.warmup_epochs) == ("step", (5.0, 8.0), 0.1, 0.0)
    assert s.lr_at(499) == 0.05 and s.lr_at(500) == pytest.approx(0.005)
    one = train.make_schedule(train.parse_args([]), steps_per_epoch=100)
    assert one.milestones == ()  # a 1-epoch run: no milestone to place
    explicit = train.parse_args(["--milestones", "3,7", "--lr-gamma", "0.5"])
    assert train.make_schedule(explicit, 10).milestone_steps == [30, 70]


def _run(args, cwd, timeout=120):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(TRAIN), "--backend", "mpi4py", "--no-progress", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_data_is_present():
    assert all((Path(DATA_DIR) / f).is_file() for f in FILES.values()), DATA_DIR


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--batch-size", "0"], r"--batch-size: expected an int >= 1, got 0"),
        (["--lr", "nan"], r"--lr: expected a finite number"),
        (["--checkpoint", "blocker/ck"], r"--checkpoint blocker/ck is not a writable directory"),
        (["--log-dir", "blocker/logs"], r"--log-dir blocker/logs is not a writable directory"),
    ],
)
def test_train_subprocess_exits_2_before_training(argv, message, tmp_path):
    (tmp_path / "blocker").write_text("a file, not a directory")
    out = _run(["--steps", "1", "--width", "2", *argv], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert re.search(message, out.stderr), out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "summary:" not in out.stdout


def _digest(out) -> str:
    assert out.returncode == 0, out.stderr[-3000:]
    return re.search(r"param_digest (\w+)", out.stdout).group(1)


def test_resume_skips_a_corrupt_newest_checkpoint_and_keeps_k(tmp_path):
    common = ["--width", "2", "--batch-size", "32"]
    full = _digest(_run([*common, "--steps", "5"], tmp_path))
    out = _run(
        [*common, "--steps", "4", "--checkpoint", "ck", "--checkpoint-every", "1",
         "--keep-checkpoints", "2"],
        tmp_path,
    )  # fmt: skip
    _digest(out)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["rank0.step000000003.ckpt", "rank0.step000000004.ckpt"]
    newest = tmp_path / "ck" / names[-1]
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    out = _run([*common, "--steps", "5", "--checkpoint", "ck", "--resume"], tmp_path)
    assert _digest(out) == full
    assert "resumes from step 3" in out.stderr
    # every file corrupt: a clear error naming the files, no training
    for p in (tmp_path / "ck").iterdir():
        p.write_bytes(p.read_bytes()[:-5])
    out = _run([*common, "--steps", "5", "--checkpoint", "ck", "--resume"], tmp_path)
    assert out.returncode != 0 and "summary:" not in out.stdout
    assert "rank0.step000000003.ckpt" in out.stderr and "truncated" in out.stderr
    assert "Traceback" not in out.stderr


SYNTHETIC = ["--dataset", "synthetic", "--synthetic-size", "1024", "--width", "2",
             "--batch-size", "32", "--epochs", "2"]  # fmt: skip


def test_step_schedule_is_logged_and_resume_continues_it_exactly(tmp_path):
    sched = [*SYNTHETIC, "--milestones", "0.5"]  # 32 steps per epoch: drop at step 16
    full = _run([*sched, "--steps", "20", "--log-dir", "logs"], tmp_path)
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rates = [float(row["lr"]) for row in csv.DictReader(f)]
    assert rates == [0.05] * 16 + [pytest.approx(0.005)] * 4
    _digest(_run([*sched, "--steps", "12", "--checkpoint", "ck"], tmp_path))
    resumed = _run([*sched, "--steps", "20", "--checkpoint", "ck", "--resume"], tmp_path)
    assert _digest(resumed) == _digest(full)
    # other schedule flags on resume: a clear error, no training
    other = _run([*SYNTHETIC, "--milestones", "0.75", "--steps", "20", "--checkpoint", "ck",
                  "--resume"], tmp_path)  # fmt: skip
    assert other.returncode != 0 and "summary:" not in other.stdout
    assert "trained with the schedule" in other.stderr and "Traceback" not in other.stderr


def test_a_run_in_pieces_until_epoch_ends_as_the_whole_run_with_one_epochs_log(tmp_path):
    """--until-epoch stops at an epoch's end with a checkpoint; --resume goes on, the
    schedule spanning --epochs: the pieces end with the uninterrupted run's parameters,
    and the log directory holds each epoch once (simulated ranks, as bench_tta runs)."""
    run = [*SYNTHETIC, "--epochs", "3", "--simulate-ranks", "2", "--milestones", "1.5"]
    whole = _run([*run, "--log-dir", "whole"], tmp_path)
    piece = [*run, "--checkpoint", "ck", "--log-dir", "pieces"]
    first = _run([*piece, "--until-epoch", "1"], tmp_path)
    assert "steps 16 " in first.stdout, first.stderr[-2000:]
    second = _run([*piece, "--until-epoch", "2", "--resume"], tmp_path)
    assert "steps 32 " in second.stdout, second.stderr[-2000:]
    last = _run([*piece, "--resume"], tmp_path)
    assert _digest(last) == _digest(whole)
    for log in ("whole", "pieces"):
        with open(tmp_path / log / "epochs.csv") as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == [16, 32, 48]
    bad = _run([*run, "--until-epoch", "4"], tmp_path)
    assert bad.returncode == 2 and "--until-epoch must be at most --epochs" in bad.stderr


def test_simulated_ranks_match_the_plain_run_and_log_bits_over_ranks(tmp_path):
    plain = _digest(_run([*SYNTHETIC, "--steps", "6"], tmp_path))
    one = _run([*SYNTHETIC, "--steps", "6", "--simulate-ranks", "1"], tmp_path)
    assert _digest(one) == plain and "backend simulated" in one.stdout
    two = _run([*SYNTHETIC, "--steps", "6", "--simulate-ranks", "2", "--log-dir", "sim"], tmp_path)
    assert "ranks 2 backend simulated" in two.stdout
    with open(tmp_path / "sim" / "epochs.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert int(row["step"]) == 6 and float(row["test_acc"]) > 0
    bits, values = float(row["payload_bits_ranks"]), float(row["values_ranks"])
    assert values == 2 * 6 * sum(p.numel() for p in train.MODELS["cnn"](2).parameters())
    assert float(row["bits_per_value_ranks"]) == pytest.approx(bits / values, abs=1e-4)
    mean = float(re.search(r"bits_per_value_ranks (\S+)", two.stdout).group(1))
    assert mean == pytest.approx(bits / values, abs=1e-4)


def test_accordion_returns_to_low_after_each_rate_drop_and_its_trace_is_plotted(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "_plot_policy", ROOT / "scripts" / "plot_policy.py"
    )
    plot_policy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_policy)
    run = [
        *SYNTHETIC,
        "--steps",
        "40",
        "--simulate-ranks",
        "2",
        "--log-dir",
        "acc",
        "--milestones",
        "0.5,1",
        "--accordion",
        "1.0",
        "1.75",
        "--accordion-interval",
        "3",
    ]
    _digest(_run(run, tmp_path))  # fmt: skip
    trace = json.loads((tmp_path / "acc" / "accordion.json").read_text())
    drops = [d for d in trace["decisions"] if d["reason"] == "lr_drop"]
    # 16 steps per epoch: the rate drops from step 9 and from step 17 on (1-based); the
    # first interval ends after each (every 3 steps) put every tensor at the low level
    assert [d["step"] for d in drops] == [9, 18], trace["decisions"]
    for d in drops:
        assert set(d["levels"].values()) == {1.0}
    changes = plot_policy.norm_changes(trace)
    with_norms = [d for d in trace["decisions"] if d["norms"] is not None]
    first = trace["names"][0]
    a, b = with_norms[0]["norms"][0], with_norms[1]["norms"][0]
    assert changes[first][0][0] == with_norms[1]["step"]
    assert changes[first][1][0] == pytest.approx(abs(a - b) / a)
    out = plot_policy.plot(tmp_path / "acc", tmp_path / "acc" / "policy.png")
    assert out.stat().st_size > 10_000


def test_recommended_sgd_settings_come_from_the_built_compressor():
    """--compression-param may change what a compressor declares: GSpar with a variance
    budget runs at the job's rate, at its ratio budget at a tenth of it; a bad parameter
    falls back to the class's declaration (make_compression then reports it)."""
    parser = train.build_parser()
    ratio = parser.parse_args(["--compression", "gspar"])
    train.recommend_sgd(ratio)
    assert ratio.lr == pytest.approx(0.005) and "lr 0.005 (0.05 x 0.1)" in ratio.sgd_note
    variance = parser.parse_args(["--compression", "gspar", "--compression-param", "variance=1"])
    train.recommend_sgd(variance)
    assert variance.lr == 0.05 and variance.sgd_note == ""
    bad = parser.parse_args(["--compression", "gspar", "--compression-param", "variance=-1"])
    train.recommend_sgd(bad)
    assert bad.lr == pytest.approx(0.005)
