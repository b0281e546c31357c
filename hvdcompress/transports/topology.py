"""Which ranks share a node: the topology a hierarchical exchange is planned on.

Each rank says which node it is on (``Transport.node_key``: torchrun's ``GROUP_RANK``,
Horovod's cross rank, the lowest world rank of MPI's ``COMM_TYPE_SHARED`` split, Slurm's
``SLURM_NODEID``, else the host name), and the keys are gathered, so every rank builds
the same ``Topology`` from the same list. ``HVDC_RANKS_PER_NODE=K`` (or ``ranks_per_node=``)
overrides the launcher: consecutive blocks of K ranks play one node each, which is how
tests on one machine play a cluster. Ranks that disagree on the override get the same
``RankAgreementError`` on every rank, never a hang: the disagreement is found in the one
gathered list that every rank holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hvdcompress import checks
from hvdcompress.errors import RankAgreementError

OVERRIDE_ENV = "HVDC_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """``nodes[i]``: the ranks of node ``i``, ascending; nodes ordered by their lowest rank."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return sum(len(n) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    @property
    def ranks_per_node(self) -> int | None:
        """K when every node holds K ranks, else None (a hierarchical exchange needs K)."""
        sizes = {len(n) for n in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def peers(self, rank: int) -> tuple[int, ...]:
        """The ranks with ``rank``'s local rank, one per node: its cross-node group."""
        local = self.local_rank(rank)
        return tuple(n[local] for n in self.nodes if local < len(n))

    @classmethod
    def blocks(cls, size: int, ranks_per_node: int) -> Topology:
        """Consecutive blocks of ``ranks_per_node`` ranks (the override's layout)."""
        if size % ranks_per_node:
            raise ValueError(
                f"{OVERRIDE_ENV} / ranks_per_node={ranks_per_node} does not divide the "
                f"{size} ranks into whole nodes"
            )
        return cls(
            tuple(tuple(range(s, s + ranks_per_node)) for s in range(0, size, ranks_per_node))
        )

    @classmethod
    def from_keys(cls, keys: list) -> Topology:
        """Ranks with equal node keys share a node."""
        nodes: dict = {}
        for rank, key in enumerate(keys):
            nodes.setdefault(key, []).append(rank)
        return cls(tuple(sorted(tuple(r) for r in nodes.values())))


def _override(ranks_per_node) -> int | None:
    """The ranks per node this rank is told to play (``ranks_per_node=``, else
    ``HVDC_RANKS_PER_NODE``), None where neither says; ValueError naming the variable or
    the argument that holds a bad value."""
    if ranks_per_node is not None:
        return checks.integer("ranks_per_node", ranks_per_node, 1)
    raw = os.environ.get(OVERRIDE_ENV) or None
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{OVERRIDE_ENV} must be an int >= 1, got {raw!r}")
    return value


def detect(transport, ranks_per_node: int | None = None) -> Topology:
    """The job's topology, the same on every rank (module doc). Collective: every rank of
    ``transport`` calls it at the same point. A bad override on any rank is gathered
    first and raised on every rank, naming the ranks and their values."""
    try:
        override, error = _override(ranks_per_node), None
    except ValueError as err:
        override, error = None, str(err)
    key = None if override or error else transport.node_key()
    gathered = transport.allgather_object((override, error, key))
    bad = [(r, e) for r, (_, e, _) in enumerate(gathered) if e is not None]
    if bad:
        ranks = [r for r, _ in bad]
        raise ValueError(f"on rank(s) {ranks} of {len(gathered)}: {bad[0][1]}")
    overrides = sorted({o for o, _, _ in gathered}, key=repr)
    if len(overrides) > 1:
        per_rank = ", ".join(f"rank {r}: {o}" for r, (o, _, _) in enumerate(gathered))
        raise RankAgreementError(
            f"ranks disagree on the ranks per node ({OVERRIDE_ENV} or ranks_per_node): {per_rank}"
        )
    if override is not None:
        return Topology.blocks(transport.size, override)
    return Topology.from_keys([key for _, _, key in gathered])
