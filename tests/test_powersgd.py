"""PowerSGD (docs/baselines.md) in one process: exact on low-rank matrices, error
feedback and the
warm-started Q, orthogonalisation, vectors sent as they are, non-finite input, state.
A world size of one: the allreduced P is the local P (tests.helpers.powersgd_one_rank)."""

from __future__ import annotations

import math

import pytest
import torch

from hvdcompress.compressors.powersgd import orthogonalize
from tests.helpers import comp, powersgd_one_rank


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("shape", [(40, 30), (16, 3, 3, 3)])
def test_powersgd_is_exact_on_a_rank_r_matrix_after_one_step(r, shape):
    torch.manual_seed(r)
    n, m = shape[0], math.prod(shape[1:])
    g = (torch.randn(n, r) @ torch.randn(r, m)).view(shape)
    c = comp("powersgd", matrix_rank=r)
    out = powersgd_one_rank(c, g)
    torch.testing.assert_close(out, g, rtol=1e-4, atol=1e-4)
    assert float(c.memory.residuals["m"].abs().max()) < 1e-4 * float(g.abs().max())


def test_powersgd_error_feedback_invariant_and_warm_start():
    torch.manual_seed(5)
    c = comp("powersgd", matrix_rank=2)
    total_g, total_dec = torch.zeros(30, 20), torch.zeros(30, 20)
    for _ in range(8):
        g = torch.randn(30, 20)
        e_before = c.memory.residuals.get("m", torch.zeros(600)).clone()
        dec = powersgd_one_rank(c, g)
        # decoded + new residual == gradient + old residual (one rank: local == summed Q)
        torch.testing.assert_close(
            dec + c.memory.residuals["m"].view(30, 20), g + e_before.view(30, 20)
        )
        total_g += g
        total_dec += dec
        assert c.qs["m"].shape == (20, 2)
    torch.testing.assert_close(total_dec + c.memory.residuals["m"].view(30, 20), total_g)


def test_powersgd_orthogonalize():
    torch.manual_seed(6)
    p = orthogonalize(torch.randn(50, 4))
    torch.testing.assert_close(p.t() @ p, torch.eye(4), atol=1e-5, rtol=0)
    dep = torch.randn(50, 1).repeat(1, 3)  # rank 1: the later columns become zero
    p = orthogonalize(dep)
    assert float(p[:, 0].norm()) == pytest.approx(1.0)
    assert torch.equal(p[:, 1:], torch.zeros(50, 2))
    assert torch.equal(orthogonalize(torch.zeros(5, 2)), torch.zeros(5, 2))


@pytest.mark.parametrize("shape", [(), (0,), (7,), (7, 0, 3), (3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_powersgd_vectors_go_as_they_are_shapes_and_dtypes(shape, dtype):
    x = torch.randn(shape).to(dtype)
    c = comp("powersgd", matrix_rank=4)
    p, ctx = c.compress(x, "t")
    q = c.next_phase(p, ctx, 1)
    out = c.decompress(q, ctx)
    assert out.shape == x.shape and out.dtype == dtype
    if x.dim() < 2:
        assert torch.equal(out, x) and q.numel() == 0 and p.numel() == x.numel()
    else:  # 3 x 5 at rank min(4, 3, 5) = 3: exact up to rounding
        torch.testing.assert_close(out.float(), x.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(TypeError, match="allreduce"):
        c.decode(p)


def test_powersgd_nonfinite_keeps_residual_and_q():
    c = comp("powersgd", matrix_rank=1)
    powersgd_one_rank(c, torch.randn(10, 8))
    e, q = c.memory.residuals["m"].clone(), c.qs["m"].clone()
    bad = torch.randn(10, 8)
    bad[2, 3] = float("inf")
    out = powersgd_one_rank(c, bad)
    assert not torch.isfinite(out).all()
    assert torch.equal(c.memory.residuals["m"], e) and torch.equal(c.qs["m"], q)


def test_powersgd_state_dict_roundtrip_and_parameters():
    torch.manual_seed(7)
    c = comp("powersgd", matrix_rank=2, seed=3)
    for _ in range(3):
        powersgd_one_rank(c, torch.randn(12, 9))
    d = comp("powersgd", matrix_rank=2, seed=3)
    d.load_state_dict(c.state_dict())
    g = torch.randn(12, 9)
    assert torch.equal(powersgd_one_rank(c, g), powersgd_one_rank(d, g))
    with pytest.raises(ValueError, match="matrix_rank"):
        comp("powersgd", matrix_rank=1, seed=3).load_state_dict(c.state_dict())
    for bad in (0, 65, 1.5, True):
        with pytest.raises(ValueError, match=r"\[1, 64\]"):
            comp("powersgd", matrix_rank=bad)
    with pytest.raises(ValueError, match="seed"):
        comp("powersgd", seed=-1)


@pytest.mark.parametrize("r", [1, 3])
def test_powersgd_decompress_into_writes_the_scaled_average_and_the_same_state(r):
    """The exchange's one-pass write (``decompress_into``) gives what ``decompress`` and a
    scale give, and leaves the same residual and warm start; a non-matrix too."""
    torch.manual_seed(7)
    a, b = comp("powersgd", matrix_rank=r), comp("powersgd", matrix_rank=r)
    for _ in range(4):
        for name, shape in (("m", (12, 2, 5)), ("v", (9,))):
            g = torch.randn(shape)
            want = powersgd_one_rank(a, g, name) * 0.25
            p, ctx = b.compress(g, name)
            q = b.next_phase(p, ctx, 1)
            out = torch.full(shape, float("nan"))
            assert b.decompress_into(q, ctx, out, 0.25)
            torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b.memory.residuals["m"], a.memory.residuals["m"])
        torch.testing.assert_close(b.qs["m"], a.qs["m"])


def test_powersgd_decompress_into_refuses_what_it_cannot_write_and_keeps_the_step():
    c = comp("powersgd", matrix_rank=1)
    p, ctx = c.compress(torch.randn(6, 4), "m")
    q = c.next_phase(p, ctx, 1)
    for out in (torch.zeros(6, 4, dtype=torch.float16), torch.zeros(4, 6).t(), torch.zeros(5)):
        assert not c.decompress_into(q, ctx, out, 0.5)
    assert c.decompress(q, ctx).shape == (6, 4)  # the pending step was not consumed


def test_powersgd_forms_m_in_two_buffers_that_take_turns():
    """M = g + e is formed in a buffer kept per tensor and becomes the next residual: two
    buffers of the gradient's size serve every step, none is allocated per step."""
    c = comp("powersgd", matrix_rank=2)
    seen = set()
    for _ in range(6):
        powersgd_one_rank(c, torch.randn(30, 20))
        seen.add(c.memory.residuals["m"].data_ptr())
    assert len(seen) == 2
