"""One rank of tests/test_exchange_tuning_real.py, under torchrun (gloo): DDP with
``DDPHookState("3lc")`` and a short ``Tuning``, so that ``exchange="auto"`` times its
options within a few steps.

    torchrun --standalone --nproc_per_node 3 tests/torchrun/tuning_worker.py OUT_DIR MODE

MODE "slow-codec": every 3LC encode takes 80 ms more (a codec that costs more than the
bytes it saves, as on a fast link); "plain": 3LC as it is (the test runs it behind a slow
link). Writes OUT_DIR/rank<r>.json: the decisions, the options every part keeps, the
options of the last step (``last_stats.exchanges``), which steps were trial steps, and
a digest of the parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcompress

STEPS = 16
TUNING = hvdcompress.Tuning(warmup_steps=2, steps_per_option=2, recheck_every=0)


def slowed(compressor, seconds: float = 0.08):
    """``compressor`` whose encodes sleep ``seconds`` first (its copies too)."""

    def sleeping(method):
        def slow(*args, **kwargs):
            time.sleep(seconds)
            return method(*args, **kwargs)

        return slow

    for method in ("compress", "encode_bucket"):
        setattr(compressor, method, sleeping(getattr(compressor, method)))
    return compressor


def main(out: Path, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))
    ddp = DDP(net)
    compressor = hvdcompress.get_compressor("3lc")
    if mode == "slow-codec":
        compressor = slowed(compressor)
    state = hvdcompress.DDPHookState(compressor, tuning=TUNING).register(ddp)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    trials = []
    with state:
        for step in range(STEPS):
            x = torch.randn(16, 512, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
            trials.append(state.last_stats.tuning)
        tuner = state.exchange_tuner
        h = hashlib.sha256()
        for p in net.parameters():
            h.update(p.detach().numpy().tobytes())
        record = {
            "decisions": [str(d) for d in tuner.decisions],
            "seconds": [d.seconds for d in tuner.decisions],
            "current": sorted(tuner.current.values()),
            "last": sorted(set(state.last_stats.exchanges.values())),
            "trials": trials,
            "digest": h.hexdigest(),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def torchrun(out: Path, mode: str, prefix: list[str], port: int) -> list[dict]:
    """Run this worker on 3 ranks (``prefix``: e.g. ``ip netns exec NS``); the records of
    the ranks, which must be equal: decisions, options, trial steps and digest."""
    cmd = [
        *prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--nproc_per_node", "3", "--master_addr", "127.0.0.1", "--master_port", str(port),
        __file__, str(out), mode,
    ]  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert records[0] == records[1] == records[2]
    return records


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
