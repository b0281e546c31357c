"""The examples/ scripts run as a user runs them, at a few steps: the Lightning one with
Lightning's own launcher (2 CPU ranks), the Accelerate one under ``accelerate launch``;
each trains with 3LC through hvdcompress's hook and prints its summary line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(cmd) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert done.returncode == 0, f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


def test_lightning_example_trains_compressed_on_two_cpu_ranks():
    # --no-tuning: 3LC on every step (tuned, auto may go dense on the loopback), so that
    # the bits per value below are 3LC's
    out = run([sys.executable, "examples/lightning_fmnist.py", "--devices", "2", "--epochs", "1",
               "--limit-batches", "20", "--no-tuning"])  # fmt: skip
    line = re.search(
        r"lightning_fmnist: 3lc on 2 ranks: val_acc ([\d.]+), ([\d.]+) bits per value, "
        r"(\d+) hook calls",
        out,
    )
    assert line, out[-2000:]
    assert float(line[1]) > 0.3 and 0 < float(line[2]) < 2 and int(line[3]) >= 20


def test_accelerate_example_trains_compressed_under_accelerate_launch():
    out = run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "examples/accelerate_fmnist.py", "--cpu", "--epochs",
               "1", "--max-steps", "20", "--no-tuning"])  # fmt: skip
    line = re.search(
        r"accelerate_fmnist: epoch 1: test accuracy ([\d.]+), loss [\d.]+, ([\d.]+) bits "
        r"per value \(3lc\)",
        out,
    )
    assert line, out[-2000:]
    assert float(line[1]) > 0.3 and 0 < float(line[2]) < 2
