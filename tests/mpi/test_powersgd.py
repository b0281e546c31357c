"""PowerSGD through hvdcompress.DistributedOptimizer on real MPI ranks: two allreduces
per bucket (P, then Q); the averaged gradient is identical on every rank and equals the
reference computed from the allreduced P and Q by hand. (Its checkpoints are in
test_checkpoint.py.)

    mpirun -np 2 python -m pytest --with-mpi tests/mpi/test_powersgd.py -q
    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_powersgd.py
"""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.compressors.powersgd import orthogonalize
from tests.mpi.helpers import batch, digest, make_model, wrap

pytestmark = pytest.mark.mpi(min_size=2)


def _allreduce(comm, t: torch.Tensor) -> torch.Tensor:
    from mpi4py import MPI

    out = torch.empty_like(t)
    comm.Allreduce([t.contiguous().numpy(), MPI.FLOAT], [out.numpy(), MPI.FLOAT], op=MPI.SUM)
    return out


@pytest.mark.parametrize("r", [1, 2, 4])
def test_powersgd_identical_on_every_rank_and_equal_to_the_reference(r, comm):
    rank, size = comm.rank, comm.size
    model = make_model()
    opt = wrap(model, hvdcompress.get_compressor("powersgd", matrix_rank=r), fusion_threshold=0)
    ref = hvdcompress.get_compressor("powersgd", matrix_rank=r)  # by hand, below
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.synchronize()
        for n, p in model.named_parameters():
            g = local[n]
            if g.dim() < 2:
                want = _allreduce(comm, g.float()) / size
            else:
                m = g.reshape(g.shape[0], -1) + ref.memory.residual(n, g.reshape(-1)).view(
                    g.shape[0], -1
                )
                rr = min(r, *m.shape)
                q = ref._q(n, m.shape[1], rr, m.device)
                p_hat = orthogonalize(_allreduce(comm, m @ q))
                q_local = m.t() @ p_hat
                q_sum = _allreduce(comm, q_local)
                ref.memory.residuals[n] = (m - p_hat @ q_local.t()).reshape(-1)
                ref.qs[n] = q_sum
                want = (p_hat @ q_sum.t()).view(g.shape) / size
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
        digests = comm.allgather(digest(p.grad for p in model.parameters()))
        assert len(set(digests)) == 1, f"step {step}: gradients differ across ranks"
        with opt.skip_synchronize():
            opt.step()
    # P then Q for each matrix, one allreduce for each vector
    matrices = sum(p.dim() >= 2 for p in model.parameters())
    vectors = sum(p.dim() < 2 for p in model.parameters())
    assert opt.last_stats.collectives == 2 * matrices + vectors
