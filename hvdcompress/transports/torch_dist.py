"""Collectives over ``torch.distributed`` (gloo on CPU, NCCL on GPUs): see
hvdcompress.transports. The transport of the DDP communication hook (``hvdcompress.ddp``).

Every collective runs when it is started, on the caller's thread (a DDP comm hook runs
on the autograd thread, one bucket at a time, in the same order on every rank), and its
handle is already done. ``start_allgatherv`` pads every rank's bytes to the largest
count. NCCL moves only device tensors, so with it the bytes travel on the current CUDA
device.
"""

from __future__ import annotations

import os

import torch

from hvdcompress.transports.base import Handle, Transport


class _Ready(Handle):
    """A handle whose collective has already run."""

    def __init__(self, result) -> None:
        super().__init__()
        self._finish(result)


class TorchDistTransport(Transport):
    """Collectives over a ``torch.distributed`` process group (default: the world)."""

    name = "torch.distributed"

    def __init__(self, process_group=None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group (torchrun sets its environment)"
            )
        self.dist = dist
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        # torchrun's count of ranks on this node (1 when launched otherwise)
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        nccl = dist.get_backend(process_group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self._device) if self._device is not None else t.cpu()

    def start_allgatherv(self, local: torch.Tensor) -> Handle:
        local = self._on_wire(local.detach().reshape(-1).to(torch.uint8))
        count = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
        counts = [torch.empty_like(count) for _ in range(self.size)]
        self.dist.all_gather(counts, count, group=self.group)
        sizes = [int(c.item()) for c in counts]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=local.device)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self.dist.all_gather(parts, padded, group=self.group)
        gathered = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).cpu()
        return _Ready((gathered, sizes))

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        total = self._on_wire(dense.detach()).clone()
        self.dist.all_reduce(total, op=self.dist.ReduceOp.SUM, group=self.group)
        return _Ready(total.to(dense.device))

    def allgather_object(self, obj) -> list:
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_(self, tensors, root: int = 0) -> None:
        for t in tensors:
            buf = self._on_wire(t.detach()).contiguous()
            self.dist.broadcast(buf, src=root, group=self.group)
            t.data.copy_(buf)

    def sum_floats(self, values) -> list[float]:
        t = self._on_wire(torch.tensor([float(v) for v in values], dtype=torch.float64))
        self.dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)
