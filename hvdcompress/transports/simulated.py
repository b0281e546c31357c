"""A simulated world: N ranks as N threads of one process (docs/horovod-parity.md,
"The simulated world", for the rendezvous and why its digests equal a real run's).

``SimulatedWorld(size)`` is the rendezvous every rank's ``SimulatedTransport`` shares
(``hvdcompress.training.simulate.run_ranks`` runs one function per rank on it); a
collective is a slot of the world, matched by its position in the started or the
blocking sequence. Numerics are the real transports': allgatherv in rank order;
allreduce summed in rank order, float16 / bfloat16 added in float32 and rounded back
after every add (Horovod's rule); objects pickled, as over MPI.

Invariants: a rank that starts a different collective at a position than rank 0 did gets
``RankMismatch`` instead of a wrong result; every rank waiting in (or later starting) a
collective that can never finish, because a rank failed or returned, raises
``SimulatedAbort`` naming that rank instead of waiting forever.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hvdcompress.transports.base import Handle, Transport, _DoneHandle, check_alltoallv_parts

SUMMABLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LOW_PRECISION = (torch.float16, torch.bfloat16)


class SimulatedAbort(RuntimeError):
    """A collective of the simulated world cannot finish: another rank failed or returned."""


class RankMismatch(RuntimeError):
    """Ranks started different collectives at the same position of a sequence."""


def sum_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """``((parts[0] + parts[1]) + parts[2]) + ...``; float16 / bfloat16 added in float32
    and rounded back after every add (see the module doc)."""
    total = parts[0].clone()
    for part in parts[1:]:
        if total.dtype in LOW_PRECISION:
            total = (total.float() + part.float()).to(total.dtype)
        else:
            total.add_(part)
    return total


@dataclass
class _Slot:
    """One collective of the world: what rank 0 (or the first rank) started, every rank's
    contribution, and each rank's result once all have arrived."""

    what: str
    signature: tuple
    values: list
    arrived: int = 0
    results: list | None = None
    taken: int = 0
    ranks: set = field(default_factory=set)


class SimulatedWorld:
    """The rendezvous of ``size`` simulated ranks (see the module doc)."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"a simulated world needs an int size >= 1, got {size!r}")
        self.size = size
        self._cond = threading.Condition()
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._abort: str | None = None
        self._returned: dict[int, dict[str, int]] = {}  # rank -> collectives it started
        self._transports = [SimulatedTransport(self, r) for r in range(size)]
        self._subworlds: dict[tuple[int, ...], SimulatedWorld] = {}  # by their ranks here

    def subworld(self, ranks: tuple[int, ...]) -> SimulatedWorld:
        """The world of ``ranks`` (made by the first of them to ask): its rank ``i`` is this
        world's ``ranks[i]``; an abort here, or a rank returning here, reaches it too."""
        with self._cond:
            if ranks not in self._subworlds:
                self._subworlds[ranks] = SimulatedWorld(len(ranks))
            return self._subworlds[ranks]

    def transport(self, rank: int) -> SimulatedTransport:
        return self._transports[rank]

    # ---- called by the transports ------------------------------------------------------------
    def contribute(
        self,
        sequence: str,
        index: int,
        rank: int,
        value,
        what: str,
        signature: tuple,
        combine: Callable[[list], list],
    ) -> _Slot:
        """Put ``rank``'s ``value`` into collective ``index`` of ``sequence``; the last
        rank to arrive runs ``combine(values) -> one result per rank``."""
        key = (sequence, index)
        with self._cond:
            self._check_abort()
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot(what, signature, [None] * self.size)
            elif slot.signature != signature:
                message = (
                    f"rank {rank} started {what} as {sequence} collective #{index}, where "
                    f"rank {min(slot.ranks)} started {slot.what}: every rank must start the "
                    "same collectives in the same order"
                )
                self._abort = message
                self._cond.notify_all()
                raise RankMismatch(message)
            slot.values[rank] = value
            slot.ranks.add(rank)
            slot.arrived += 1
            if slot.arrived == self.size:
                try:
                    slot.results = combine(slot.values)
                except BaseException as err:  # noqa: BLE001 - every rank learns why
                    self._abort = f"{what} failed: {err!r}"
                    raise
                finally:
                    self._cond.notify_all()
                slot.values = []  # the inputs are not needed any more
            return slot

    def result(self, sequence: str, index: int, rank: int, slot: _Slot):
        """``rank``'s result of the collective; blocks until every rank has contributed,
        ``SimulatedAbort`` when one never will."""
        with self._cond:
            self._cond.wait_for(lambda: slot.results is not None or self._stuck(sequence, index))
            if slot.results is None:
                self._check_abort()
                raise SimulatedAbort(self._stuck(sequence, index))
            out, slot.results[rank] = slot.results[rank], None
            slot.taken += 1
            if slot.taken == self.size:
                del self._slots[(sequence, index)]
            return out

    def _stuck(self, sequence: str, index: int) -> str:
        """Why collective ``index`` of ``sequence`` can never finish ("" while it can)."""
        if self._abort is not None:
            return self._abort
        for rank, started in sorted(self._returned.items()):
            if started[sequence] <= index:
                return (
                    f"rank {rank} returned after starting {started[sequence]} {sequence} "
                    f"collectives: {sequence} collective #{index} can never finish"
                )
        return ""

    def _check_abort(self) -> None:
        if self._abort is not None:
            raise SimulatedAbort(self._abort)

    # ---- called by the runner ----------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Every collective waiting or yet to start raises ``SimulatedAbort(reason)``
        (the first reason is kept)."""
        with self._cond:
            if self._abort is None:
                self._abort = reason
            self._cond.notify_all()
            subworlds = list(self._subworlds.values())
        for sub in subworlds:
            sub.abort(reason)

    def returned(self, rank: int) -> None:
        """Rank ``rank``'s function returned: collectives it never started cannot finish."""
        with self._cond:
            self._returned[rank] = dict(self._transports[rank]._counts)
            self._cond.notify_all()
            subworlds = list(self._subworlds.items())
        for ranks, sub in subworlds:
            if rank in ranks:
                sub.returned(ranks.index(rank))


