"""Transports: move payloads between ranks (docs/design.md, "Transports", for the four
operations, their ordering invariant and how ``MPITransport`` and ``HorovodTransport``
implement them).

Traffic: every ``start_*`` of every subclass is counted in one place, this base class
(``__init_subclass__`` wraps what a subclass defines): ``Handle.sent_bytes`` /
``Handle.received_bytes`` of each collective and the running totals in
``Transport.traffic`` (``hvdcompress.stats.Traffic``). Counted per rank: allgatherv
sends its bytes to the ``size - 1`` others and receives theirs; alltoallv sends the parts
for other ranks and receives the parts from them (its own part stays local); an allreduce
of B bytes sends and receives ``2 (size - 1) / size * B`` (the ring algorithm's).

Blocking helpers for setting up and evaluating a training run (every rank calls them, in
the same order): ``broadcast_``, ``sum_floats``, ``barrier``; the base class implements
them with ``allgather_object``, the real transports with native collectives.

Neither ``transports.mpi`` nor ``transports.horovod`` is imported before a transport is
built: ``import hvdcompress`` works without mpi4py or Horovod.
"""

from __future__ import annotations

import importlib

from hvdcompress.transports.base import Handle, Transport

__all__ = ["Handle", "Transport", "make_transport"]

_SHARED: dict[str, Transport] = {}


def make_transport(backend: str, process_set=None) -> Transport:
    """The process's shared transport for ``"mpi4py"`` (alias ``"mpi"``) or ``"horovod"``.

    Shared, so that many optimizers in one process use one worker thread and one
    duplicated communicator. ``process_set`` (None: every rank) restricts it to a set of
    ranks this rank belongs to: an ``hvd.ProcessSet`` for ``"horovod"``, a sorted tuple of
    ``COMM_WORLD`` ranks for ``"mpi4py"`` (a sub-communicator, made collectively by the
    members only).
    """
    if backend not in ("horovod", "mpi4py", "mpi"):
        raise ValueError(f"unknown backend {backend!r}: use 'horovod' or 'mpi4py'")
    horovod = backend == "horovod"
    if process_set is None:
        key = "horovod" if horovod else "mpi4py"
    else:
        # hvd.ProcessSet: by identity (ids are reused after hvd.remove_process_set; the
        # cached transport keeps its set alive, so the identity is not reused)
        key = f"{backend}:{id(process_set) if horovod else process_set}"
    if key not in _SHARED:
        if horovod:
            from hvdcompress.transports.horovod import HorovodTransport

            _SHARED[key] = HorovodTransport(process_set)
        else:
            from hvdcompress.transports.mpi import MPITransport

            comm = None
            if process_set is not None:
                from mpi4py import MPI

                world = MPI.COMM_WORLD
                comm = world.Create_group(world.Get_group().Incl(list(process_set)))
            _SHARED[key] = MPITransport(comm)
    return _SHARED[key]


_LAZY = {"MPITransport": "mpi", "HorovodTransport": "horovod"}  # name -> its module


def __getattr__(name: str):
    """``MPITransport`` / ``HorovodTransport`` on first use (their modules import mpi4py or
    Horovod when a transport is built, not before)."""
    if name not in _LAZY:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"hvdcompress.transports.{_LAZY[name]}"), name)
