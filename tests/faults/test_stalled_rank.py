"""A stalled rank fails the job after the user's timeout (the ``timeout=`` of
``init_process_group``), whichever adapter runs the exchange: the DDP hook overlapping on
its own process groups, the optimizer over a threaded torch.distributed transport, and
the Lightning and Accelerate integrations (docs/checkpoints-and-faults.md, "A rank that
stalls"). 3 gloo ranks (tests/faults/stall_worker.py); the last one sleeps STALL_S
seconds in the middle of a step, the timeout is TIMEOUT_S: the others must fail with
gloo's timeout well before the stalled rank would have come back. Before the process
groups of the library inherited the timeout, the hook's ranks waited out the whole stall
(gloo's default timeout is 30 minutes) and then went on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("stall_worker.py")
SIZE, TIMEOUT_S, STALL_S = 3, 4.0, 40.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_stalled(mode: str, out: Path, timeout_s: float = TIMEOUT_S, stall_s: float = STALL_S):
    """Run the ranks; return the reports of the ranks that did not stall."""
    port = _free_port()
    procs = []
    for rank in range(SIZE):
        env = {
            **os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(SIZE),
            "LOCAL_WORLD_SIZE": str(SIZE), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"stall-{port}",
        }  # fmt: skip
        cmd = [sys.executable, str(WORKER), mode, str(timeout_s), str(stall_s), str(out)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    files = {r: out / f"rank{r}.json" for r in range(SIZE - 1)}
    deadline = time.monotonic() + stall_s + 120
    # the reports are what is measured: then the stalled rank is stopped, not waited for
    while time.monotonic() < deadline and not all(f.exists() for f in files.values()):
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        p.kill()
    logs = [p.communicate()[0].decode(errors="replace") for p in procs]
    missing = [r for r, f in files.items() if not f.exists()]
    assert not missing, f"ranks {missing} wrote no report:\n" + "\n".join(x[-2000:] for x in logs)
    return [json.loads(f.read_text()) for f in files.values()]


@pytest.mark.parametrize("mode", ["hook", "optimizer", "lightning", "accelerate"])
def test_a_stalled_rank_fails_the_job_after_the_users_timeout(mode, tmp_path):
    if mode in ("lightning", "accelerate"):
        pytest.importorskip("pytorch_lightning" if mode == "lightning" else "accelerate")
    for r in run_stalled(mode, tmp_path):
        assert r["error"] is not None, f"rank {r['rank']} went on without an error: {r}"
        assert r["seconds"] >= TIMEOUT_S * 0.9, r  # the user's timeout, not an early error
        assert r["seconds"] < STALL_S / 2, r  # not the stall, nor gloo's 30 minutes
        assert "imed out" in r["error"] or "timeout" in r["error"].lower(), r
