"""NDQSG (SPEC 3), DGC and PowerSGD (SPEC 4) in one process: each method's defining
property, parameters, state, non-finite input, and their optimizer hooks (side
information, inner-momentum check, two-phase allreduce) with a world-size-1 transport.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress.codecs import ndqsg as ndqsg_codec
from hvdcompress.codecs import primitives as prim
from hvdcompress.compressors.powersgd import orthogonalize
from hvdcompress.wire import PayloadError
from tests.fuzzing import fix_checksum
from tests.local_transport import LocalTransport


def comp(name, **kw):
    return hvdcompress.get_compressor(name, **kw)


def bound(name, rank, size, **kw):
    c = comp(name, **kw)
    c.bind(rank, size)
    return c


def _deltas(w: torch.Tensor, levels: int, bucket: int) -> torch.Tensor:
    """delta1 of each element's bucket."""
    n = w.numel()
    pad = torch.cat([w.abs(), w.new_zeros(-n % bucket)]).view(-1, bucket)
    d = pad.amax(1) / float(levels)
    return d.repeat_interleave(bucket)[:n]


# ---- NDQSG ------------------------------------------------------------------------------

LEVELS = [(3, 1), (2, 1), (4, 1), (6, 2), (9, 1)]


@pytest.mark.parametrize("fine,coarse", LEVELS)
@pytest.mark.parametrize("n", [1, 511, 2000])
def test_ndqsg_equals_dqsg_reconstruction_when_side_info_is_close(fine, coarse, n):
    rho = fine // coarse
    torch.manual_seed(n)
    w = torch.randn(n)
    w[: n // 3] *= 0.01  # buckets of very different scales
    kw = {"fine_levels": fine, "coarse_levels": coarse, "bucket_size": 512, "seed": 5}
    nested = bound("ndqsg", 1, 2, **kw)
    payload, ctx = nested.compress(w, "w")
    assert nested.read_header(payload)[0].params[-1] == 1  # nested mode
    dq = comp("dqsg", levels=fine, bucket_size=512, seed=5, rank=1)
    want = dq.decompress(*dq.compress(w, "w"))  # delta1 (k - u) with the same dither
    delta = _deltas(w, fine, 512)
    noise = torch.rand(n) * 2 - 1  # |w - y| < (rho - 1) delta1 / 2
    y = w + noise * 0.99 * (rho - 1) / 2 * delta
    receiver = bound("ndqsg", 0, 2, **kw)
    got = receiver.decode(payload, side_info=y)
    assert torch.equal(got, want)
    out = torch.zeros(n)
    nested.decode(payload, side_info=y, out=out)
    assert torch.equal(out, want)
    assert nested.pop_metrics()["aliasing_rate_own"] == 0.0


@pytest.mark.parametrize("fine,coarse", LEVELS)
def test_ndqsg_aliases_when_side_info_is_far_and_reports_the_rate(fine, coarse):
    rho = fine // coarse
    torch.manual_seed(1)
    n = 3000
    w = torch.randn(n)
    kw = {"fine_levels": fine, "coarse_levels": coarse}
    nested = bound("ndqsg", 1, 2, **kw)
    payload, _ = nested.compress(w, "w")
    dq = comp("dqsg", levels=fine, rank=1)
    want = dq.decompress(*dq.compress(w, "w"))
    delta = _deltas(w, fine, 512)
    far = torch.arange(n) % 4 == 0  # a quarter of the elements: |w - y| >= rho/2 + 1/2 deltas
    y = w + torch.where(far, (rho / 2 + 0.6) * delta, 0.3 * (rho - 1) / 2 * delta)
    got = nested.decode(payload, side_info=y)
    assert torch.equal(got[~far], want[~far])
    assert not (got[far] == want[far]).any()
    # the error of an aliased value is a multiple of delta2 = rho delta1
    steps = ((got[far] - want[far]) / (rho * delta[far])).double()
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    metrics = nested.pop_metrics()
    assert metrics["aliasing_rate_own"] == pytest.approx(far.double().mean().item())
    assert nested.last_aliasing_rate == metrics["aliasing_rate_own"]
    assert nested.pop_metrics()["aliasing_rate_own"] is None  # reset


def test_ndqsg_estimate_from_dqsg_coded_ranks_and_through_the_gather_order():
    """Four ranks, D = 2: ranks 0, 1 send DQSG (rank 1's k gives the estimate), 2, 3 nested;
    decoding in rank order with the running mean as side information."""
    torch.manual_seed(2)
    base = torch.randn(4000)
    ws = [base + 0.02 * torch.randn(4000) for _ in range(4)]
    senders = [bound("ndqsg", r, 4) for r in range(4)]
    payloads = [s.compress(w, "w")[0] for s, w in zip(senders, ws, strict=True)]
    modes = [s.read_header(p)[0].params[-1] for s, p in zip(senders, payloads, strict=True)]
    assert modes == [0, 0, 1, 1]
    assert payloads[2].numel() < 0.7 * payloads[0].numel()  # quartic beats 3-bit codes
    receiver = senders[3]  # it remembers its own k
    acc = torch.zeros(4000)
    dqs = []
    for r, p in enumerate(payloads):
        y = acc / r if r else None
        if r == 1:
            y1 = y.clone()
        receiver.decode(p, out=acc, accumulate=True, side_info=y)
        dq = comp("dqsg", rank=r)
        dqs.append(dq.decompress(*dq.compress(ws[r], "w")))
    # close side information: every nested value is its DQSG reconstruction
    ref = torch.zeros(4000)
    for d in dqs:
        ref += d
    torch.testing.assert_close(acc, ref, rtol=0, atol=1e-5)
    metrics = receiver.pop_metrics()
    assert metrics["aliasing_rate_own"] == 0.0  # rank 3 checked its own payload
    # the estimate: rank 1's k, re-decoded from its coset with y1
    q, deltas = __import__("hvdcompress").codecs.dqsg.decode_q(
        payloads[1][receiver.read_header(payloads[1])[0].size :], 4000, 3, 512
    )
    key = prim.rng_key(0, 0, 1, prim.tensor_id("w"))
    _, k_hat = ndqsg_codec.side_decode(ndqsg_codec.coset(q, 3), deltas, y1, 3, 512, key)
    assert metrics["aliasing_rate_estimate"] == ndqsg_codec.aliased(q, k_hat) / 4000
    assert receiver.last_aliasing_rate == metrics["aliasing_rate_estimate"]


def test_ndqsg_nested_payload_needs_side_info_and_the_agreed_mode():
    w = torch.randn(700)
    payload, ctx = bound("ndqsg", 1, 2).compress(w, "w")
    with pytest.raises(PayloadError, match="side_info"):
        bound("ndqsg", 0, 2).decode(payload)
    with pytest.raises(PayloadError, match="mode"):  # with 4 ranks rank 1 sends DQSG
        bound("ndqsg", 0, 4).decode(payload, side_info=w)
    with pytest.raises(PayloadError, match="levels"):
        bound("ndqsg", 0, 2, dqsg_fraction=0.75).decode(payload, side_info=w)
    with pytest.raises(PayloadError, match="side_info"):
        bound("ndqsg", 0, 2).decode(payload, side_info=w[:5])
    # a DQSG-mode payload decodes alone, no side information needed
    p0, ctx0 = bound("ndqsg", 0, 2).compress(w, "w")
    dq = comp("dqsg")
    assert torch.equal(
        bound("ndqsg", 1, 2).decompress(p0, ctx0), dq.decompress(*dq.compress(w, "w"))
    )


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 0, 3), (3, 5), (10007,)])
def test_ndqsg_roundtrip_shape_dtype(rank, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    c = bound("ndqsg", rank, 2)
    payload, ctx = c.compress(x, "t")
    y = x.to(torch.float32).reshape(-1)
    out = bound("ndqsg", 0, 2).decode(payload, side_info=y)
    assert out.shape == x.shape and out.dtype == dtype
    if x.numel():
        assert (out.float() - x.float()).abs().max() <= x.float().abs().max() / 3 * 1.01 + 1e-2


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_ndqsg_nonfinite_input_is_flagged(bad):
    x = torch.randn(100)
    x[3] = bad
    for rank in (0, 1):
        payload, ctx = bound("ndqsg", rank, 2).compress(x, "w")
        header, _ = hvdcompress.get_compressor("ndqsg").read_header(payload)
        assert header.nonfinite and header.body_len == 0
        assert bound("ndqsg", 0, 2).decode(payload).isnan().all()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"fine_levels": 0}, r"\[1, 127\]"),
        ({"fine_levels": 128}, r"\[1, 127\]"),
        ({"coarse_levels": 2}, "integer rho >= 2"),
        ({"fine_levels": 3, "coarse_levels": 3}, "integer rho >= 2"),
        ({"dqsg_fraction": 0.0}, r"\(0, 1\]"),
        ({"dqsg_fraction": 1.5}, r"\(0, 1\]"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"seed": -1}, "seed"),
    ],
)
def test_ndqsg_parameters_out_of_range_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        comp("ndqsg", **kw)


