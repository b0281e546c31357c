"""What every transport is (``Transport``, ``Handle``) and where traffic is counted; the
transports' package docstring (``hvdcompress.transports``) describes the operations."""

from __future__ import annotations

import functools
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from hvdcompress.errors import RankAgreementError
from hvdcompress.stats import Traffic, ring_allreduce_bytes


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
        self.rounds: int | None = None  # underlying collectives; known after the first wait()
        # what the transport measured on the wire (slots.Wire), filled in by the time the
        # collective is done; None: the payload estimate and one round
        self._wire = None
        self._count_received: Callable[[object], int] | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.began

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self.ended = time.perf_counter()
        self._done.set()

    def _run(self, fn: Callable[[], object]) -> None:
        """Finish with ``fn()``'s result, or with its error."""
        try:
            self._finish(fn())
        except BaseException as err:  # noqa: BLE001 - re-raised by Handle.wait
            self._finish(error=err)

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
            self._run(self._fn)
        return super().wait(timeout)


_WORKER_THREADS: dict[int, threading.Thread] = {}  # by id of the queue, while it runs


def start_worker(owner, name: str) -> queue.SimpleQueue:
    """A queue whose callables a daemon thread ``name`` runs in order, until ``owner`` is
    collected (the thread holds no reference to ``owner``, so it can be) or
    ``drain_worker``; a callable must not raise."""
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(target=_serve, args=(jobs,), name=name, daemon=True)
    _WORKER_THREADS[id(jobs)] = thread
    thread.start()
    weakref.finalize(owner, jobs.put, None)
    return jobs


def drain_worker(jobs: queue.SimpleQueue) -> None:
    """Let the worker of ``jobs`` run every callable queued so far, then end it and wait
    until its thread is gone."""
    thread = _WORKER_THREADS.get(id(jobs))
    jobs.put(None)
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _serve(jobs: queue.SimpleQueue) -> None:
    try:
        while True:
            job = jobs.get()
            if job is None:
                return
            job()
            del job  # not held while the thread waits for the next one
    finally:
        _WORKER_THREADS.pop(id(jobs), None)


class Transport:
    """Interface (see the module docstring). ``rank``, ``size`` and ``local_size`` (ranks on
    this node) are set by subclasses."""

    name = ""
    splits = False  # whether ``split`` makes sub-communicators (``_split``)
    tunable = True  # whether step times say what the link costs (exchange.tuning)
    rank: int = 0
    size: int = 1
    local_size: int = 1

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for kind in _COUNTED:
            start = cls.__dict__.get(f"start_{kind}")
            if start is not None:
                setattr(cls, f"start_{kind}", _counted(kind, start))

    def split(self, groups) -> Transport:
        """The transport of the group of ``groups`` (disjoint tuples of ranks covering every
        rank) that holds this rank: a sub-communicator of this one. Collective: every rank
        calls it with the same groups, at the same point; ranks that pass different groups
        get the same ``RankAgreementError`` on every rank (the groups are gathered first)."""
        groups = tuple(tuple(int(r) for r in g) for g in groups)
        gathered = self.allgather_object(groups)
        if any(g != gathered[0] for g in gathered):
            raise RankAgreementError(
                "ranks disagree on the groups of a split: "
                + "; ".join(f"rank {r}: {g}" for r, g in enumerate(gathered))
            )
        ranks = sorted(r for g in groups for r in g)
        if ranks != list(range(self.size)):
            raise ValueError(f"the groups of a split must hold every rank once, got {groups}")
        mine = next(g for g in groups if self.rank in g)
        return self._split(groups, mine)

    def _split(self, groups, mine: tuple[int, ...]) -> Transport:
        raise NotImplementedError(
            f"the {self.name or type(self).__name__} transport has no sub-communicators "
            "(split): the hierarchical exchange runs on mpi4py, torch.distributed, Horovod "
            "and the simulated world"
        )

    def node_key(self) -> object:
        """What names this rank's node, equal on the ranks of one node (transports.topology):
        Slurm's ``SLURM_NODEID`` under srun, else the host name. Launchers that know better
        (torchrun, Horovod, MPI) say so in their transports."""
        node = os.environ.get("SLURM_NODEID")
        return ("slurm", node) if node is not None else ("host", socket.gethostname())

    @property
    def traffic(self) -> Traffic:
        """Bytes this rank sent and received in collectives so far (module doc)."""
        return self.__dict__.setdefault("_traffic", Traffic())

    def start_allgatherv(self, local: torch.Tensor, *, key=None) -> Handle:
        """Every rank's ``local`` (1-D uint8); ``wait()`` gives (their concatenation in
        rank order, their lengths). ``key`` (hashable, the same on every rank; None: none)
        names the call site, e.g. a bucket's stage: a transport that sends sizes in a round
        of their own may carry them with the data there instead (``transports.slots``)."""
        raise NotImplementedError

    def moves_on(self, device: torch.device) -> bool:
        """True when ``start_allgatherv`` and ``start_alltoallv`` take bytes on ``device``
        as they are and give what they receive on that device (no host copy by the
        caller); else the caller gives host bytes. The host only, by default."""
        return device.type == "cpu"

    def start_alltoallv(self, parts: list[torch.Tensor], *, key=None) -> Handle:
        """Send ``parts[j]`` (1-D uint8) to rank j; ``wait()`` gives the list of what each
        rank sent to this one, in rank order (module doc); ``key`` as for allgatherv."""
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
    ring = int(ring_allreduce_bytes(size, data.numel() * data.element_size()))
    return ring, lambda result: ring


_COUNTED = ("allgatherv", "alltoallv", "allreduce_sum")


def _counted(kind: str, start):
    """``start`` (a subclass's start_<kind>) counting its traffic (module doc); a subclass
    calling its parent's start_<kind> is counted once, by the outermost call. Every
    transport's ``start_allgatherv`` / ``start_alltoallv`` takes the ``key``."""

    @functools.wraps(start)
    def counted(self: Transport, data, *, key=None) -> Handle:
        args = {} if kind == "allreduce_sum" else {"key": key}
        if self.__dict__.get("_counting"):
            return start(self, data, **args)
        self._counting = True
        try:
            handle = start(self, data, **args)
        finally:
            self._counting = False
        sent, received = _sent_and_received(kind, data, self.rank, self.size)
        traffic = self.traffic
        handle.sent_bytes = sent
        traffic.sent += sent
        traffic.collectives += 1

        def count_received(result) -> int:
            wire = handle._wire
            rounds = 1 if wire is None else wire.rounds
            handle.rounds = rounds
            traffic.rounds += rounds
            if wire is not None and wire.sent is not None:  # measured: replaces the estimate
                traffic.sent += wire.sent - handle.sent_bytes
                handle.sent_bytes = wire.sent
            n = received(result) if wire is None or wire.received is None else wire.received
            traffic.received += n
            return n

        handle._count_received = count_received  # at the first successful wait()
        return handle

    return counted
