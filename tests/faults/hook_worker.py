"""One rank of tests/faults/test_hook_faults.py under torchrun (gloo, an 8 s process-group
timeout): the DDP hook meeting each fault of issue 58 as a new user would.

    torchrun ... tests/faults/hook_worker.py FAULT OUT_DIR [PHASE]

Writes OUT_DIR/rank<r>.json: what the rank saw (``error``, ``message``, ``payload_rank``,
``seconds`` from the start to the error) and, for ``residuals``, the residual values it
held after each step. FAULT ``raise`` lets the user's exception end the process, as a
training script would.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdcompress
from hvdcompress.transports.torch_dist import TorchDistTransport

TIMEOUT = timedelta(seconds=8)
TUNING = hvdcompress.Tuning(warmup_steps=1, steps_per_option=1, recheck_every=0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    )  # fmt: skip


def train(ddp, state, steps: int, rank: int, start: int = 0, each=None) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        if each is not None:
            each(step)


def residual_values(state) -> int:
    memory = state.compressor.memory
    return sum(e.numel() for e in memory.residuals.values()) if memory is not None else 0


def slowed(compressor, seconds: float = 0.08):
    """``compressor`` as an instance of a subclass whose encodes sleep first: it costs more
    than it saves, so the tuner ends on the dense allreduce (the issue's case). A subclass,
    not patched methods, so that the copies the exchange chooser probes stay copies."""
    cls = type(compressor)

    def compress(self, *args, **kwargs):
        time.sleep(seconds)
        return cls.compress(self, *args, **kwargs)

    def encode_bucket(self, *args, **kwargs):
        time.sleep(seconds)
        return cls.encode_bucket(self, *args, **kwargs)

    slow = type(
        f"Slow{cls.__name__}", (cls,), {"compress": compress, "encode_bucket": encode_bucket}
    )
    compressor.__class__ = slow
    return compressor


def corrupt_on(rank: int, bad: int, stage: str) -> None:
    """On rank ``bad``, flip the length table of every frame sent at ``stage``."""
    if rank != bad:
        return
    start = TorchDistTransport.start_allgatherv

    def corrupt(self, frame, *, key=None):
        if key is not None and key[1] == stage:
            frame = frame.clone()
            frame[8:16].view(torch.int64).add_(1)
        return start(self, frame, key=key)

    TorchDistTransport.start_allgatherv = corrupt


class UserError(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the user's error in backward")


def run(fault: str, out: Path, phase: str, rank: int, record: dict) -> None:
    """The fault's program; the hook's state goes into ``record["state"]`` (closed by
    ``main`` after a clean run, as the README's with-block does)."""
    record["state"] = None
    state = _run(fault, out, phase, rank, record)
    record["state"] = state


def _run(fault: str, out: Path, phase: str, rank: int, record: dict):
    size = dist.get_world_size()
    net = model()
    ddp = DDP(net)
    exchange = os.environ.get("HOOK_EXCHANGE", "auto")
    if fault == "agree":  # one rank with another exchange
        exchange = "allgather" if rank == 1 else "twostage"
        state = hvdcompress.DDPHookState("3lc", exchange=exchange, tuning=None).register(ddp)
        train(ddp, state, 2, rank)
    elif fault == "env":  # HOVOD-like variable set on one rank (or one agent by the test)
        if rank == 1 and "HOOK_BAD_ENV" in os.environ:
            os.environ["HVDC_RANKS_PER_NODE"] = os.environ["HOOK_BAD_ENV"]
        comp = os.environ.get("HOOK_COMPRESSION", "3lc")
        state = hvdcompress.DDPHookState(comp, exchange=exchange, tuning=None).register(ddp)
        train(ddp, state, 2, rank)
    elif fault == "checkpoint":  # PHASE save, then load in another job
        state = hvdcompress.DDPHookState("3lc", exchange=exchange, tuning=None).register(ddp)
        path = out / f"state{rank}.pt"
        if phase == "save":
            train(ddp, state, 3, rank)
            torch.save(state.state_dict(), path)
        else:
            state.load_state_dict(torch.load(path, weights_only=True))
            train(ddp, state, 2, rank, start=3)
    elif fault == "corrupt":  # rank 2's frame across nodes (2 x 2) or to all (1 x 4)
        state = hvdcompress.DDPHookState("3lc", exchange=exchange, tuning=None).register(ddp)
        corrupt_on(rank, 2, "allgather")
        train(ddp, state, 2, rank)
    elif fault == "residuals":  # the tuner's options on a codec slower than dense
        comp = slowed(hvdcompress.get_compressor("3lc"))
        state = hvdcompress.DDPHookState(comp, tuning=TUNING).register(ddp)
        held = record.setdefault("held", [])
        train(ddp, state, 12, rank, each=lambda step: held.append(residual_values(state)))
        record["numel"] = sum(p.numel() for p in net.parameters())
        record["current"] = sorted(set(state.exchange_tuner.current.values()))
        record["size"] = size
    elif fault == "raise":  # the user's exception ends the process
        state = hvdcompress.DDPHookState("3lc", tuning=None).register(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(3):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step + rank))
            y = ddp(x)
            if rank == 1 and step == int(os.environ.get("HOOK_RAISE_STEP", "2")):
                y = UserError.apply(y)
            opt.zero_grad()
            y.square().mean().backward()
            opt.step()
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    return state


def main() -> None:
    fault, out = sys.argv[1], Path(sys.argv[2])
    phase = sys.argv[3] if len(sys.argv) > 3 else ""
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank = dist.get_rank()
    record: dict = {"rank": rank, "error": None}
    t0 = time.monotonic()
    try:
        run(fault, out, phase, rank, record)
    except Exception as err:
        if fault == "raise":
            raise
        found = hvdcompress.payload_error(err)
        record.update(
            error=type(err).__name__, message=str(err)[:2000],
            payload_rank=None if found is None else found.rank,
        )  # fmt: skip
    record["seconds"] = time.monotonic() - t0
    state = record.pop("state", None)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if record["error"] is None:
        state.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
