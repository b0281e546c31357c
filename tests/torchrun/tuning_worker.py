"""One rank of tests/test_exchange_tuning_real.py, under torchrun (gloo): DDP with
``DDPHookState("3lc")`` and a short ``Tuning``, so that ``exchange="auto"`` times its
options within a few steps.

    torchrun --standalone --nproc_per_node 3 tests/torchrun/tuning_worker.py OUT_DIR MODE

MODE "slow-codec": every 3LC encode takes 80 ms more (a codec that costs more than the
bytes it saves, as on a fast link); "plain": 3LC as it is (the test runs it behind a slow
link). Writes OUT_DIR/rank<r>.json: the decisions, the options every part keeps, the
options of the last step (``last_stats.exchanges``), which steps were trial steps, and
a digest of the parameters. MODE "bf16-held" / "fp16-held": every part held on that
16-bit option after the first step (no round ever starts), a checkpoint taken at step 4
and resumed into a new model, hook and optimizer (``half_main``).
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


def _digest(net) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _held_job(half: str, rank: int):
    """A model, its DDP, a hook state whose tuner never starts a round, and SGD."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 4))
    ddp = DDP(net)
    hold = hvdcompress.Tuning(warmup_steps=10**6, half=half)
    state = hvdcompress.DDPHookState("3lc", tuning=hold).register(ddp)
    return net, ddp, state, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)


def _held_steps(net, ddp, state, opt, rank: int, steps: range, half: str, guess: set) -> list:
    """``steps`` on the rank's batches: a step in ``guess`` on the tuner's first guess (as
    a new or resumed job's first step), every other one on ``half`` (as a round that timed
    it fastest leaves it). Per step its options, and its bytes where it was on ``half``
    (the first guess's 3LC payload differs from rank to rank)."""
    seen, first = [], {}
    tuner = state.exchange_tuner
    for step in steps:
        if tuner is not None and tuner.current:
            first = first or dict(tuner.current)
            tuner.current.update(first if step in guess else dict.fromkeys(first, half))
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        tuner = state.exchange_tuner
        first = first or dict(tuner.current)  # the buckets are known after the first step
        stats = state.last_stats
        labels = sorted(set(stats.exchanges.values()))
        counted = step not in guess
        seen.append({"labels": labels, "payload": stats.payload_bytes if counted else None,
                     "sent": stats.sent_bytes if counted else None})  # fmt: skip
    return seen


def half_main(out: Path, half: str) -> None:
    """MODE "<half>-held": 8 steps in one go, and 4 + a resume + 4; both take the first
    guess at steps 0 and 4 (a resumed job's tuner starts anew) and ``half`` at the others,
    so the resume must give the uninterrupted run's parameters bit for bit."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    guess = {0, 4}
    net, ddp, state, opt = _held_job(half, rank)
    with state:
        whole = _held_steps(net, ddp, state, opt, rank, range(8), half, guess)
    digest = _digest(net)
    net, ddp, state, opt = _held_job(half, rank)
    with state:
        _held_steps(net, ddp, state, opt, rank, range(4), half, guess)
        saved = {"net": net.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    torch.manual_seed(1)
    resumed = _held_job(half, rank)
    resumed[0].load_state_dict(saved["net"])
    resumed[3].load_state_dict(saved["opt"])
    resumed[2].load_state_dict(saved["hook"])
    with resumed[2]:
        after = _held_steps(*resumed, rank, range(4, 8), half, guess)
    numel = sum(p.numel() for p in net.parameters())
    record = {"whole": whole, "after": after, "numel": numel, "digest": digest,
              "resumed_digest": _digest(resumed[0])}  # fmt: skip
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
    if sys.argv[2].endswith("-held"):
        half_main(Path(sys.argv[1]), sys.argv[2].removesuffix("-held"))
    else:
        main(Path(sys.argv[1]), sys.argv[2])
