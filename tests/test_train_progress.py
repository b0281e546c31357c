"""scripts/train.py's progress output on rank 0: a tqdm bar when its stderr is a
terminal, plain ``progress:`` lines when a launcher pipes it (horovodrun here), never a
carriage-return bar into a pipe."""

from __future__ import annotations

import fcntl
import os
import pty
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

TRAIN = Path(__file__).parents[1] / "scripts" / "train.py"
TINY = ["--dataset", "synthetic", "--synthetic-size", "512", "--batch-size", "32",
        "--compression", "3lc", "--progress-every", "0.001"]  # fmt: skip


@pytest.mark.skipif(shutil.which("horovodrun") is None, reason="horovodrun is not installed")
def test_under_horovodrun_rank0_prints_plain_progress_lines():
    cmd = ["horovodrun", "--gloo", "-np", "2", sys.executable, str(TRAIN), "--backend",
           "horovod", *TINY]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr  # horovodrun tags and forwards both
    progress = [line for line in output.splitlines() if "progress: step" in line]
    assert len(progress) >= 2 and "progress: step 8/8 (100%)" in progress[-1]
    assert "\r" not in output


def test_with_a_terminal_rank0_draws_the_tqdm_bar():
    """One rank (mpi4py singleton) with stderr on a pseudo-terminal."""
    main, child = pty.openpty()
    # a terminal of 30 x 100 (a new pty has 0 columns, where tqdm draws nothing)
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    cmd = [sys.executable, str(TRAIN), "--backend", "mpi4py", *TINY]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=child, env=env)  # fmt: skip
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=300)
    os.close(main)
    shown = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, shown[-3000:]
    assert "\r" in shown and "train:" in shown and "16/16" in shown
    assert "progress: step" not in shown
