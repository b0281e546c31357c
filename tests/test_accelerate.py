"""hvdcompress.accelerate with the real Hugging Face Accelerate (pinned in setup.cfg's
``accelerate`` extra), CPU ranks started by ``accelerate launch``: every bucket of every
step passes through the hook; ranks end bit-identical; compression none equals
Accelerate's plain DDP exactly; a state saved mid-run (save_state) resumes to the
uninterrupted run's parameters (and without its hook states does not); another world
size, an unprepared model and a one-process run are told clearly. The ranks run
tests/integrations/accelerate_worker.py and report in JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "integrations" / "accelerate_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip


def run(cmd, out: Path) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    written = sorted(f.name for f in out.iterdir())
    assert done.returncode == 0, f"{written}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    run([*LAUNCH, "--num_processes", "2", str(WORKER), str(out)], out)
    return out


@pytest.fixture(scope="module")
def reports(run_dir):
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_accelerate_launch_runs_ddp_over_gloo(reports):
    assert [r["kind"] for r in reports] == ["DistributedType.MULTI_CPU"] * 2


def test_every_bucket_of_every_step_passes_through_the_hook(reports):
    for r in reports:
        assert len(r["steps"]) == 24
        calls = [c for c, _ in r["steps"]]
        assert min(calls) >= 1 and max(calls) >= 2  # several buckets (bucket_cap_mb)
        assert all(numel == r["numel"] for _, numel in r["steps"])
        assert 0 < r["bits_per_value"] < 2


def test_ranks_end_bit_identical(reports):
    assert len(set(reports[0]["digests_3lc"])) == 1 and len(reports[0]["digests_3lc"]) == 2


def test_compression_none_equals_accelerates_plain_ddp_exactly(reports):
    assert [r["none_vs_plain_max_diff"] for r in reports] == [0.0, 0.0]


def test_save_state_mid_run_resumes_to_the_uninterrupted_parameters(reports):
    for r in reports:
        assert r["state_files"] == ["hvdcompress_model0_rank0.pt", "hvdcompress_model0_rank1.pt"]
        assert r["resume_equal"] and r["resume_max_diff"] == 0.0
        assert not r["bare_resume_equal"]  # the control: without the hook states it differs
        (warning,) = r["bare_warnings"]
        assert "no hvdcompress state" in warning


def test_register_refuses_a_model_accelerate_did_not_prepare(reports):
    assert reports[0]["unprepared_error"].startswith(
        "TypeError: hvdcompress.accelerate.register needs"
    )


def test_load_state_on_another_world_size_fails_clearly_on_every_rank(run_dir):
    run(
        [
            *LAUNCH,
            "--num_processes",
            "3",
            str(WORKER),
            str(run_dir),
            "--resume",
            str(run_dir / "state"),
        ],
        run_dir,
    )
    errors = [json.loads((run_dir / f"resume{r}.json").read_text())["error"] for r in range(3)]
    assert all(e and "world size" in e for e in errors), errors
    assert errors[2].startswith("FileNotFoundError") and "none of rank 2 of 3" in errors[2]


def test_one_process_registers_nothing_and_says_why(tmp_path):
    run([sys.executable, str(WORKER), str(tmp_path), "--one-process"], tmp_path)
    report = json.loads((tmp_path / "one_process.json").read_text())
    assert report["kind"] == "DistributedType.NO" and report["state"] == "None"
    (warning,) = report["warnings"]
    assert "nothing to compress" in warning
