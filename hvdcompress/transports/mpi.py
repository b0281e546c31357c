"""Collectives over mpi4py: see hvdcompress.transports."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from hvdcompress.transports import Handle, Transport


def _add_16bit(dtype: torch.dtype):
    """An MPI user op that sums 2-byte floats in float32 and rounds back (Horovod's rule)."""

    def add(inbuf, outbuf, datatype) -> None:
        a = torch.frombuffer(inbuf, dtype=dtype)
        b = torch.frombuffer(outbuf, dtype=dtype)
        b.copy_(a.float() + b.float())

    return add


_OPS_16BIT: dict = {}


def _sum_ops_16bit(MPI) -> dict:
    """The float16/bfloat16 sum ops, created once per process (MPI allows few user ops)."""
    if not _OPS_16BIT:
        for dtype in (torch.float16, torch.bfloat16):
            _OPS_16BIT[dtype] = MPI.Op.Create(_add_16bit(dtype), commute=True)
    return _OPS_16BIT


class MPITransport(Transport):
    """Collectives over an mpi4py communicator (default ``COMM_WORLD``); see module doc."""

    name = "mpi4py"

    def __init__(self, comm=None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective, like Dup below
        self.local_size = node.Get_size()
        node.Free()
        self._data_comm = self.comm.Dup()  # the worker's collectives never meet ours
        self._ops = _sum_ops_16bit(MPI)
        self._mpi_types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.float16: MPI.UINT16_T,
            torch.bfloat16: MPI.UINT16_T,
        }
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="hvdcompress-mpi", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            job, handle = self._queue.get()
            handle.began = time.perf_counter()  # queued until now behind earlier jobs
            try:
                handle._finish(job())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                handle._finish(error=err)

    def _submit(self, job: Callable[[], object]) -> Handle:
        handle = Handle()
        self._queue.put((job, handle))
        return handle

    def start_allgatherv(self, local: torch.Tensor) -> Handle:
        buf = np.ascontiguousarray(local.detach().cpu().numpy(), dtype=np.uint8)
        MPI, comm = self.MPI, self._data_comm

        def job():
            sizes = np.zeros(self.size, dtype=np.int64)
            comm.Allgather(np.array([buf.size], dtype=np.int64), sizes)
            displs = np.zeros(self.size, dtype=np.int64)
            displs[1:] = np.cumsum(sizes)[:-1]
            recv = np.empty(int(sizes.sum()), dtype=np.uint8)
            comm.Allgatherv(
                [buf, MPI.UNSIGNED_CHAR],
                [recv, (sizes.tolist(), displs.tolist()), MPI.UNSIGNED_CHAR],
            )
            return torch.from_numpy(recv), [int(s) for s in sizes]

        return self._submit(job)

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        if dense.dtype not in self._mpi_types:
            raise TypeError(f"mpi4py transport cannot sum {dense.dtype}")
        src = dense.detach().cpu().contiguous()
        device = dense.device
        mpi_type = self._mpi_types[src.dtype]
        op = self._ops.get(src.dtype, self.MPI.SUM)
        comm = self._data_comm

        def job():
            out = torch.empty_like(src)
            send = src.view(torch.uint16) if src.element_size() == 2 else src
            recv = out.view(torch.uint16) if out.element_size() == 2 else out
            comm.Allreduce([send.numpy(), mpi_type], [recv.numpy(), mpi_type], op=op)
            return out.to(device)

        return self._submit(job)

    def allgather_object(self, obj) -> list:
        return self.comm.allgather(obj)

    def broadcast_(self, tensors, root: int = 0) -> None:
        for t in tensors:  # the raw bytes: any dtype, bit-exact
            buf = t.detach().cpu().contiguous()
            self.comm.Bcast([buf.reshape(-1).view(torch.uint8).numpy(), self.MPI.BYTE], root=root)
            t.data.copy_(buf)

    def sum_floats(self, values) -> list[float]:
        send = np.array(values, dtype=np.float64)
        recv = np.empty_like(send)
        self.comm.Allreduce(send, recv, op=self.MPI.SUM)
        return recv.tolist()

    def barrier(self) -> None:
        self.comm.Barrier()