def test_ndqsg_state_dict_roundtrip():
    c = bound("ndqsg", 1, 2)
    x = torch.randn(600)
    c.compress(x, "w")
    d = bound("ndqsg", 1, 2)
    d.load_state_dict(c.state_dict())
    assert torch.equal(c.compress(x, "w")[0], d.compress(x, "w")[0])


def test_ndqsg_optimizer_passes_side_info_and_reports_metrics():
    model = torch.nn.Linear(30, 20)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression="ndqsg",
        backend=LocalTransport(),
    )
    model(torch.randn(4, 30)).sum().backward()
    opt.step()
    # one rank: it sends DQSG, there is nothing to estimate from
    assert opt.last_stats.metrics == {"aliasing_rate_estimate": None, "aliasing_rate_own": None}


# ---- DGC --------------------------------------------------------------------------------


def _dgc_reference(gs, ratio, momentum):
    """NumPy DGC: momentum correction and factor masking, top-k by |v| (ties low index)."""
    n = gs[0].size
    u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    sent = []
    for g in gs:
        u = (u * np.float32(momentum) + g).astype(np.float32)
        v = (v + u).astype(np.float32)
        k = max(1, math.ceil(n * ratio))
        idx = np.sort(np.argsort(-np.abs(v), kind="stable")[:k])
        s = np.zeros(n, np.float32)
        s[idx] = v[idx]
        sent.append(s)
        u[idx] = 0
        v[idx] = 0
    return sent, u, v


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dgc_momentum_correction_and_factor_masking(momentum):
    rng = np.random.default_rng(3)
    gs = [rng.standard_normal(500).astype(np.float32) for _ in range(6)]
    c = comp("dgc", ratio=0.05, momentum=momentum)
    got = [c.decompress(*c.compress(torch.from_numpy(g), "w")).numpy() for g in gs]
    sent, u, v = _dgc_reference(gs, 0.05, momentum)
    for a, b in zip(got, sent, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c.velocity.residuals["w"].numpy(), u)
    np.testing.assert_array_equal(c.memory.residuals["w"].numpy(), v)
    kept = got[-1] != 0
    assert (c.velocity.residuals["w"].numpy()[kept] == 0).all()  # masking
    assert (c.memory.residuals["w"].numpy()[kept] == 0).all()


