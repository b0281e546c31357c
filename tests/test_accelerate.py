"""hvdcompress.accelerate with the real Hugging Face Accelerate (pinned in setup.cfg's
``accelerate`` extra), CPU ranks started by ``accelerate launch``: every bucket of every
step passes through the hook; ranks end bit-identical; compression none equals
Accelerate's plain DDP exactly; a state saved mid-run (save_state) resumes to the
uninterrupted run's parameters (and without its hook states does not); another world
size, an unprepared model and a one-process run are told clearly. The ranks run
tests/integrations/accelerate_worker.py and report in JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integrations.common import (
    check_bit_identical_and_none_exact,
    check_every_bucket_of_every_step_hooked,
    check_resume,
    run,
)

WORKER = Path(__file__).parent / "integrations" / "accelerate_worker.py"
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip


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
    check_every_bucket_of_every_step_hooked(reports, steps=24)
    assert all(0 < r["bits_per_value"] < 2 for r in reports)


def test_ranks_end_bit_identical_and_none_equals_accelerates_plain_ddp(reports):
    check_bit_identical_and_none_exact(reports)


def test_save_state_mid_run_resumes_to_the_uninterrupted_parameters(reports):
    for r in reports:
        assert r["state_files"] == ["hvdcompress_model0_rank0.pt", "hvdcompress_model0_rank1.pt"]
    check_resume(reports, "no hvdcompress state")


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
