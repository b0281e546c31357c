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

Neither ``transports.mpi`` nor ``transports.horovod`` is imported before a transport is
built: ``import hvdcompress`` works
without mpi4py or Horovod.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch


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


_SHARED: dict[str, Transport] = {}


def make_transport(backend: str) -> Transport:
    """The process's shared transport for ``"mpi4py"`` (alias ``"mpi"``) or ``"horovod"``.

    Shared, so that many optimizers in one process use one worker thread and one
    duplicated communicator.
    """
    if backend in ("mpi4py", "mpi"):
        if "mpi4py" not in _SHARED:
            from hvdcompress.transports.mpi import MPITransport

            _SHARED["mpi4py"] = MPITransport()
        return _SHARED["mpi4py"]
    if backend == "horovod":
        if "horovod" not in _SHARED:
            from hvdcompress.transports.horovod import HorovodTransport

            _SHARED["horovod"] = HorovodTransport()
        return _SHARED["horovod"]
    raise ValueError(f"unknown backend {backend!r}: use 'horovod' or 'mpi4py'")


def __getattr__(name: str):
    """``MPITransport`` / ``HorovodTransport`` on first use (their modules import mpi4py or
    Horovod when a transport is built, not before)."""
    if name == "MPITransport":
        from hvdcompress.transports.mpi import MPITransport

        return MPITransport
    if name == "HorovodTransport":
        from hvdcompress.transports.horovod import HorovodTransport

        return HorovodTransport
    raise AttributeError(name)