def test_dgc_without_momentum_is_error_feedback_top_k():
    torch.manual_seed(4)
    c = comp("dgc", ratio=0.02, momentum=0.0)
    total_g, total_dec = torch.zeros(400), torch.zeros(400)
    for _ in range(15):
        g = torch.randn(400)
        total_g += g
        total_dec += c.decompress(*c.compress(g, "w"))
    torch.testing.assert_close(total_dec + c.memory.residuals["w"], total_g)


def test_dgc_warmup_schedule():
    # the paper's: 4 warm-up epochs (stages), sparsity 75 %, 93.75 %, 98.4 %, 99.6 %, 99.9 %
    c = comp("dgc", ratio=0.001, warmup_steps=40, warmup_stages=4)
    dens = [c.density(t) for t in (0, 9, 10, 19, 20, 30, 39, 40, 1000)]
    want = [0.25, 0.25, 0.0628, 0.0628, 0.0158, 0.00397, 0.00397, 0.001, 0.001]
    for d, w in zip(dens, want, strict=True):
        assert d == pytest.approx(w, rel=0.01)
    # continuous: exponential, strictly decreasing to ratio
    c = comp("dgc", ratio=0.01, warmup_steps=10)
    dens = [c.density(t) for t in range(12)]
    assert dens[0] == 0.25 and dens[10] == dens[11] == 0.01
    assert all(a > b for a, b in zip(dens[:10], dens[1:11], strict=True))
    ratios = [b / a for a, b in zip(dens[:10], dens[1:11], strict=True)]
    assert max(ratios) == pytest.approx(min(ratios))
    # the payloads follow it: k = ceil(density * n)
    for t in range(12):
        dec = c.decompress(*c.compress(torch.randn(1000) + 5.0, "w"))
        assert int(dec.count_nonzero()) == math.ceil(1000 * dens[t])
    assert comp("dgc", ratio=0.5, warmup_steps=10).density(0) == 0.5  # no warm-up above 0.25


