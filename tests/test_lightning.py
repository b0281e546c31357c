"""hvdcompress.lightning with the real PyTorch Lightning (pinned in setup.cfg's
``lightning`` extra), 2 CPU ranks under torchrun: every bucket of every step passes
through the hook; ranks end bit-identical; compression none equals Lightning's plain DDP
exactly; a mid-run checkpoint resumes to the uninterrupted run's parameters (and without
its hook states does not); the silent-CPU trap warns; wrong setups fail clearly. The
ranks run tests/integrations/lightning_worker.py and report in JSON."""

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

WORKER = Path(__file__).parent / "integrations" / "lightning_worker.py"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(WORKER), str(out)]  # fmt: skip
    run(cmd, out)
    return out


@pytest.fixture(scope="module")
def reports(run_dir):
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_every_bucket_of_every_step_passes_through_the_hook(reports):
    check_every_bucket_of_every_step_hooked(reports, steps=40)  # 2 epochs of 20 steps


def test_ranks_end_bit_identical_and_none_equals_lightnings_plain_ddp(reports):
    check_bit_identical_and_none_exact(reports)


def test_a_mid_run_checkpoint_resumes_to_the_uninterrupted_parameters(reports):
    for r in reports:
        assert r["checkpoints"] == ["epoch=0-step=20.ckpt"] and r["saved_ranks"] == 2
    check_resume(reports, "no hvdcompress hook state")


def test_bits_per_value_and_bytes_reach_lightnings_logger(reports):
    keys = set(reports[0]["logged_keys"])
    assert {
        "hvdcompress/bits_per_value",
        "hvdcompress/sent_bytes",
        "hvdcompress/payload_bytes",
    } <= keys
    assert reports[0]["logged_bits"] and all(0 < b < 2 for b in reports[0]["logged_bits"])


def test_lightnings_own_ddp_strategy_on_cpu_warns_that_the_hook_never_ran(reports):
    for r in reports:
        assert r["trap_hook_calls"] == 0
        (warning,) = r["trap_warnings"]
        assert "CompressedDDPStrategy" in warning


def test_resuming_on_another_world_size_fails_clearly(run_dir):
    ckpt = run_dir / "ckpt" / "epoch=0-step=20.ckpt"
    run([sys.executable, str(WORKER), str(run_dir), "--resume-on-one", str(ckpt)], run_dir)
    error = json.loads((run_dir / "resume_on_one.json").read_text())["error"]
    assert error.startswith("CheckpointError: resuming from") and "different world size" in error
    assert "'hvdcompress' entry" in error


def test_the_strategy_refuses_a_comm_hook_of_its_own_and_unknown_codecs():
    import hvdcompress
    from hvdcompress.lightning import CompressedDDPStrategy

    with pytest.raises(ValueError, match="takes no ddp_comm_hook"):
        CompressedDDPStrategy("3lc", ddp_comm_hook=hvdcompress.ddp_hook)
    with pytest.raises(ValueError, match="no-such-codec"):
        CompressedDDPStrategy("no-such-codec")
    strategy = CompressedDDPStrategy("topk", find_unused_parameters=True, bucket_cap_mb=1)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 1}
