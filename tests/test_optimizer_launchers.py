"""DistributedOptimizer and scripts/train.py under real launchers (mpirun, horovodrun).

Each test starts its own job as a subprocess with a hard timeout, so a hang fails the
test instead of the suite. Skipped, with the reason, when mpirun (or horovodrun) is
missing. Run in the plain pytest stage, not under mpirun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TRAIN = str(ROOT / "scripts" / "train.py")
HOROVODRUN = shutil.which("horovodrun") or str(Path(PY).with_name("horovodrun"))

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
needs_horovod = pytest.mark.skipif(
    subprocess.run([PY, "-c", "import horovod.torch"], capture_output=True).returncode != 0
    or not Path(HOROVODRUN).exists(),
    reason="horovod.torch (with horovodrun) is not installed",
)


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # No single-copy CMA (refused in containers); also reaches horovodrun's own mpirun.
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    env["PATH"] = f"{Path(PY).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
    return env


# a native abort at exit (docs/checkpoints-and-faults.md, "Clean exits")
NATIVE_ABORT = re.compile(r"terminate called|Aborted|core dumped|Segmentation fault")
MPIRUN = ["mpirun", "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1"]


def _run(cmd, timeout: int) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, time.monotonic() - t0


def _summary(out: str) -> dict[str, str]:
    line = next((ln for ln in out.splitlines() if "summary:" in ln), None)
    assert line is not None, f"no summary line in output:\n{out[-3000:]}"
    tokens = line.split("summary:", 1)[1].split()
    return dict(zip(tokens[::2], tokens[1::2], strict=False))


TINY = ["--dataset", "synthetic", "--synthetic-size", "2048", "--width", "4",
        "--batch-size", "16", "--no-progress", "--lr", "0.05"]  # fmt: skip


@needs_horovod
def test_train_under_horovodrun_np4_loss_goes_down(tmp_path):
    # --no-tuning: 3LC on every step (tuned, this tiny model goes dense on a fast link:
    # tests/mpi/test_tuning.py); the tuner's decisions are printed as they are made
    cmd = [HOROVODRUN, "-np", "4", PY, TRAIN, *TINY, "--width", "8", "--steps", "24",
           "--compression", "3lc", "--no-tuning", "--log-dir", str(tmp_path)]  # fmt: skip
    proc, _ = _run(cmd, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not NATIVE_ABORT.search(proc.stdout + proc.stderr), proc.stderr[-3000:]
    s = _summary(proc.stdout)
    assert s["ranks"] == "4" and s["steps"] == "24"
    assert float(s["last_loss"]) < float(s["first_loss"]) - 0.2, s
    assert float(s["traffic_saved"].rstrip("%")) > 80, s
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(rows) == 25 and rows[0].startswith("step,epoch,loss,test_acc,bytes_sent")
    assert list(tmp_path.glob("events.out.tfevents.*")), "no TensorBoard events written"


@needs_horovod
def test_horovodrun_np10_oversubscribed_tiny_model_finishes():
    """The command users type, with 10 ranks on this 2-core machine."""
    cmd = [HOROVODRUN, "-np", "10", "-H", "localhost:10", PY, TRAIN, *TINY, "--steps", "4",
           "--compression", "3lc", "--threads", "1"]  # fmt: skip
    proc, _ = _run(cmd, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(proc.stdout)
    assert s["ranks"] == "10" and s["backend"] == "horovod" and s["steps"] == "4", s


@needs_mpirun
def test_train_np10_oversubscribed_tiny_model_finishes():
    cmd = [*MPIRUN, "-np", "10", PY, TRAIN, *TINY, "--backend", "mpi4py", "--steps", "4",
           "--compression", "3lc", "--threads", "1"]  # fmt: skip
    proc, _ = _run(cmd, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not NATIVE_ABORT.search(proc.stdout + proc.stderr), proc.stderr[-3000:]
    s = _summary(proc.stdout)
    assert s["ranks"] == "10" and s["steps"] == "4", s


@needs_mpirun
def test_train_resume_equals_uninterrupted(tmp_path):
    base = [*MPIRUN, "-np", "2", PY, TRAIN, *TINY, "--backend", "mpi4py", "--compression", "3lc"]
    full, _ = _run([*base, "--steps", "8"], timeout=200)
    first, _ = _run([*base, "--steps", "4", "--checkpoint", str(tmp_path)], timeout=200)
    rest, _ = _run([*base, "--steps", "8", "--checkpoint", str(tmp_path), "--resume"], timeout=200)
    for proc in (full, first, rest):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.glob("rank*"))  # hvdcompress.checkpoint files
    assert names == ["rank0.step000000004.ckpt", "rank0.step000000008.ckpt",
                     "rank1.step000000004.ckpt", "rank1.step000000008.ckpt"]  # fmt: skip
    assert _summary(rest.stdout)["param_digest"] == _summary(full.stdout)["param_digest"]
    assert _summary(first.stdout)["param_digest"] != _summary(full.stdout)["param_digest"]


def test_train_missing_dataset_names_the_debian_package(tmp_path):
    proc, _ = _run([PY, TRAIN, "--backend", "mpi4py", "--data-dir", str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    assert "dataset-fashion-mnist" in proc.stderr, proc.stderr[-2000:]


RANK_DIES = textwrap.dedent(
    """
    import os, torch, hvdcompress
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    model = torch.nn.Linear(64, 8)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend="mpi4py")
    for step in range(1000):
        if rank == 1 and step == 3:
            os._exit(3)
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    print("rank", rank, "finished: it should have been stopped")
    """
)


@needs_mpirun
def test_a_dead_rank_stops_the_others_in_bounded_time():
    proc, elapsed = _run([*MPIRUN, "-np", "3", PY, "-c", RANK_DIES], timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "finished" not in proc.stdout
    assert elapsed < 60, f"took {elapsed:.0f}s to stop"
    assert re.search(r"exit(ed)? (code|with non-zero status)|non-zero", proc.stderr), proc.stderr


STOCK_HOROVOD = textwrap.dedent(
    """
    import torch, horovod.torch as hvd, hvdcompress
    hvd.init()
    for name in ("none", "fp16"):
        model = torch.nn.Linear(8, 2)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=getattr(hvdcompress.Compression, name))
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        if hvd.rank() == 0:
            print("ok", name, flush=True)
    for comp in (hvdcompress.Compression.bf16, hvdcompress.Compression.threelc(sparsity=1.5)):
      model = torch.nn.Linear(8, 2)
      opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
          named_parameters=model.named_parameters(), compression=comp)
      try:
          model(torch.randn(3, 8)).sum().backward()
          opt.step()
      except TypeError as e:
          if hvd.rank() == 0:
              print("TypeError:", e, flush=True)
    """
)


@needs_horovod
@needs_mpirun
def test_compression_classes_in_stock_horovod_optimizer():
    proc, _ = _run([*MPIRUN, "-np", "2", PY, "-c", STOCK_HOROVOD], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("none", "fp16"):
        assert f"ok {name}" in proc.stdout
    errors = [ln for ln in proc.stdout.splitlines() if "TypeError:" in ln]
    assert len(errors) == 2, proc.stdout  # bf16 (CPU) and 3LC, printed by rank 0
    assert any("cannot allreduce bfloat16" in e for e in errors), errors
    err = next(e for e in errors if "threelc" in e)
    assert "gather-only" in err and "hvdcompress.DistributedOptimizer" in err, err
