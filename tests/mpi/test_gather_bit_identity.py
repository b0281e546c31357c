"""Every gather-only codec through hvdcompress.DistributedOptimizer on real MPI ranks.

    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_gather_bit_identity.py

For each codec: the averaged gradient equals the mean of the individually decoded
payloads (each rank's payload decoded alone, summed in rank order) and is bit-identical
on every rank; codecs that draw random numbers draw them per rank. Codecs that decode
with side information (NDQSG) get, for rank r's payload, the mean of ranks 0 .. r-1's
decoded tensors.
"""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.compressors import REGISTRY
from tests.mpi.helpers import digest

pytestmark = pytest.mark.mpi(min_size=2)

GATHER_ONLY = sorted(name for name, cls in REGISTRY.items() if not cls.summable)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(40, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 5),
    )


@pytest.mark.parametrize("name", GATHER_ONLY)
def test_gather_only_codec_is_bit_identical_on_every_rank(name, comm):
    rank, size = comm.rank, comm.size
    model = _model()
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        compression=name,
        backend="mpi4py",
        exchange="allgather",  # the two-stage exchange: tests/mpi/test_twostage.py
    )
    results = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 40, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.synchronize()
        results.append({n: p.grad.clone() for n, p in model.named_parameters()})
        with opt.skip_synchronize():
            opt.step()

    # Reference for the last step: a fresh compressor of this rank, replayed to the same
    # step, makes the same payloads; each is decoded alone and summed in rank order.
    ref = hvdcompress.get_compressor(name)
    ref.bind(rank, size)
    model_ref = _model()
    opt_ref = torch.optim.SGD(model_ref.parameters(), lr=0.05)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 40, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt_ref.zero_grad()
        torch.nn.functional.cross_entropy(model_ref(x), y).backward()
        mine = {
            n: ref.compress(p.grad, n)[0].numpy().tobytes() for n, p in model_ref.named_parameters()
        }
        everyone = comm.allgather(mine)
        decoder = hvdcompress.get_compressor(name)
        decoder.bind(rank, size)
        side = getattr(decoder, "uses_side_info", False)
        for n, p in model_ref.named_parameters():
            acc = torch.zeros(p.numel(), dtype=torch.float32)
            for r in range(size):
                payload = torch.frombuffer(bytearray(everyone[r][n]), dtype=torch.uint8)
                kw = {"side_info": acc / r if r else None} if side else {}
                decoder.decode(payload, rank=r, name=n, out=acc, accumulate=True, **kw)
            p.grad.copy_((acc * (1.0 / size)).view_as(p.grad))
            assert torch.equal(p.grad, results[step][n]), f"{name} step {step} tensor {n}"
        opt_ref.step()

    digests = comm.allgather(digest(model.parameters()))
    assert len(set(digests)) == 1, f"{name}: parameters differ across ranks"
    assert local  # gradients were produced
    if hasattr(opt.compressor, "rank"):
        assert comm.allgather(opt.compressor.rank) == list(range(size))
