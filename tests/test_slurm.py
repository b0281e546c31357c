"""The batch scripts of slurm/ on a real scheduler: a private single-node Slurm.

A module fixture starts Slurm with scripts/slurm_local.sh (munged, slurmctld, slurmd; all
state in one directory) and stops it at the end, also when a test fails. It leaves alone
a Slurm of the same state directory that was already running before (someone's manual
`slurm_local.sh start`). Each test submits a script with sbatch, for 2 tasks on CPU (the
GPU lines are overridden on the sbatch command line), polls `scontrol show job` (no
slurmdbd here, so no sacct) with a bounded wait, cancels the job on timeout, and checks
the job state, exit code, metrics.csv and the summary line of the job's output.

Needs root (slurmd, munged) and the Slurm packages (scripts/setup.sh installs them with
HVDC_TEST=1; slurm_local.sh installs them too, as root with apt). Without them it skips
with the reason, except in CI (CI set), where that is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM_LOCAL = ROOT / "scripts" / "slurm_local.sh"
FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
JOB_TIMEOUT = 300  # s per job, from submission to a final state
STEPS = 20
# Slurm's final job states: anything else (PENDING, RUNNING, COMPLETING, ...) is polled on.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT"}  # fmt: skip
# For 2 ranks on a CPU node, over the scripts' GPU-node defaults. --time bounds the job in
# Slurm itself too; --chdir keeps Slurm's default outputs out of the checkout.
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1",
           "--time=00:10:00"]  # fmt: skip


def _unavailable() -> str | None:
    if sys.platform != "linux":
        return "a local Slurm needs Linux"
    if os.geteuid() != 0:
        return "a local Slurm needs root (slurmd runs jobs as their user, munged as munge)"
    have = all(shutil.which(c) for c in ("slurmctld", "slurmd", "sbatch", "munged"))
    if not have and (not shutil.which("apt-get") or os.environ.get("HVDC_NO_APT") == "1"):
        return "no Slurm/munge binaries and no apt-get to install them (scripts/setup.sh)"
    if sys.prefix == sys.base_prefix:
        return "not running in a venv: the batch scripts activate $VENV/bin/activate"
    return None


def _clean_env() -> dict[str, str]:
    # A pytest run inside a Slurm job must not hand its own job's variables to sbatch.
    own = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _script(cmd: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SLURM_LOCAL), cmd], capture_output=True, text=True, timeout=timeout,
        env=_clean_env(), stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """Environment for Slurm clients: SLURM_CONF of the started Slurm."""
    reason = _unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm test, but: {reason}")
        pytest.skip(reason)
    was_running = _script("status", timeout=60).returncode == 0
    try:
        # Up to 15 min: it may have to apt-get install the packages first.
        start = _script("start", timeout=900)
        assert start.returncode == 0, f"slurm_local.sh start failed:\n{start.stderr[-4000:]}"
        m = re.search(r"^export SLURM_CONF=(\S+)$", start.stdout, re.M)
        assert m, f"no SLURM_CONF in the output of start:\n{start.stdout}"
        env = _clean_env()
        env["SLURM_CONF"] = m.group(1)
        yield env
    finally:
        if not was_running:
            stop = _script("stop", timeout=120)
            assert stop.returncode == 0, f"slurm_local.sh stop failed:\n{stop.stderr[-4000:]}"


def _job_fields(env: dict[str, str], job: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30,
        env=env,
    ).stdout  # fmt: skip
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _submit_and_wait(env: dict[str, str], script: str, tmp_path: Path, **job_env: str):
    """sbatch SCRIPT for 2 CPU tasks; wait for a final state. Returns (fields, output)."""
    # Open MPI refuses root without the two OMPI_ variables (the scripts set them too).
    env = dict(env, REPO=str(ROOT), VENV=sys.prefix, LOG_DIR=str(tmp_path / "log"),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               **job_env)  # fmt: skip
    out_file = tmp_path / "job.out"
    cmd = ["sbatch", "--parsable", *CPU_JOB, "--export=ALL", f"--chdir={tmp_path}",
           f"--output={out_file}", str(ROOT / "slurm" / script)]  # fmt: skip
    sub = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert sub.returncode == 0, f"sbatch failed: {sub.stderr}"
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + JOB_TIMEOUT
    fields: dict[str, str] = {}
    while time.monotonic() < deadline:
        fields = _job_fields(env, job)
        if fields.get("JobState") in FINAL:
            break
        time.sleep(2)
    output = out_file.read_text(errors="replace") if out_file.exists() else "(no output file)"
    if fields.get("JobState") not in FINAL:
        subprocess.run(["scancel", job], timeout=30, env=env, capture_output=True)
        pytest.fail(
            f"job {job} not finished after {JOB_TIMEOUT}s (cancelled): {_brief(fields)}\n"
            f"--- job output ---\n{output[-4000:]}"
        )
    return fields, output


def _brief(fields: dict[str, str]) -> str:
    keys = ("JobId", "JobState", "Reason", "ExitCode", "RunTime", "NodeList", "StdOut")
    return " ".join(f"{k}={fields.get(k)}" for k in keys)


def _summary(output: str) -> dict[str, str]:
    line = next((ln for ln in output.splitlines() if "summary:" in ln), None)
    assert line is not None, f"no summary line in the job output:\n{output[-4000:]}"
    tokens = line.split("summary:", 1)[1].split()
    return dict(zip(tokens[::2], tokens[1::2], strict=False))


def _check(fields: dict[str, str], output: str, log_dir: Path, steps: int) -> dict[str, str]:
    detail = f"{_brief(fields)}\n--- job output ---\n{output[-4000:]}"
    assert fields.get("JobState") == "COMPLETED", detail
    assert fields.get("ExitCode") == "0:0", detail
    s = _summary(output)
    assert s["ranks"] == "2" and s["compression"] == "3lc" and s["steps"] == str(steps), s
    assert float(s["traffic_saved"].rstrip("%")) > 80, s
    rows = (log_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,epoch,loss,test_acc,bytes_sent"), rows[0]
    assert len(rows) == steps + 1, f"{len(rows) - 1} metric rows for {steps} steps"
    return s


def test_single_node_sbatch_srun_pmix_2_ranks(slurm_env, tmp_path):
    """slurm/train_single_node.sbatch: srun --mpi=pmix, Horovod backend, 3LC."""
    data = [] if FMNIST.exists() else ["--dataset", "synthetic"]
    # --no-tuning: 3LC on every step (tuned, auto may send this model dense on one node's
    # loopback: tests/mpi/test_tuning.py), so that the bytes saved below are 3LC's
    extra = " ".join([*data, "--steps", str(STEPS), "--no-progress", "--no-tuning"])
    fields, output = _submit_and_wait(
        slurm_env, "train_single_node.sbatch", tmp_path, COMPRESSION="3lc", EXTRA_ARGS=extra
    )
    s = _check(fields, output, tmp_path / "log", STEPS)
    assert s["backend"] == "horovod", s
    assert float(s["last_loss"]) < float(s["first_loss"]), s


def test_multi_node_sbatch_horovodrun_2_ranks(slurm_env, tmp_path):
    """slurm/train_multi_node.sbatch with LAUNCHER=horovodrun, on the one node there is.

    A tiny synthetic model: this checks the launcher path (host list from Slurm, horovodrun
    inside the allocation), the training itself is checked above.
    """
    steps = 8
    extra = f"--dataset synthetic --synthetic-size 2048 --width 4 --steps {steps} --no-progress"
    fields, output = _submit_and_wait(
        slurm_env, "train_multi_node.sbatch", tmp_path, LAUNCHER="horovodrun",
        COMPRESSION="3lc", EXTRA_ARGS=extra, BATCH_SIZE="16",
    )  # fmt: skip
    s = _check(fields, output, tmp_path / "log", steps)
    assert s["exchange"] == "auto", s  # the script's default EXCHANGE


def test_multi_node_sbatch_srun_hierarchical_exchange_2_ranks(slurm_env, tmp_path):
    """slurm/train_multi_node.sbatch with LAUNCHER=srun (--mpi=pmix), backend mpi4py and
    EXCHANGE=hierarchical; HVDC_RANKS_PER_NODE=1 makes the 2 ranks of the one node play
    2 nodes, so the exchange's cross-node stage runs (the flag reaches train.py)."""
    steps = 8
    extra = f"--dataset synthetic --synthetic-size 2048 --width 4 --steps {steps} --no-progress"
    fields, output = _submit_and_wait(
        slurm_env, "train_multi_node.sbatch", tmp_path, LAUNCHER="srun", BACKEND="mpi4py",
        EXCHANGE="hierarchical", HVDC_RANKS_PER_NODE="1", COMPRESSION="3lc",
        EXTRA_ARGS=extra, BATCH_SIZE="16",
    )  # fmt: skip
    s = _check(fields, output, tmp_path / "log", steps)
    assert s["exchange"] == "hierarchical" and s["backend"] == "mpi4py", s
