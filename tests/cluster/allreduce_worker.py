"""One rank of tests/test_bench_cluster.py, on an emulated cluster (torchrun per node
namespace): an allreduce of 4 MB across the nodes, and what crossed this node's link; then three
steps of DDP with the hook's hierarchical exchange.

Local rank 0 of each node writes OUT/node<g>.json: the allreduce's result check, the
ranks' (global rank, node) as torchrun placed them, the topology hvdcompress detects
(transports.topology), and the bytes its node sent and
received on its link during the allreduce."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hvdcompress.transports import topology  # noqa: E402
from hvdcompress.transports.torch_dist import TorchDistTransport  # noqa: E402
from scripts._bench import cluster  # noqa: E402


def hierarchical_digest(rank: int) -> str:
    """Three steps of DDP with the hook's hierarchical exchange (3LC across the nodes):
    the parameters' digest, which every rank must share."""
    import hashlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcompress

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(net)
    with hvdcompress.DDPHookState("3lc", exchange="hierarchical").register(ddp):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    x = torch.full((1 << 20,), float(rank + 1))  # 4 MB of float32
    dist.barrier()
    before = cluster.link_bytes()
    dist.all_reduce(x)
    dist.barrier()
    after = cluster.link_bytes()
    placed = [None] * size
    dist.all_gather_object(placed, (rank, node))
    nodes = topology.detect(TorchDistTransport()).nodes  # from torchrun's GROUP_RANK
    digests = [None] * size
    dist.all_gather_object(digests, hierarchical_digest(rank))
    if local == 0:
        report = {
            "hierarchical_digests": digests,
            "exact": bool(torch.all(x == size * (size + 1) / 2)),
            "placed": placed,
            "topology": nodes,
            "tx": after[0] - before[0],
            "rx": after[1] - before[1],
        }
        (out / f"node{node}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
