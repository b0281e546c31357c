"""One rank of tests/test_slots.py (gloo, file store): keyed collectives on
torch.distributed (hvdcompress.transports.slots) and the exchanges over them.

    python tests/torchrun/slots_worker.py OUT_DIR RANK WORLD_SIZE

Writes OUT_DIR/rank<r>.json: the checks of tests/slots_cases.py on the inline and the
threaded transport, the rounds and parameter digests of DistributedOptimizer steps with
the allgather and the two-stage exchange (with keys, and with capacities always 0:
today's two rounds per collective), and what a forged stage-1 slot header raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hvdcompress
from hvdcompress.errors import PayloadError
from hvdcompress.transports import slots
from hvdcompress.transports.torch_dist import TorchDistTransport
from tests import slots_cases


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )  # fmt: skip


def digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def unkeyed():
    """Every key forgotten at once: capacity 0, the two rounds of the path before keys."""
    real = slots.Capacities.slot
    slots.Capacities.slot = lambda self, op, key, pair=None: real(self, op, None, pair)
    try:
        yield
    finally:
        slots.Capacities.slot = real


def train(exchange: str, rank: int, steps: int = 5, forge_stage1: bool = False) -> dict:
    t = TorchDistTransport()
    model = make_model()
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend=t, exchange=exchange, fusion_threshold=800,
    )  # fmt: skip
    if forge_stage1 and rank == 1:  # its stage-1 slots announce 2**61 bytes
        start = t.start_alltoallv

        def forging(parts, **kw):
            with slots_cases.forged_header((1 << 61) << 1):
                return start(parts, **kw)

        t.start_alltoallv = forging
    rounds, collectives, error = [], [], None
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(16, 12, generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), (x[:, :3] * 3).argmax(1)).backward()
        try:
            opt.step()
        except PayloadError as err:
            error = [err.field, err.rank, str(err)]
            break
        rounds.append(opt.last_stats.rounds)
        collectives.append(opt.last_stats.collectives)
    kinds = sorted({opt.reducer.planned(b).kind for b in opt.buckets})
    return {"rounds": rounds, "collectives": collectives, "digest": digest(model),
            "error": error, "kinds": kinds, "buckets": len(opt.buckets)}  # fmt: skip


def main() -> None:
    out, rank, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=size
    )
    report = {}
    inline = TorchDistTransport()
    report["allgatherv"] = slots_cases.allgatherv_case(inline)
    report["alltoallv"] = slots_cases.alltoallv_case(inline)
    report["forged"] = slots_cases.forged_case(inline, liar=1)
    threaded = TorchDistTransport(threaded=True)
    report["allgatherv_threaded"] = slots_cases.allgatherv_case(threaded)
    threaded.close()
    for exchange in ("allgather", "twostage"):
        report[exchange] = train(exchange, rank)
        with unkeyed():
            report[f"{exchange}_unkeyed"] = train(exchange, rank)
    report["twostage_forged"] = train("twostage", rank, steps=2, forge_stage1=True)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
