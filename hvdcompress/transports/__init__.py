"""Transports: move payloads between ranks (docs/design.md section 1, "transport").

Four operations, the first three started asynchronously and finished with ``Handle.wait()``:

* ``start_allgatherv(local_uint8)`` -> ``(gathered_uint8, sizes)``: every rank's bytes
  concatenated in rank order, plus each rank's byte count (the gather path of
  gather-only codecs such as 3LC); on the host, unless ``moves_on(local.device)``:
  then on that device, and nothing reaches the host but the byte counts (alltoallv
  likewise);
* ``start_allreduce_sum(dense)`` -> the elementwise sum over ranks (summable codecs);
* ``start_alltoallv(parts)`` -> list of ``size`` uint8 tensors: ``parts[j]`` (1-D
  uint8, may be empty) goes to rank j, and entry i of the result is what rank i sent to
  this rank, in rank order (stage 1 of the two-stage exchange);
* ``allgather_object(obj)`` -> list of every rank's object (small agreement checks;
  blocking).

Traffic: every ``start_*`` of every subclass is counted in one place, this base class
(``__init_subclass__`` wraps what a subclass defines): ``Handle.sent_bytes`` /
``Handle.received_bytes`` of each collective and the running totals in
``Transport.traffic`` (``hvdcompress.stats.Traffic``). Counted per rank: allgatherv
sends its bytes to the ``size - 1`` others and receives theirs; alltoallv sends the parts
for other ranks and receives the parts from them (its own part stays local); an allreduce
of B bytes sends and receives ``2 (size - 1) / size * B`` (the ring algorithm's).

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

import functools
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from hvdcompress.stats import Traffic


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
        self.sent_bytes = 0  # counted by Transport (module doc)
        self.received_bytes: int | None = None  # known after the first wait()
        self._count_received: Callable[[object], int] | None = None

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
        if self.received_bytes is None and self._count_received is not None:
            self.received_bytes = self._count_received(self._result)  # once, by the caller
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

    def __init_subclass__(cls, **kwargs) -> None:
        # Count the traffic of every collective here, once, for every transport: each
        # start_* a subclass defines is wrapped (see the module doc).
        super().__init_subclass__(**kwargs)
        for kind in _COUNTED:
            start = cls.__dict__.get(f"start_{kind}")
            if start is not None:
                setattr(cls, f"start_{kind}", _counted(kind, start))

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent and received in collectives so far (module doc)."""
        return self.__dict__.setdefault("_traffic", Traffic())

    def start_allgatherv(self, local: torch.Tensor) -> Handle:
        raise NotImplementedError

    def moves_on(self, device: torch.device) -> bool:
        """True when ``start_allgatherv`` and ``start_alltoallv`` take bytes on ``device``
        as they are and give what they receive on that device (no host copy by the
        caller); else the caller gives host bytes. The host only, by default."""
        return device.type == "cpu"

    def start_alltoallv(self, parts: list[torch.Tensor]) -> Handle:
        """Send ``parts[j]`` (1-D uint8) to rank j; ``wait()`` gives the list of what each
        rank sent to this one, in rank order (module doc)."""
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


def check_alltoallv_parts(parts, size: int) -> None:
    """ValueError unless ``parts`` is a list of ``size`` 1-D uint8 tensors."""
    if not isinstance(parts, (list, tuple)) or len(parts) != size:
        raise ValueError(
            f"alltoallv needs one part per rank ({size}), got "
            f"{len(parts) if isinstance(parts, (list, tuple)) else type(parts).__name__}"
        )
    for j, part in enumerate(parts):
        if not isinstance(part, torch.Tensor) or part.dtype != torch.uint8 or part.dim() != 1:
            raise ValueError(f"alltoallv part {j} must be a 1-D uint8 tensor, got {part!r:.80}")


def _sent_and_received(kind: str, data, rank: int, size: int):
    """(bytes this rank sends, function of the result giving the bytes it received)."""
    if kind == "allgatherv":
        own = data.numel()
        return (size - 1) * own, lambda result: sum(result[1]) - result[1][rank]
    if kind == "alltoallv":
        sent = sum(p.numel() for j, p in enumerate(data) if j != rank)
        return sent, lambda result: sum(r.numel() for i, r in enumerate(result) if i != rank)
    ring = (2 * (size - 1) * data.numel() * data.element_size()) // size
    return ring, lambda result: ring


_COUNTED = ("allgatherv", "alltoallv", "allreduce_sum")


def _counted(kind: str, start):
    """``start`` (a subclass's start_<kind>) counting its traffic (module doc); a subclass
    calling its parent's start_<kind> is counted once, by the outermost call."""

    @functools.wraps(start)
    def counted(self: Transport, data) -> Handle:
        if self.__dict__.get("_counting"):
            return start(self, data)
        self._counting = True
        try:
            handle = start(self, data)
        finally:
            self._counting = False
        sent, received = _sent_and_received(kind, data, self.rank, self.size)
        traffic = self.traffic
        handle.sent_bytes = sent
        traffic.sent += sent
        traffic.collectives += 1

        def count_received(result) -> int:
            n = received(result)
            traffic.received += n
            return n

        handle._count_received = count_received  # at the first successful wait()
        return handle

    return counted


_SHARED: dict[str, Transport] = {}


def make_transport(backend: str, process_set=None) -> Transport:
    """The process's shared transport for ``"mpi4py"`` (alias ``"mpi"``) or ``"horovod"``.

    Shared, so that many optimizers in one process use one worker thread and one
    duplicated communicator. ``process_set`` (None: every rank) restricts it to a set of
    ranks this rank belongs to: an ``hvd.ProcessSet`` for ``"horovod"``, a sorted tuple of
    ``COMM_WORLD`` ranks for ``"mpi4py"`` (a sub-communicator, made collectively by the
    members only).
    """
    if process_set is not None:
        # hvd.ProcessSet: by identity (ids are reused after hvd.remove_process_set; the
        # cached transport keeps its set alive, so the identity is not reused)
        key = f"{backend}:{id(process_set) if backend == 'horovod' else process_set}"
        if key not in _SHARED:
            if backend == "horovod":
                from hvdcompress.transports.horovod import HorovodTransport

                _SHARED[key] = HorovodTransport(process_set)
            elif backend in ("mpi4py", "mpi"):
                from mpi4py import MPI

                from hvdcompress.transports.mpi import MPITransport

                world = MPI.COMM_WORLD
                sub = world.Create_group(world.Get_group().Incl(list(process_set)))
                _SHARED[key] = MPITransport(sub)
            else:
                raise ValueError(f"unknown backend {backend!r}: use 'horovod' or 'mpi4py'")
        return _SHARED[key]
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
