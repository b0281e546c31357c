"""Transports: move payloads between ranks (docs/design.md, "Transports").

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

from hvdcompress.transports.base import (
    Handle,
    Transport,
    _DoneHandle,
    check_alltoallv_parts,
)

__all__ = ["Handle", "Transport", "_DoneHandle", "check_alltoallv_parts", "make_transport"]

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
