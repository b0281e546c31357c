"""Transports: move payloads between ranks (docs/design.md section 1, "transport").

Three operations, each started asynchronously and finished with ``Handle.wait()``:

* ``start_allgatherv(local_uint8)`` -> ``(gathered_uint8, sizes)``: every rank's bytes
  concatenated in rank order, plus each rank's byte count (the gather path of
  gather-only codecs such as 3LC);
* ``start_allreduce_sum(dense)`` -> the elementwise sum over ranks (summable codecs);
* ``allgather_object(obj)`` -> list of every rank's object (small agreement checks;
  blocking).

Blocking helpers for setting up and evaluating a training run (every rank calls them, in
the same order): ``broadcast_(tensors, root=0)`` overwrites each tensor in place with
root's values (identical starting parameters), ``sum_floats(values)`` sums a few floats
over ranks (float64), ``barrier()``; ``local_size`` is the number of ranks on this node.
The base class implements them with ``allgather_object`` (any transport has them); both
real transports override them with native collectives.

Invariant: on every rank, collectives complete in the order they were started, and
every rank receives the same bytes. Callers must start collectives in the same order
on every rank (the optimizer starts buckets in bucket order).

``MPITransport`` uses mpi4py and needs no Horovod: a single background thread runs the
blocking collectives on a duplicated communicator (so they overlap the caller's work,
and agreement checks on the original communicator never interleave with them), in FIFO
order. Sizes are exchanged with ``Allgather`` before ``Allgatherv``. Sums of float16 and
bfloat16 use a user-defined MPI op that adds in float32 and rounds back, as Horovod does.

``HorovodTransport`` uses ``horovod.torch``'s async allgather/allreduce, whose background
thread already overlaps and orders collectives; each rank's bytes travel behind an
8-byte length so that the sizes come with the data in one collective.

Neither module is imported before a transport is built: ``import hvdcompress`` works
without mpi4py or Horovod.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

_LEN = struct.Struct("<Q")


class Handle:
    """The result of a started collective; ``wait()`` returns it or raises its error.

    ``seconds`` (after ``wait``) is how long the collective took: on the mpi4py worker
    thread exactly the MPI calls; for Horovod, whose background thread reports no
    timing, from the enqueue to the end of ``wait`` (an upper bound: it includes time
    queued behind other collectives and, if ``wait`` comes late, idle time).
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self.began = time.perf_counter()
        self.ended: float | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.began

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self.ended = time.perf_counter()
        self._done.set()

    def wait(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"collective did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result


class _DoneHandle(Handle):
    def __init__(self, fn: Callable[[], object]) -> None:
        super().__init__()
        self._fn = fn

    def wait(self, timeout: float | None = None):
        if not self._done.is_set():
            try:
                self._finish(self._fn())
            except BaseException as err:  # noqa: BLE001 - re-raised by Handle.wait
                self._finish(error=err)
        return super().wait(timeout)


class Transport:
    """Interface (see the module docstring). ``rank``, ``size`` and ``local_size`` (ranks on
    this node) are set by subclasses."""

    name = ""
    rank: int = 0
    size: int = 1
    local_size: int = 1

    def start_allgatherv(self, local: torch.Tensor) -> Handle:
        raise NotImplementedError

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        raise NotImplementedError

    def allgather_object(self, obj) -> list:
        raise NotImplementedError

    # ---- blocking helpers; generic versions over allgather_object ------------------------

    def broadcast_(self, tensors, root: int = 0) -> None:
        """Overwrite every tensor of ``tensors`` (in place) with rank ``root``'s values."""
        for t in tensors:
            mine = t.detach().cpu().clone() if self.rank == root else None
            t.data.copy_(self.allgather_object(mine)[root])

    def sum_floats(self, values) -> list[float]:
        """The elementwise sum over ranks of a few floats (float64, the same on every rank)."""
        parts = self.allgather_object([float(v) for v in values])
        return np.sum(np.array(parts, dtype=np.float64).reshape(len(parts), -1), axis=0).tolist()

    def barrier(self) -> None:
        """Return once every rank has called it."""
        self.allgather_object(None)


# ---- mpi4py --------------------------------------------------------------------------------


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


# ---- Horovod -------------------------------------------------------------------------------


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


_SHARED: dict[str, Transport] = {}


def make_transport(backend: str) -> Transport:
    """The process's shared transport for ``"mpi4py"`` (alias ``"mpi"``) or ``"horovod"``.

    Shared, so that many optimizers in one process use one worker thread and one
    duplicated communicator.
    """
    if backend in ("mpi4py", "mpi"):
        if "mpi4py" not in _SHARED:
            _SHARED["mpi4py"] = MPITransport()
        return _SHARED["mpi4py"]
    if backend == "horovod":
        if "horovod" not in _SHARED:
            _SHARED["horovod"] = HorovodTransport()
        return _SHARED["horovod"]
    raise ValueError(f"unknown backend {backend!r}: use 'horovod' or 'mpi4py'")