def test_dgc_receiver_checks_the_schedule():
    sender = comp("dgc", ratio=0.01, warmup_steps=10)
    payload, ctx = sender.compress(torch.randn(300), "w")
    with pytest.raises(PayloadError, match="density"):
        comp("dgc", ratio=0.01).decompress(payload, ctx)
    with pytest.raises(PayloadError, match="ratio"):
        comp("dgc", ratio=0.02, warmup_steps=10).decompress(payload, ctx)
    raw = bytearray(payload.numpy().tobytes())
    header, _ = sender.read_header(payload)
    off = header.size - 8  # the density double
    raw[off : off + 8] = np.float64(0.5).tobytes()
    forged = torch.frombuffer(bytearray(fix_checksum(raw)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="density"):
        comp("dgc", ratio=0.01, warmup_steps=10).decompress(forged, ctx)


def test_dgc_local_clipping_scales_by_world_size():
    g = torch.randn(100) * 10
    c = bound("dgc", 0, 4, ratio=1.0, momentum=0.0, clip_norm=2.0)
    dec = c.decompress(*c.compress(g, "w"))
    assert float(dec.norm()) == pytest.approx(1.0, rel=1e-4)  # 2 / sqrt(4)
    torch.testing.assert_close(dec / dec.norm(), g / g.norm())
    small = torch.full((100,), 1e-3)
    assert torch.equal(c.decompress(*c.compress(small, "s")), small)  # under the limit


def test_dgc_nonfinite_keeps_state_and_state_dict_roundtrip():
    c = comp("dgc", ratio=0.1)
    x = torch.randn(200)
    c.compress(x, "w")
    u, v = c.velocity.residuals["w"].clone(), c.memory.residuals["w"].clone()
    bad = x.clone()
    bad[0] = float("nan")
    payload, ctx = c.compress(bad, "w")
    assert c.read_header(payload)[0].nonfinite and c.decompress(payload, ctx).isnan().all()
    assert torch.equal(c.velocity.residuals["w"], u) and torch.equal(c.memory.residuals["w"], v)
    d = comp("dgc", ratio=0.1)
    d.load_state_dict(c.state_dict())
    assert torch.equal(c.compress(x, "w")[0], d.compress(x, "w")[0])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"ratio": 0.0}, r"\(0, 1\]"),
        ({"momentum": 1.0}, r"\[0, 1\)"),
        ({"momentum": -0.1}, r"\[0, 1\)"),
        ({"clip_norm": -1.0}, ">= 0"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 4, "warmup_stages": 5}, "warmup_stages"),
    ],
)
def test_dgc_parameters_out_of_range_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        comp("dgc", **kw)


def test_dgc_refuses_an_inner_optimizer_with_momentum():
    model = torch.nn.Linear(5, 3)
    with pytest.raises(ValueError, match="momentum=0"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            compression="dgc",
            backend=LocalTransport(),
        )
    for inner, dgc in ((0.0, "dgc"), (0.9, hvdcompress.get_compressor("dgc", momentum=0.0))):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=inner),
            model.named_parameters(),
            compression=dgc,
            backend=LocalTransport(),
        )


# ---- PowerSGD ---------------------------------------------------------------------------


