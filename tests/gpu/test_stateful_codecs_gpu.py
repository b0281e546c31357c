"""NDQSG, DGC and PowerSGD on the CUDA backend against the CPU backend: payloads and
decodes byte for byte (PowerSGD to rounding). Skips without CUDA kernels; run with
``-m gpu`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import bound, comp, powersgd_one_rank


@pytest.fixture(scope="module")
def cuda_device(gpu):
    """The device of tests/gpu/conftest.py's ``gpu`` fixture (which skips with the reason)."""
    return gpu.dev


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 513, 100003])
def test_gpu_payloads_and_decodes_match_cpu(cuda_device, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    y = x + 0.01 * torch.randn(n, generator=torch.Generator().manual_seed(n + 1))
    for name, kw, rank in [("ndqsg", {}, 0), ("ndqsg", {}, 1), ("dgc", {"ratio": 0.01}, 0)]:
        cpu_c, gpu_c = bound(name, rank, 2, **kw), bound(name, rank, 2, **kw)
        for _ in range(2):  # the second step reads DGC's velocity and residual
            pc, ctx = cpu_c.compress(x, "w")
            pg, ctxg = gpu_c.compress(x.to(cuda_device), "w")
            assert torch.equal(pc, pg.cpu()), name
            extra = {"side_info": y} if name == "ndqsg" else {}
            dc = bound(name, 0, 2, **kw).decode(pc, **extra)
            extra = {"side_info": y.to(cuda_device)} if name == "ndqsg" else {}
            dg = bound(name, 0, 2, **kw).decode(pc.to(cuda_device), **extra)
            assert torch.equal(dc, dg.cpu()), name
    ps_cpu, ps_gpu = comp("powersgd", matrix_rank=2), comp("powersgd", matrix_rank=2)
    m = torch.randn(64, 33)
    torch.testing.assert_close(
        powersgd_one_rank(ps_gpu, m.to(cuda_device)).cpu(),
        powersgd_one_rank(ps_cpu, m),
        rtol=1e-4,
        atol=1e-4,
    )
