"""``process_set``: the transport over a Horovod process set or a list of mpi4py ranks,
and the stand-in transport of a rank outside the set."""

from __future__ import annotations

from hvdcompress.transports import Transport, make_transport


class _OutsideProcessSet(Transport):
    """The transport of a rank outside ``process_set``: it takes part in no collective; its
    optimizer steps on its local gradients, as Horovod's does."""

    name = "outside process_set"


def _transport_for(backend: str | Transport, process_set) -> Transport | None:
    """The transport over ``process_set`` (None or Horovod's global set: every rank), or
    None when this rank is outside it."""
    if process_set is None or _is_global(process_set):
        return backend if isinstance(backend, Transport) else make_transport(backend)
    if isinstance(backend, Transport):
        raise ValueError(
            "process_set cannot restrict a Transport given as backend: build that transport "
            "over the set's ranks instead (e.g. MPITransport(sub_communicator))"
        )
    if backend == "horovod":
        from horovod.common.process_sets import ProcessSet

        if not isinstance(process_set, ProcessSet):
            raise TypeError(
                "process_set on the horovod backend must be an hvd.ProcessSet "
                f"(hvd.add_process_set(ranks)), got {type(process_set).__name__}"
            )
        if process_set.process_set_id is None:
            raise ValueError(f"{process_set} is not registered: call hvd.add_process_set first")
        return make_transport("horovod", process_set) if process_set.included() else None
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ranks = _ranks_of(process_set)
    bad = [r for r in ranks if not 0 <= r < world.Get_size()]
    if bad or not ranks:
        raise ValueError(
            f"process_set must name ranks of COMM_WORLD (0..{world.Get_size() - 1}), got {ranks}"
        )
    return make_transport("mpi4py", tuple(ranks)) if world.Get_rank() in ranks else None


def _is_global(process_set) -> bool:
    if isinstance(process_set, (list, tuple, range)):
        return False
    from horovod.common.process_sets import ProcessSet

    return isinstance(process_set, ProcessSet) and process_set.process_set_id == 0


def _ranks_of(process_set) -> list[int]:
    """The sorted ranks of an ``hvd.ProcessSet`` or a sequence of ranks (mpi4py backend)."""
    if isinstance(process_set, (list, tuple, range)):
        ranks = list(process_set)
    else:
        from horovod.common.process_sets import ProcessSet

        if not isinstance(process_set, ProcessSet) or process_set.ranks is None:
            raise TypeError(
                "process_set must be an hvd.ProcessSet with ranks or a list of ranks, got "
                f"{process_set!r}"
            )
        ranks = list(process_set.ranks)
    if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise ValueError(f"process_set ranks must be ints, got {ranks!r}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"process_set names a rank twice: {ranks!r}")
    return sorted(ranks)
