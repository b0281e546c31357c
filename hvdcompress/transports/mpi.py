"""Collectives over mpi4py: see hvdcompress.transports.

Faults and exit (docs/checkpoints-and-faults.md, "Faults", "Clean exits"): no fault may
leave a rank waiting forever. Each transport has a side channel (its own duplicated
communicator, one watcher thread), an exception hook that aborts the job and an atexit
function that ends its worker thread before ``MPI_Finalize``: all in
hvdcompress.transports.mpi_faults.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from hvdcompress.transports import slots
from hvdcompress.transports.base import Handle, Transport, check_alltoallv_parts
from hvdcompress.transports.mpi_faults import (
    _WATCHERS,
    _install_hooks,
    _Progress,
    _say,
    _Watcher,
    stall_settings,  # noqa: F401  (re-exported: transports/horovod.py imports it from here)
)


def _add_16bit(dtype: torch.dtype):
    """An MPI user op that sums 2-byte floats in float32 and rounds back (Horovod's rule)."""

    def add(inbuf, outbuf, datatype) -> None:
        a = torch.frombuffer(inbuf, dtype=dtype)
        b = torch.frombuffer(outbuf, dtype=dtype)
        b.copy_(a.float() + b.float())

    return add


_OPS_16BIT: dict = {}


def _parts_spec(buf: np.ndarray, sizes: np.ndarray, MPI) -> list:
    """mpi4py's spec of the bytes ``buf`` as parts of ``sizes`` bytes, one after another."""
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return [buf, (sizes.tolist(), displs.tolist()), MPI.UNSIGNED_CHAR]


def _sum_ops_16bit(MPI) -> dict:
    """The float16/bfloat16 sum ops, created once per process (MPI allows few user ops)."""
    if not _OPS_16BIT:
        for dtype in (torch.float16, torch.bfloat16):
            _OPS_16BIT[dtype] = MPI.Op.Create(_add_16bit(dtype), commute=True)
    return _OPS_16BIT


_STOP = object()  # the worker's last queue item


class MPITransport(Transport):
    """Collectives over an mpi4py communicator (default ``COMM_WORLD``); see module doc."""

    name = "mpi4py"
    splits = True

    def __init__(self, comm=None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective, like Dup below
        self.local_size = node.Get_size()
        self._node_leader = node.allreduce(self.rank, op=MPI.MIN)  # names the node
        node.Free()
        self._data_comm = self.comm.Dup()  # the worker's collectives never meet ours
        self._ops = _sum_ops_16bit(MPI)
        # float16 and bfloat16 travel as their bits (uint16), summed by their user ops
        self._mpi_types = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}
        self._mpi_types.update(dict.fromkeys(self._ops, MPI.UINT16_T))
        self._progress = _Progress()
        self._watcher = _Watcher(self)  # Dup: collective, at the same point on every rank
        _install_hooks()
        _WATCHERS.append(weakref.ref(self._watcher))
        self._queue: queue.Queue = queue.Queue()
        self._stopped = False  # stop_worker was called: no more collectives
        self._worker = threading.Thread(target=self._run, name="hvdcompress-mpi", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        p = self._progress
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, handle, what = item
            handle.began = time.perf_counter()  # queued until now behind earlier jobs
            p.started += 1
            p.last_start = time.monotonic()
            p.data_now = (p.started, what, p.last_start)
            handle._run(job)
            p.data_now = None

    def stop_worker(self, timeout: float) -> bool:
        """End the worker thread (at exit, before MPI_Finalize; the transport cannot start
        collectives afterwards): the collectives queued but not started fail with a
        RuntimeError, the one in progress finishes (waited for up to ``timeout`` s).
        True when the worker has ended."""
        self._stopped = True
        if not self._worker.is_alive():
            return True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job[1]._finish(error=RuntimeError(f"{job[2]}: not started, the process exits"))
        self._queue.put(_STOP)
        self._worker.join(timeout)
        if self._worker.is_alive():
            what = self._progress.data_now
            _say(
                f"at exit: the worker is still in collective {what} after {timeout:g} s; "
                "exiting without it",
                self.rank,
            )
        return not self._worker.is_alive()

    def _submit(self, job: Callable[[], object], what: str, *, measured: bool = False) -> Handle:
        """A handle of ``job``'s result; ``measured``: ``job`` returns (result,
        ``slots.Wire``), and the handle carries what went on the wire."""
        if self._stopped:
            raise RuntimeError(f"{what}: the mpi4py transport's worker has stopped (process exit)")
        handle = Handle()
        if measured:
            inner = job

            def job():
                result, handle._wire = inner()
                return result

        self._queue.put((job, handle, what))
        return handle

    @contextlib.contextmanager
    def _control(self, what: str):
        """Context of one blocking collective of the calling thread (counted, watched)."""
        p = self._progress
        p.control += 1
        p.last_start = time.monotonic()
        p.control_now = (p.control, what, p.last_start)
        try:
            yield
        finally:
            p.control_now = None

    def _split(self, groups, mine: tuple[int, ...]) -> MPITransport:
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        return MPITransport(self.comm.Split(color, mine.index(self.rank)))

    def node_key(self) -> object:
        """The lowest rank of this rank's ``COMM_TYPE_SHARED`` group: names its node."""
        return ("mpi", self._node_leader)

    # allgatherv / alltoallv: sizes carried in slots with the data (transports.slots)
    def start_allgatherv(self, local: torch.Tensor, *, key=None) -> Handle:
        buf = torch.from_numpy(np.ascontiguousarray(local.detach().cpu().numpy(), dtype=np.uint8))
        caps = slots.capacities(self)

        def job():
            gathered, sizes, wire = slots.allgatherv(
                buf, caps, key, self.rank, self.size, self._gather_var
            )
            return (gathered, sizes), wire

        return self._submit(job, f"allgatherv of {buf.numel()} bytes", measured=True)

    def _gather_var(self, t: torch.Tensor, counts: list[int]):
        """All ranks' ``t`` (``counts[r]`` bytes on rank r), exactly: (concatenation, bytes
        sent, bytes received)."""
        sizes = np.array(counts, dtype=np.int64)
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        send = [np.ascontiguousarray(t.numpy()), self.MPI.UNSIGNED_CHAR]
        self._data_comm.Allgatherv(send, _parts_spec(recv, sizes, self.MPI))
        mine = counts[self.rank]
        return torch.from_numpy(recv), (self.size - 1) * mine, int(sizes.sum()) - mine

    def start_alltoallv(self, parts: list[torch.Tensor], *, key=None) -> Handle:
        check_alltoallv_parts(parts, self.size)
        bufs = [np.ascontiguousarray(p.detach().cpu().numpy(), dtype=np.uint8) for p in parts]
        tensors, caps, cpu = (
            [torch.from_numpy(b) for b in bufs],
            slots.capacities(self),
            torch.device("cpu"),
        )

        def job():
            return slots.alltoallv(tensors, caps, key, self.rank, self._exchange, cpu)

        return self._submit(job, f"alltoallv of {sum(b.size for b in bufs)} bytes", measured=True)

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]):
        MPI, recv_sizes = self.MPI, np.array(recv_counts, dtype=np.int64)
        recv = np.empty(int(recv_sizes.sum()), dtype=np.uint8)
        send_spec = _parts_spec(send.numpy(), np.array(send_counts, dtype=np.int64), MPI)
        self._data_comm.Alltoallv(send_spec, _parts_spec(recv, recv_sizes, MPI))
        return torch.from_numpy(recv)

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

        return self._submit(job, f"allreduce of {src.numel()} {str(src.dtype)[6:]}")

    def allgather_object(self, obj) -> list:
        with self._control("allgather_object"):
            return self.comm.allgather(obj)

    def broadcast_(self, tensors, root: int = 0) -> None:
        with self._control(f"broadcast from rank {root}"):
            for t in tensors:  # the raw bytes: any dtype, bit-exact
                buf = t.detach().cpu().contiguous()
                view = buf.reshape(-1).view(torch.uint8).numpy()
                self.comm.Bcast([view, self.MPI.BYTE], root=root)
                t.data.copy_(buf)

    def sum_floats(self, values) -> list[float]:
        with self._control("sum_floats"):
            send = np.array(values, dtype=np.float64)
            recv = np.empty_like(send)
            self.comm.Allreduce(send, recv, op=self.MPI.SUM)
            return recv.tolist()

    def barrier(self) -> None:
        with self._control("barrier"):
            self.comm.Barrier()
