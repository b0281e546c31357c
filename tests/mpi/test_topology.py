"""The topology under real Open MPI on one machine: every rank is on one node (the
``COMM_TYPE_SHARED`` split), and the override plays nodes of K ranks.

    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_topology.py -q
"""

from __future__ import annotations

import pytest

from hvdcompress.transports import make_transport, topology

pytestmark = pytest.mark.mpi(min_size=2)


def test_one_machine_is_one_node_and_the_override_splits_it():
    t = make_transport("mpi4py")
    assert topology.detect(t).nodes == (tuple(range(t.size)),)
    if t.size % 2 == 0:
        assert topology.detect(t, ranks_per_node=2).nodes == tuple(
            (r, r + 1) for r in range(0, t.size, 2)
        )


def test_split_makes_sub_communicators():
    import torch

    t = make_transport("mpi4py")
    groups = ((0,), tuple(range(1, t.size)))
    sub = t.split(groups)
    got = sub.start_allreduce_sum(torch.tensor([float(t.rank)])).wait()
    mine = groups[0] if t.rank == 0 else groups[1]
    assert sub.size == len(mine) and float(got) == float(sum(mine))
