"""NDQSG through hvdcompress.DistributedOptimizer on real MPI ranks: the aliasing rates
it reports (its own payload's on the nested-coded ranks, the estimate from the DQSG-coded
ranks, the same on every rank). Bit identity of its gather path is in
test_gather_bit_identity.py, its checkpoints in test_checkpoint.py.

    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_ndqsg.py
"""

from __future__ import annotations

import pytest

from tests.mpi.helpers import make_model, train, wrap

pytestmark = pytest.mark.mpi(min_size=2)


def test_ndqsg_reports_aliasing_on_every_rank(comm):
    model = make_model()
    opt = wrap(model, "ndqsg")
    train(model, opt, comm.rank, 2)
    metrics = opt.last_stats.metrics
    own = comm.allgather(metrics["aliasing_rate_own"])
    estimate = comm.allgather(metrics["aliasing_rate_estimate"])
    d = (comm.size + 1) // 2
    assert all(o is None for o in own[:d]) and all(0.0 <= o <= 1.0 for o in own[d:])
    assert len(set(estimate)) == 1  # every rank decodes the same bytes
    assert (estimate[0] is None) == (d < 2)
