"""Collectives through horovod.torch: see hvdcompress.transports."""

from __future__ import annotations

import struct

import torch

from hvdcompress.transports import Handle, Transport, _DoneHandle

_LEN = struct.Struct("<Q")


class HorovodTransport(Transport):
    """Collectives through ``horovod.torch`` (initialised here if the caller has not)."""

    name = "horovod"

    def __init__(self) -> None:
        import horovod.torch as hvd

        if not hvd.is_initialized():
            hvd.init()
        self.hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        self.local_size = hvd.local_size()
        self._count = 0

    def _name(self, kind: str) -> str:
        # Horovod matches collectives across ranks by name: a per-transport counter is the
        # same on every rank because every rank starts collectives in the same order.
        self._count += 1
        return f"hvdcompress.{kind}.{self._count}"

    def start_allgatherv(self, local: torch.Tensor) -> Handle:
        hvd = self.hvd
        local = local.detach().reshape(-1).to(torch.uint8)
        prefix = torch.frombuffer(bytearray(_LEN.pack(local.numel())), dtype=torch.uint8)
        framed = torch.cat([prefix.to(local.device), local])
        if framed.is_cuda and not hvd.gpu_available("torch"):
            framed = framed.cpu()
        handle = hvd.allgather_async(framed, name=self._name("allgatherv"))
        size = self.size

        def finish():
            gathered = hvd.synchronize(handle).cpu()
            return _strip_length_prefixes(gathered, size)

        return _DoneHandle(finish)

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        hvd = self.hvd
        src = dense.detach().contiguous()
        if src.dtype == torch.bfloat16 and not src.is_cuda:
            # Horovod 0.28.1 has no bfloat16 CPU allreduce: gather the bits, sum in rank
            # order in float32 rounding each add to bfloat16 (same on every rank).
            handle = hvd.allgather_async(src.view(torch.int16), name=self._name("bf16sum"))
            n, size = src.numel(), self.size

            def finish():
                parts = hvd.synchronize(handle).view(torch.bfloat16).view(size, n)
                total = parts[0].clone()
                for r in range(1, size):
                    total = (total.float() + parts[r].float()).to(torch.bfloat16)
                return total.to(dense.device)

            return _DoneHandle(finish)
        handle = hvd.allreduce_async(src, name=self._name("allreduce"), op=hvd.Sum)
        return _DoneHandle(lambda: hvd.synchronize(handle).to(dense.device))

    def allgather_object(self, obj) -> list:
        return self.hvd.allgather_object(obj, name=self._name("object"))

    def broadcast_(self, tensors, root: int = 0) -> None:
        for t in tensors:
            buf = t.data if t.data.is_contiguous() else t.detach().contiguous()
            # Horovod 0.28.1 has no bfloat16 on CPU: its bits travel as int16
            bits = buf.view(torch.int16) if buf.dtype == torch.bfloat16 else buf
            self.hvd.broadcast_(bits, root_rank=root, name=self._name("broadcast"))
            if buf is not t.data:
                t.data.copy_(buf)

    def sum_floats(self, values) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        return self.hvd.allreduce(t, op=self.hvd.Sum, name=self._name("sum")).tolist()

    def barrier(self) -> None:
        self.hvd.barrier()


def _strip_length_prefixes(gathered: torch.Tensor, size: int) -> tuple[torch.Tensor, list[int]]:
    """Undo HorovodTransport's framing: ``size`` x (8-byte length, bytes) -> (bytes, sizes)."""
    raw = gathered.numpy()
    parts, sizes, offset = [], [], 0
    for rank in range(size):
        if offset + _LEN.size > raw.size:
            raise RuntimeError(f"allgather: rank {rank}'s length prefix is missing")
        (n,) = _LEN.unpack_from(raw, offset)
        offset += _LEN.size
        if offset + n > raw.size:
            raise RuntimeError(f"allgather: rank {rank} announced {n} bytes, fewer arrived")
        parts.append(gathered[offset : offset + n])
        sizes.append(int(n))
        offset += n
    if offset != raw.size:
        raise RuntimeError(f"allgather: {raw.size - offset} unexpected trailing bytes")
    return torch.cat(parts) if parts else gathered[:0], sizes
