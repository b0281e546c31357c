"""scripts/train.py: every bad argument is a one-line argparse error (exit status 2) before
training starts; checkpoints are verified, kept last-K, and resume picks the newest one
that verifies."""

from __future__ import annotations

import importlib.util
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
