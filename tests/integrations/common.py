"""What the Lightning and Accelerate tests share: their ranks' parameter digest and
difference (tests/integrations/*_worker.py), launching the ranks, and the checks both
frameworks must pass (tests/test_lightning.py, tests/test_accelerate.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def digest(module: torch.nn.Module) -> str:
    """SHA-256 of the parameters and buffers, by name."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return max(float((x - y).abs().max()) for x, y in pairs)


def run(cmd: list[str], out: Path) -> None:
    """Run the ranks' launcher; a failure shows what they wrote and their output."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    written = sorted(f.name for f in out.iterdir())
    assert done.returncode == 0, f"{written}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def check_every_bucket_of_every_step_hooked(reports: list[dict], steps: int) -> None:
    """Each step's hook calls and gradient elements (``[calls, numel]`` per step): at
    least one call (several once DDP has rebuilt its buckets) and every element."""
    for r in reports:
        assert len(r["steps"]) == steps
        calls = [c for c, _ in r["steps"]]
        assert min(calls) >= 1 and max(calls) >= 2  # several buckets (bucket_cap_mb)
        assert all(numel == r["numel"] for _, numel in r["steps"])  # every gradient


def check_bit_identical_and_none_exact(reports: list[dict]) -> None:
    """3LC leaves both ranks bit-identical; compression none equals plain DDP exactly."""
    assert len(set(reports[0]["digests_3lc"])) == 1 and len(reports[0]["digests_3lc"]) == 2
    assert [r["none_vs_plain_max_diff"] for r in reports] == [0.0, 0.0]


def check_resume(reports: list[dict], warning_text: str) -> None:
    """The resumed run equals the uninterrupted one; without the hook states (the
    control) it does not, and says why."""
    for r in reports:
        assert r["resume_equal"] and r["resume_max_diff"] == 0.0
        assert not r["bare_resume_equal"]
        (warning,) = r["bare_warnings"]
        assert warning_text in warning
