"""One rank of tests/test_bench_cluster.py, on an emulated cluster (torchrun per node
namespace): an allreduce of 4 MB across the nodes, and what crossed this node's link.

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
    if local == 0:
        report = {
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
