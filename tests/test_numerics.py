"""Numerics of error feedback and of low-precision gradients (docs/error-feedback.md):
every error-feedback compressor keeps its residual bounded,
the optimizer feeds the rounding of a float16 / bfloat16 ``p.grad`` back into the
residuals, and reports a finite gradient that overflows the parameter's dtype."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import hvdcompress
from hvdcompress.compressors import registry
from hvdcompress.compressors.stochastic import Stochastic
from tests.helpers import LocalTransport, assert_error_feedback_invariant, powersgd_one_rank

# ---- bounded residuals -------------------------------------------------------------------


def _error_feedback_configs() -> list[tuple[str, dict]]:
    """Every example configuration that keeps a residual, and every example of a compressor
    with an ``error_feedback`` switch with the switch on (where its parameters allow it): a
    new error-feedback compressor is covered without an edit here."""
    out: list[tuple[str, dict]] = []
    for name, params in registry.examples():
        cls = registry.REGISTRY[name]
        candidates = [params]
        if "error_feedback" in cls.spec.params:
            on = {k: v for k, v in params.items() if k != "unbiased"}
            candidates.append({**on, "error_feedback": True})
        for p in candidates:
            try:
                comp = cls(**p)
            except ValueError:  # the switch on is refused with these parameters
                continue
            if comp.error_feedback and (name, p) not in out:
                out.append((name, p))
    return out


EF_CONFIGS = _error_feedback_configs()


def test_every_error_feedback_compressor_is_in_the_property_test():
    names = {n for n, _ in EF_CONFIGS}
    assert {"3lc", "topk", "topkq", "dgc", "efsignsgd", "powersgd", "randomk", "gspar"} <= names


@pytest.mark.parametrize("name,params", EF_CONFIGS, ids=[f"{n}-{p}" for n, p in EF_CONFIGS])
def test_error_feedback_residual_stays_bounded_over_1000_steps(name, params):
    """||e_t|| <= K max ||g||, K = 2 sqrt(1 - delta) / delta for a delta-contraction
    (``residual_bound``); a compressor that declares no delta gets delta = 1 / n, the
    contraction of sending just the largest entry. For a random compressor the bound holds
    for E||e||^2 (Karimireddy et al. 2019, Lemma 3), so the root mean square of ||e_t|| over
    the steps is checked, for a deterministic one every step. Gradients have a persistent
    direction (mean + noise), and step 0 is a zero gradient (a parameter unused in a step)."""
    shape, n, steps = (8, 8), 64, 1000
    c = hvdcompress.get_compressor(name, **params)
    c.bind(0, 1)
    bound = c.residual_bound(n)
    if bound is None:
        bound = 2.0 * math.sqrt(1.0 - 1.0 / n) * n
    torch.manual_seed(11)
    mean = torch.randn(shape)
    g_max, e_max, e_sq = 0.0, 0.0, 0.0
    for t in range(steps):
        g = torch.zeros(shape) if t == 0 else mean + torch.randn(shape)
        g_max = max(g_max, float(g.norm()))
        if c.summable:
            powersgd_one_rank(c, g, "w") if c.phases > 1 else c.compress(g, "w")
        else:
            c.compress(g, "w")
        e = c.memory.residuals["w"]
        assert bool(torch.isfinite(e).all()), f"step {t}"
        e_max = max(e_max, float(e.norm()))
        e_sq += float(e.norm()) ** 2
    measured = math.sqrt(e_sq / steps) if isinstance(c, Stochastic) else e_max
    assert measured <= bound * g_max, (measured, bound, g_max)


@pytest.mark.parametrize(
    "name,params",
    [
        ("gspar", {"ratio": 0.1, "error_feedback": True, "seed": 3}),
        ("randomk", {"ratio": 0.1, "error_feedback": True, "seed": 3}),
    ],
)
def test_random_sparsifiers_with_error_feedback_are_contractive_and_exact(name, params):
    c = hvdcompress.get_compressor(name, **params)
    assert 0.0 < c.contraction(100) <= 0.1 + 1e-6
    assert_error_feedback_invariant(c, n=500, steps=40, seed=5)
    # kept values travel unscaled: each decoded entry is a, the residual there is 0
    c = hvdcompress.get_compressor(name, **params)
    x = torch.randn(1000)
    dec = c.decompress(*c.compress(x, "w"))
    kept = dec != 0
    assert 0 < int(kept.sum()) < 1000
    assert torch.equal(dec[kept], x[kept])
    assert bool((c.memory.residuals["w"][kept] == 0).all())


def test_powersgd_keeps_its_q_after_a_zero_gradient():
    c = hvdcompress.get_compressor("powersgd")
    torch.manual_seed(0)
    powersgd_one_rank(c, torch.zeros(8, 8))
    assert float(c.qs["m"].norm()) > 0  # a zero Q would send nothing for ever
    g = torch.randn(8, 1) @ torch.randn(1, 8)  # rank 1: exact after one more step
    powersgd_one_rank(c, g)
    torch.testing.assert_close(powersgd_one_rank(c, g), g, rtol=1e-4, atol=1e-4)


# ---- low-precision p.grad: rounding feedback and overflow ---------------------------------


class TwinTransport(LocalTransport):
    """World size 2 in which rank 1 is an exact copy of rank 0 (same gradient, same
    payload), so ``op=Sum`` doubles and ``op=Average`` keeps the gradient."""

    size = 2

    def start_allgatherv(self, local, *, key=None):
        return self._done((torch.cat([local, local]), [local.numel()] * 2))

    def start_allreduce_sum(self, dense):
        return self._done(dense * 2)


def _drift(compression, dtype, transport, op, feedback=True, steps=1000):
    """max |sum(applied) + (what the residuals still owe) - sum(true)| over the entries,
    in float64, after ``steps`` steps of gradients of mean 0.1 (sum about 100)."""
    torch.manual_seed(1)
    shape = (16, 16)
    w = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD([w], lr=0.0), [("w", w)], compression=compression,
        backend=transport, op=op,
    )  # fmt: skip
    if not feedback:
        opt.compressor.absorb = lambda name, delta: False
    size = transport.size
    scale = 1.0 / size if op == hvdcompress.Average else 1.0
    applied = torch.zeros(shape, dtype=torch.float64)
    true = torch.zeros(shape, dtype=torch.float64)
    for _ in range(steps):
        g = 0.1 + 0.05 * torch.randn(shape)
        (w.float() * g).sum().backward()
        true += w.grad.double() * (size * scale)  # what the ranks' gradients average to
        opt.synchronize()
        applied += w.grad.double()
        opt.zero_grad()
    owed = opt.compressor.memory.residuals["w"].double().view(shape) * (size * scale)
    return float((applied + owed - true).abs().max()), float(true.abs().max())


CASES = [
    (comp, dtype, twin, op)
    for comp in ({"name": "3lc"}, {"name": "topk", "ratio": 0.1}, {"name": "powersgd"})
    for dtype in (torch.float16, torch.bfloat16)
    for twin, op in ((False, hvdcompress.Average), (True, hvdcompress.Sum))
]


@pytest.mark.parametrize(
    "params,dtype,twin,op",
    CASES,
    ids=[f"{c['name']}-{str(d)[6:]}-{'2' if t else '1'}-{o}" for c, d, t, o in CASES],
)
def test_low_precision_rounding_is_fed_back_into_the_residual(params, dtype, twin, op):
    """Sum of applied gradients plus the residuals tracks the sum of true gradients to
    float32 accuracy; without the feedback the fp16 / bf16 rounding drifts away."""
    params = dict(params)
    name = params.pop("name")

    def run(feedback):
        transport = TwinTransport() if twin else LocalTransport()
        return _drift(hvdcompress.get_compressor(name, **params), dtype, transport, op, feedback)

    drift, total = run(True)
    assert 50 < total < 500  # the sum of gradients the drift is measured against
    bound = 1e-6 * total  # float32 rounding of the error-feedback arithmetic over 1000 steps
    assert drift <= bound, (drift, bound)
    drift_without, _ = run(False)
    assert drift_without > 10 * bound, (drift_without, bound)  # the test can fail


# 3lc at s = 1.75 decodes 1.75 max|g|: beyond float16's range, and for bfloat16 (float32's
# exponent range) between its largest finite value and float32's, where the cast rounds to Inf
BIG = {torch.float16: 0.9 * 65504.0, torch.bfloat16: 3.4e38 / 1.75}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_finite_gradient_overflowing_the_dtype_is_reported_and_stays_inf(dtype):
    big = BIG[dtype]
    w = torch.nn.Parameter(torch.zeros(4, 8, dtype=dtype))
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD([w], lr=0.0), [("layer.w", w)],
        compression=hvdcompress.get_compressor("3lc", sparsity=1.75), backend=LocalTransport(),
    )  # fmt: skip
    w.grad = torch.ones(4, 8, dtype=dtype)  # ordinary values: nothing reported
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.synchronize()
    assert opt.last_stats.overflow == [] and opt.last_stats.nonfinite == []
    assert bool(torch.isfinite(w.grad).all())
    opt.zero_grad()
    g = torch.full((4, 8), big / 2, dtype=dtype)
    g[0, 0] = big
    w.grad = g.clone()
    with pytest.warns(RuntimeWarning, match=r"'layer.w'.*Inf"):
        opt.synchronize()
    assert bool(torch.isinf(w.grad).any())  # a GradScaler sees it and skips the step
    assert opt.last_stats.overflow == ["layer.w"] and opt.last_stats.nonfinite == []
    opt.zero_grad()
    # a gradient that really is non-finite: NaN / Inf in p.grad, not called an overflow
    w.grad = torch.ones(4, 8, dtype=dtype)
    w.grad[1, 1] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.synchronize()
    assert not bool(torch.isfinite(w.grad).all())
    assert opt.last_stats.overflow == [] and opt.last_stats.nonfinite == ["layer.w"]
