"""Horovod's transport split into process sets (``HorovodTransport._split``:
``hvd.add_process_set``, dynamic process sets) and the hierarchical exchange over them,
with the override playing nodes (``HVDC_RANKS_PER_NODE``: 2 ranks a node from 4 ranks,
else 1). Mirrors tests/mpi/test_topology.py (mpi4py) and tests/test_hierarchical.py (the
simulated world).

    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_horovod_split.py -q

Horovod under mpirun runs its MPI controller; tests/test_horovod_split_gloo.py runs the
same checks under ``horovodrun --gloo``. Deadlock rule as in tests/mpi/helpers.py:
assertions come after each test's last collective.
"""

from __future__ import annotations

import pytest
import torch

from hvdcompress.transports import make_transport
from tests.helpers import averaged_grads
from tests.mpi.helpers import NEEDS_HOROVOD, batch, digest, make_model, wrap

pytestmark = [pytest.mark.mpi(min_size=2), NEEDS_HOROVOD]  # the hvd fixture: conftest.py


def layout(size: int) -> tuple[int, tuple, tuple]:
    """(ranks per node, the nodes, the cross-node groups) the override plays."""
    k = 2 if size >= 4 and size % 2 == 0 else 1
    nodes = tuple(tuple(range(s, s + k)) for s in range(0, size, k))
    return k, nodes, tuple(tuple(n[j] for n in nodes) for j in range(k))


def test_split_runs_each_collective_on_its_process_set(hvd):
    t = make_transport("horovod")
    k, nodes, cross = layout(t.size)
    intra, peers = t.split(nodes), t.split(cross)
    again = t.split(nodes)  # the same ranks again: Horovod's existing sets, names of its own
    node = nodes[t.rank // k]
    summed = intra.start_allreduce_sum(torch.tensor([float(t.rank)])).wait()
    mine = torch.full((t.rank + 1,), t.rank, dtype=torch.uint8)
    gathered, sizes = peers.start_allgatherv(mine).wait()
    parts = [torch.full((j + 1,), 10 * t.rank + j, dtype=torch.uint8) for j in range(k)]
    received = intra.start_alltoallv(parts).wait()
    objects = again.allgather_object(t.rank)
    intra.barrier()
    peers.barrier()
    node_index, local = divmod(t.rank, k)
    assert (intra.size, intra.rank, peers.size, peers.rank) == (k, local, len(nodes), node_index)
    assert float(summed) == float(sum(node))
    group = cross[local]
    assert sizes == [r + 1 for r in group]
    assert gathered.tolist() == [r for r in group for _ in range(r + 1)]
    assert [p.tolist() for p in received] == [[10 * r + local] * (local + 1) for r in node]
    assert objects == list(node)


def _train(hvd, exchange: str, compression, steps: int):
    """Each step's averaged gradients (after synchronize) and the final parameters."""
    model = make_model(0)
    opt = wrap(model, compression, backend="horovod", exchange=exchange, momentum=0.0)
    grads = averaged_grads(model, opt, lambda step: batch(hvd.rank(), step), steps)
    kinds = sorted({opt.reducer.planned(b).kind for b in opt.buckets})
    return grads, digest(model.parameters()), kinds


def test_the_hierarchical_exchange_is_bit_identical_on_every_rank(hvd, monkeypatch):
    """3LC: every rank holds the same averaged gradients, to the bit, at every step."""
    k, _, _ = layout(hvd.size())
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", str(k))
    grads, params, kinds = _train(hvd, "hierarchical", "3lc", 3)
    every = hvd.allgather_object((digest(g for step in grads for g in step), params, kinds))
    assert len({d for d, _, _ in every}) == 1, every
    assert len({p for _, p, _ in every}) == 1
    assert all(kd == ["hierarchical"] for _, _, kd in every)


def test_a_lossless_codec_matches_the_flat_exchange(hvd, monkeypatch):
    """top-k keeping every value: the hierarchical average equals the flat allgather's up
    to the float32 rounding of the sums' order."""
    import hvdcompress

    k, _, _ = layout(hvd.size())
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", str(k))
    exact = lambda: hvdcompress.get_compressor("topk", ratio=1.0)  # noqa: E731
    flat, _, _ = _train(hvd, "allgather", exact(), 2)
    hier, _, kinds = _train(hvd, "hierarchical", exact(), 2)
    hvd.barrier()
    assert kinds == ["hierarchical"]
    for step_flat, step_hier in zip(flat, hier, strict=True):
        for a, b in zip(step_flat, step_hier, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_without_dynamic_process_sets_every_rank_is_told_how_to_enable_them(hvd, monkeypatch):
    t = make_transport("horovod")
    _, nodes, _ = layout(t.size)
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "0")
    with pytest.raises(RuntimeError, match="HOROVOD_DYNAMIC_PROCESS_SETS=1"):
        t.split(nodes)
    t.barrier()  # no rank was left in a collective