def _one_rank(c, g, name="m"):
    p, ctx = c.compress(g, name)
    q = c.next_phase(p, ctx, 1)
    return c.decompress(q, ctx)


@pytest.mark.parametrize("r", [1, 2, 4])
@pytest.mark.parametrize("shape", [(40, 30), (16, 3, 3, 3)])
def test_powersgd_is_exact_on_a_rank_r_matrix_after_one_step(r, shape):
    torch.manual_seed(r)
    n, m = shape[0], math.prod(shape[1:])
    g = (torch.randn(n, r) @ torch.randn(r, m)).view(shape)
    c = comp("powersgd", matrix_rank=r)
    out = _one_rank(c, g)
    torch.testing.assert_close(out, g, rtol=1e-4, atol=1e-4)
    assert float(c.memory.residuals["m"].abs().max()) < 1e-4 * float(g.abs().max())


def test_powersgd_error_feedback_invariant_and_warm_start():
    torch.manual_seed(5)
    c = comp("powersgd", matrix_rank=2)
    total_g, total_dec = torch.zeros(30, 20), torch.zeros(30, 20)
    for _ in range(8):
        g = torch.randn(30, 20)
        e_before = c.memory.residuals.get("m", torch.zeros(600)).clone()
        dec = _one_rank(c, g)
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
    _one_rank(c, torch.randn(10, 8))
    e, q = c.memory.residuals["m"].clone(), c.qs["m"].clone()
    bad = torch.randn(10, 8)
    bad[2, 3] = float("inf")
    out = _one_rank(c, bad)
    assert not torch.isfinite(out).all()
    assert torch.equal(c.memory.residuals["m"], e) and torch.equal(c.qs["m"], q)


def test_powersgd_state_dict_roundtrip_and_parameters():
    torch.manual_seed(7)
    c = comp("powersgd", matrix_rank=2, seed=3)
    for _ in range(3):
        _one_rank(c, torch.randn(12, 9))
    d = comp("powersgd", matrix_rank=2, seed=3)
    d.load_state_dict(c.state_dict())
    g = torch.randn(12, 9)
    assert torch.equal(_one_rank(c, g), _one_rank(d, g))
    with pytest.raises(ValueError, match="matrix_rank"):
        comp("powersgd", matrix_rank=1, seed=3).load_state_dict(c.state_dict())
    for bad in (0, 65, 1.5, True):
        with pytest.raises(ValueError, match=r"\[1, 64\]"):
            comp("powersgd", matrix_rank=bad)
    with pytest.raises(ValueError, match="seed"):
        comp("powersgd", seed=-1)


def test_powersgd_optimizer_runs_two_allreduces_per_bucket():
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 3))
    transport = LocalTransport()
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(),
        compression=hvdcompress.get_compressor("powersgd", matrix_rank=2),
        backend=transport,
        fusion_threshold=0,  # one tensor per bucket: 2 matrices, 2 vectors
    )
    ref = hvdcompress.get_compressor("powersgd", matrix_rank=2)
    x = torch.randn(5, 12)
    calls = transport.calls
    model(x).sum().backward()  # starts the P allreduces
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    # P and Q for each matrix, one allreduce for each vector (its Q phase is empty)
    assert transport.calls - calls == 2 * 2 + 2
    assert opt.last_stats.collectives == 6
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, _one_rank(ref, grads[n], n), rtol=0, atol=0)
    with opt.skip_synchronize():
        opt.step()
    state = opt.state_dict()["hvdcompress"]["compressor_state"]
    assert set(state["qs"]) == {"0.weight", "1.weight"}


# ---- GPU (skips without CUDA kernels; run with -m gpu on a GPU machine) -----------------


@pytest.fixture(scope="module")
def cuda_device():
    from hvdcompress.backends import cuda as cuda_backend

    reason = cuda_backend.gpu_unavailable_reason()
    if reason is not None:
        pytest.skip(f"CUDA kernels cannot run here: {reason}")
    return torch.device("cuda", torch.cuda.current_device())


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
        _one_rank(ps_gpu, m.to(cuda_device)).cpu(), _one_rank(ps_cpu, m), rtol=1e-4, atol=1e-4
    )