class SimulatedTransport(Transport):
    """One rank of a ``SimulatedWorld`` (see the module doc)."""

    name = "simulated"
    splits = True
    tunable = False  # one process plays every rank: no link to time

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size
        self.local_size = world.size  # every rank shares this process's cores
        self._counts = {"started": 0, "blocking": 0}  # collectives of each sequence so far

    def _split(self, groups, mine: tuple[int, ...]) -> SimulatedTransport:
        return self.world.subworld(mine).transport(mine.index(self.rank))

    def _collective(self, sequence: str, value, what: str, signature: tuple, combine, finish=None):
        """Contribute ``value`` to this rank's next collective of ``sequence``; ``wait()``
        gives this rank's result (through ``finish`` when given)."""
        index = self._counts[sequence]
        self._counts[sequence] += 1
        world, rank = self.world, self.rank
        slot = world.contribute(sequence, index, rank, value, what, signature, combine)

        def wait():
            out = world.result(sequence, index, rank, slot)
            return out if finish is None else finish(out)

        return _DoneHandle(wait)

    # ---- the data collectives ------------------------------------------------------------------
    def start_allgatherv(self, local: torch.Tensor, *, key=None) -> Handle:
        # one process plays every rank: no rounds to save, ``key`` is not needed
        buf = local.detach().reshape(-1).to(device="cpu", dtype=torch.uint8).clone()

        def combine(values):
            sizes = [int(v.numel()) for v in values]
            gathered = torch.cat(values)
            return [(gathered.clone(), list(sizes)) for _ in values]

        return self._collective(
            "started", buf, f"allgatherv of {buf.numel()} bytes", ("allgatherv",), combine
        )

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        if dense.dtype not in SUMMABLE:
            raise TypeError(f"simulated transport cannot sum {dense.dtype}")
        src = dense.detach().to("cpu").contiguous().clone()
        device = dense.device

        def combine(values):
            total = sum_in_rank_order(values)
            return [total.clone() for _ in values]

        what = f"allreduce of {src.numel()} {str(src.dtype)[6:]}"
        signature = ("allreduce", src.dtype, src.numel())
        return self._collective(
            "started", src, what, signature, combine, finish=lambda out: out.to(device)
        )

    def start_alltoallv(self, parts: list[torch.Tensor], *, key=None) -> Handle:
        check_alltoallv_parts(parts, self.size)
        mine = [part.detach().to("cpu").clone() for part in parts]

        def combine(values):
            return [
                [values[src][dst].clone() for src in range(self.size)] for dst in range(self.size)
            ]

        what = f"alltoallv of {sum(int(p.numel()) for p in mine)} bytes"
        return self._collective("started", mine, what, ("alltoallv",), combine)

    # ---- the blocking collectives ----------------------------------------------------------
    def allgather_object(self, obj) -> list:
        blob = pickle.dumps(obj)  # what MPI would send: a rank never shares another's object

        def combine(values):
            return [[pickle.loads(b) for b in values] for _ in values]

        what, signature = "allgather_object", ("allgather_object",)
        return self._collective("blocking", blob, what, signature, combine).wait()

    def broadcast_(self, tensors, root: int = 0) -> None:
        tensors = list(tensors)
        mine = [t.detach().cpu().clone() for t in tensors] if self.rank == root else None
        signature = ("broadcast", root, len(tensors))

        def combine(values):
            return [values[root]] * len(values)  # read-only: copied into each rank's tensors

        what = f"broadcast of {len(tensors)} tensors from rank {root}"
        theirs = self._collective("blocking", mine, what, signature, combine).wait()
        for t, value in zip(tensors, theirs, strict=True):
            t.data.copy_(value)
