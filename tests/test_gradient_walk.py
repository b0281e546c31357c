"""scripts/gradient_walk.py, the project's measure of one gradient's path (docs/design.md,
"The gradient walk"): both paths run, trace the package's own modules in the order the
docs describe, and report counts the docs' table can quote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _walk(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMPI_MCA_btl="self,vader")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gradient_walk.py"), "--numel", "2000", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


@pytest.mark.parametrize(
    "args, adapter",
    [((), "optimizer/wrapper.py"), (("--ddp",), "ddp/hook.py")],
    ids=["optimizer", "ddp"],
)
def test_the_walk_traces_its_path_from_the_adapter_to_the_backend(args, adapter):
    out = _walk(*args)
    order = re.search(r"modules in visiting order: (.*)", out).group(1).split(" -> ")
    assert order[0] == adapter
    # both adapters hand the bucket to the one reducer, which drives the exchange
    assert order.index("reducer.py") < order.index("exchange/allgather.py"), order
    for module in ("exchange/allgather.py", "compressors/threelc.py", "wire.py"):
        assert module in order, order
    assert any(m.startswith("backends/cpu/") for m in order), order
    files, reversals = map(int, re.search(r"files: (\d+);.*reversals: (\d+)", out).groups())
    assert files == len(set(order)) and reversals >= 2
    layers = re.search(r"layers: ([\d ]+)", out).group(1).split()
    assert layers[0] == "0" and "4" in layers  # from the adapters down to the backends
