"""Horovod's transport split into process sets under ``horovodrun --gloo`` (Horovod's Gloo
controller): 4 ranks play 2 nodes of 2 (``HVDC_RANKS_PER_NODE=2``) and run the checks of
tests/mpi/test_horovod_split.py (which runs them under mpirun, Horovod's MPI controller)
through tests/horovod/split_worker.py: the split's collectives on their process sets, the
hierarchical exchange bit-identical on every rank and, with a lossless codec, equal to
the flat allgather's average. Without dynamic process sets every rank gets the error
that says how to enable them, and the job ends (no hang). Each job is a subprocess with
a hard timeout; skipped without horovodrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
WORKER = ROOT / "tests" / "horovod" / "split_worker.py"
HOROVODRUN = str(Path(PY).with_name("horovodrun"))
MARK = "HVDC_SPLIT "

pytestmark = pytest.mark.skipif(
    subprocess.run([PY, "-c", "import horovod.torch"], capture_output=True).returncode != 0
    or not Path(HOROVODRUN).exists(),
    reason="horovod.torch (with horovodrun) is not installed",
)


def _run(**env: str) -> dict[int, dict]:
    cmd = [HOROVODRUN, "--gloo", "-np", "4", "-H", "localhost:4", "--network-interface", "lo",
           PY, str(WORKER)]  # fmt: skip
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=full, cwd=ROOT,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    got = {}
    for line in proc.stdout.splitlines():
        if MARK in line:
            r = json.loads(line.split(MARK, 1)[1])
            got[r["rank"]] = r["results"]
    assert proc.returncode == 0 and sorted(got) == [0, 1, 2, 3], (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    return got


def test_split_and_the_hierarchical_exchange_under_the_gloo_controller():
    got = _run()
    for rank, results in got.items():
        assert all(v == "ok" for v in results.values()), (rank, results)
        assert len(results) == 4


def test_without_dynamic_process_sets_every_rank_says_how_to_enable_them():
    got = _run(HVDC_SPLIT_NO_DYNAMIC="1")
    for rank, results in got.items():
        assert results["no_dynamic"].startswith("RuntimeError"), (rank, results)
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in results["no_dynamic"]
