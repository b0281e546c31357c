"""Policies (docs/policies.md) in one process: Accordion's rule, its test
vector, LR-drop and first-interval rules, per-tensor levels of 3LC / top-k / PowerSGD,
and CAT's budget against brute force, calibration, affine vs packet models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress.checkpoint import CheckpointError
from hvdcompress.policies import (
    CAT,
    Accordion,
    AffineCost,
    PacketCost,
    accordion_critical,
    calibrate,
    cat_best_budget,
)
from hvdcompress.policies.cat import HEADER_BITS, budget_bits, descent
from hvdcompress.wire import PayloadError
from tests.helpers import LocalTransport, small_model


def _opt(model, compression, policy, lr=0.1):
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr),
        model.named_parameters(),
        compression=compression,
        backend=LocalTransport(),
        policy=policy,
    )


def _step(model, opt, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 10, generator=g) * scale
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def test_spec_accordion_test_vector():
    assert accordion_critical([1.0, 2.0, 0.0], [1.6, 1.1, 0.3], eta=0.5) == [True, False, True]


def test_first_interval_uses_low_then_switches_on_the_rule(model):
    pol = Accordion(low=1.0, high=1.9, interval_steps=2)
    opt = _opt(model, "3lc", pol)
    comp = opt.compressor
    names = [n for n, _ in model.named_parameters()]
    assert all(comp.level(n) == 1.0 for n in names)  # first interval: low
    for s in range(2):
        _step(model, opt, seed=s)
    assert pol.history[-1]["reason"] == "first"  # no previous norms yet: still low
    assert all(comp.level(n) == 1.0 for n in names)
    for s in range(2):  # same-size gradients: small change -> high compression
        _step(model, opt, seed=s)
    assert pol.history[-1]["reason"] == "norms"
    assert all(comp.level(n) == 1.9 for n in names)
    assert opt.last_stats.metrics[f"level/{names[0]}"] == 1.0  # in force during that step
    _step(model, opt, seed=0)
    assert opt.last_stats.metrics[f"level/{names[0]}"] == 1.9
    _step(model, opt, scale=10.0, seed=1)  # gradients 10x larger: critical -> low
    assert all(comp.level(n) == 1.0 for n in names)


def test_lr_drop_forces_low_for_the_next_interval(model):
    pol = Accordion(low=1.0, high=1.9)  # interval = epoch: end_epoch()
    opt = _opt(model, "3lc", pol)
    names = [n for n, _ in model.named_parameters()]
    for epoch in range(2):
        _step(model, opt, seed=epoch)
        pol.end_epoch()
    assert all(opt.compressor.level(n) == 1.9 for n in names)
    # the scheduler steps after end_epoch(): the next interval's first gradient sees it
    for g in opt.param_groups:
        g["lr"] *= 0.1
    _step(model, opt, seed=2)
    assert pol.history[-1]["reason"] == "lr_drop"
    assert all(opt.compressor.level(n) == 1.0 for n in names)
    pol.end_epoch()  # same-size norms, no new drop: back to high
    assert all(opt.compressor.level(n) == 1.9 for n in names)
    # the scheduler steps before end_epoch(): the decision itself sees it
    _step(model, opt, seed=3)
    for g in opt.param_groups:
        g["lr"] *= 0.1
    pol.end_epoch()
    assert pol.history[-1]["reason"] == "lr_drop"
    assert all(opt.compressor.level(n) == 1.0 for n in names)


@pytest.mark.parametrize(
    "compression, low, high", [("topk", 0.5, 0.1), ("powersgd", 2, 1), ("3lc", 1.0, 1.9)]
)
def test_levels_switch_and_residual_survives(compression, low, high, model):
    pol = Accordion(low=low, high=high, interval_steps=1)
    opt = _opt(model, compression, pol)
    comp = opt.compressor
    for s in range(4):
        _step(model, opt, seed=s % 2)
        residuals = dict(comp.memory.state_dict())
        assert residuals  # error feedback is kept through the switches
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert {pol.current[n] for n in pol.names} <= {low, high}
    assert any(h["levels"][pol.names[0]] == high for h in pol.history)


def test_threelc_per_tensor_level_checked_per_name():
    comp = hvdcompress.get_compressor("3lc")
    comp.set_level("a", 1.5)
    payload, ctx = comp.compress(torch.randn(50), "a")
    comp.decompress(payload, ctx)  # expected level of "a" is 1.5
    comp.set_level("a", 1.0)  # receiver decided differently: refused
    with pytest.raises(PayloadError, match="sparsity"):
        comp.decompress(payload, ctx)
    with pytest.raises(ValueError):
        comp.set_level("a", 2.0)


def test_accordion_refuses_a_compressor_without_levels():
    with pytest.raises(TypeError, match="per-tensor levels"):
        _opt(small_model(), "fp16", Accordion(low=1.0, high=1.9))


def _randomk_descent_by_bisection(a: np.ndarray, T: int) -> float:
    """||g||^4 / sum(g_i^2 / p_i) with c found by bisection on sum min(1, c a) = T."""
    nz = a > 0
    if T >= nz.sum():
        return float((a**2).sum())
    lo, hi = 0.0, 1.0
    while np.minimum(1, hi * a).sum() < T:
        hi *= 2
    for _ in range(200):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.minimum(1, c * a).sum() < T else (lo, c)
    p = np.minimum(1, hi * a)
    return float((a**2).sum() ** 2 / (a[nz] ** 2 / p[nz]).sum())


def _brute(grad, cost, kind):
    g = np.abs(grad.double().numpy())
    n = g.size
    best, best_t = -1.0, None
    for T in range(1, n + 1):
        if T > 1 and budget_bits(T, n, kind) > 32 * n + HEADER_BITS:
            break  # never a payload larger than the dense tensor
        top = np.sort(g)[::-1][:T]
        if kind == "topk":
            d = (top**2).sum()
        elif kind == "topk+q":
            d = top.sum() ** 2 / T
        else:
            d = _randomk_descent_by_bisection(g, T)
        r = d / float(cost(budget_bits(T, n, kind)))
        if r > best * (1 + 1e-9):  # bisection's last digits must not move a tie
            best, best_t = r, T
    return best_t


@pytest.mark.parametrize("kind", ["topk", "topk+q", "randomk"])
@pytest.mark.parametrize(
    "cost", [AffineCost(1e-4, 1e-9), AffineCost(1e-6, 1e-8), PacketCost(1e-5, 1e-6, 1024)]
)
def test_cat_budget_is_the_brute_force_argmax(kind, cost):
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grad = torch.randn(300, generator=g) * torch.rand(300, generator=g) ** 3
        T, ratio, c = cat_best_budget(grad, cost, kind)
        assert T == _brute(grad, cost, kind)
        assert c == pytest.approx(float(cost(budget_bits(T, 300, kind))))


def test_cat_never_sends_more_than_the_dense_tensor():
    grad = torch.randn(1000)
    T, _, c = cat_best_budget(grad, AffineCost(1.0, 1e-12))  # huge fixed cost: as many as allowed
    assert T == 500  # 500 x (32 + 32) bits = the dense 32000 bits
    # 4 ranks: an allgather moves 3 payloads, a ring allreduce 1.5 dense tensors
    assert cat_best_budget(grad, AffineCost(1.0, 1e-12), dense_fraction=0.5)[0] == 250
    flat = torch.ones(1000)  # D(T) = T for top-k + sign: the cap decides
    assert cat_best_budget(flat, AffineCost(1.0, 1e-12), "topk+q")[0] == (32000 + 384 - 32) // 33


def test_cat_zero_fixed_cost_degenerates_to_one():
    grad = torch.randn(100)  # no fixed cost, no header: T* = 1 (docs/policies.md, "CAT")
    assert cat_best_budget(grad, AffineCost(0.0, 1e-9), header_bits=0)[0] == 1
    assert cat_best_budget(grad, AffineCost(0.0, 1e-9))[0] > 1  # the header is a fixed cost


def test_randomk_descent_matches_formula():
    grad = torch.tensor([3.0, -2.0, 1.0, 0.5, 0.0])
    d = descent(grad, "randomk")
    a = np.abs(grad.numpy().astype(np.float64))
    for T in range(1, 4):
        lo, hi = 0.0, 100.0  # bisection for c with sum min(1, c a) = T
        for _ in range(200):
            c = (lo + hi) / 2
            lo, hi = (c, hi) if np.minimum(1, c * a).sum() < T else (lo, c)
        p = np.minimum(1, c * a)
        nz = a > 0
        expect = (a**2).sum() ** 2 / (a[nz] ** 2 / p[nz]).sum()
        assert d[T - 1] == pytest.approx(expect, rel=1e-6)
    assert d[-1] == pytest.approx((a**2).sum())
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(60, generator=g) ** 3
    grad[::7] = 0.0
    d = descent(grad, "randomk")
    a = np.abs(grad.double().numpy())
    for T in range(1, 61):
        assert d[T - 1] == pytest.approx(_randomk_descent_by_bisection(a, T), rel=1e-7)


def test_affine_and_packet_models_pick_different_budgets():
    # 1000 entries, a few large: affine with a small fixed cost stops after the large ones;
    # packets of 64 values (64 x 64 bits) make every entry of the first packet free.
    grad = torch.cat([torch.full((4,), 10.0), torch.full((996,), 0.5)])
    affine = AffineCost(1e-6, 1e-8)
    packet = PacketCost(1e-6, 64 * 64 * 1e-8, 64 * 64)
    t_aff = cat_best_budget(grad, affine)[0]
    t_pkt = cat_best_budget(grad, packet)[0]
    assert t_aff == 4
    assert t_pkt != t_aff and (t_pkt + 6) % 64 == 0  # fills a whole packet (header: 6 slots)


class _FakeTimedTransport(LocalTransport):
    """Each allgatherv of b bytes takes c0 + c1 * 8b seconds of a fake clock (+ noise)."""

    def __init__(self, c0, c1, noise=0.0):
        super().__init__()
        self.c0, self.c1, self.now, self.noise = c0, c1, 0.0, noise
        self.rng = np.random.default_rng(0)

    def clock(self):
        return self.now

    def start_allgatherv(self, local, *, key=None):
        self.now += self.c0 + self.c1 * 8 * local.numel() + self.noise * self.rng.standard_normal()
        return super().start_allgatherv(local)


def test_calibration_recovers_c0_c1():
    t = _FakeTimedTransport(2e-5, 3e-10, noise=1e-8)
    model = calibrate(t, sizes=(1, 1024, 65536, 1 << 20), repeats=3, clock=t.clock)
    assert model.c0 == pytest.approx(2e-5, rel=0.05)
    assert model.c1 == pytest.approx(3e-10, rel=0.01)
    model.observe(8e6, 2e-5 + 3e-10 * 8e6 * 2)  # a slower network measured later
    assert model.refit() and model.c1 > 3e-10


def test_fit_keeps_a_positive_fixed_cost_on_noisy_timings():
    from hvdcompress.transports.cost import fit_affine

    c0, c1 = fit_affine([8, 8e3, 8e6, 8e7], [3e-4, 2e-4, 1e-3, 2.0e-2])  # lstsq c0 < 0
    assert c0 == pytest.approx(2e-4) and c1 > 0


def test_cat_policy_sets_topk_budget_every_s_steps(model):
    pol = CAT("topk", cost_model=AffineCost(1e-5, 1e-9), recompute_every=2)
    opt = _opt(model, "topk", pol)
    _step(model, opt, seed=0)
    budgets = dict(pol.budgets)
    assert set(budgets) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        r = opt.compressor.level(name)
        assert hvdcompress.codecs.sparse.topk_count(p.numel(), r) == budgets[name]
    assert "cat/modelled_s" in opt.last_stats.metrics
    _step(model, opt, seed=1)
    assert pol.budgets == budgets  # not a recompute step


@pytest.mark.parametrize(("kind", "compression"), [("topk+q", "topkq"), ("randomk", "gspar")])
def test_cat_drives_topkq_and_gspar(kind, compression, model):
    pol = CAT(kind, cost_model=AffineCost(1e-5, 1e-9), recompute_every=3)
    opt = _opt(model, compression, pol)
    _step(model, opt, seed=0)
    assert set(pol.budgets) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        r = opt.compressor.level(name)
        n, T = p.numel(), pol.budgets[name]
        if compression == "topkq":
            assert hvdcompress.codecs.sparse.topk_count(n, r) == T
        else:
            assert r == T / n
    for s in range(1, 4):
        _step(model, opt, seed=s)  # the budgets in force are used and decoded on every step
    with pytest.raises(TypeError, match=compression):
        _opt(small_model(), "topk", CAT(kind, cost_model=AffineCost(1e-5, 1e-9)))


class _AffineTimedTransport(LocalTransport):
    """Every collective of b bytes reports c0 + c1 * 8b seconds (Handle.seconds)."""

    def __init__(self, c0, c1):
        super().__init__()
        self.c0, self.c1 = c0, c1

    def _timed(self, value, nbytes):
        h = self._done(value)
        h.began, h.ended = 0.0, self.c0 + self.c1 * 8 * nbytes
        return h

    def start_allgatherv(self, local, *, key=None):
        return self._timed((local.clone(), [local.numel()]), local.numel())


def test_cat_modelled_and_measured_cost_are_per_collective_and_refresh_refits(model):
    true_c0, true_c1 = 3e-4, 2e-8
    pol = CAT("topk", cost_model=AffineCost(1e-6, 1e-10), recompute_every=2, refresh=True)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression="topk",
        backend=_AffineTimedTransport(true_c0, true_c1),
        fusion_threshold=0,  # one collective per tensor: several payload sizes per step
        policy=pol,
    )
    _step(model, opt, seed=0)
    stats = opt.last_stats
    assert len(stats.timings) == stats.collectives == 4
    m = stats.metrics
    # before the refit at the end of step 0 the old model priced the step's collectives
    expect_modelled = sum(1e-6 + 1e-10 * 8 * b for b, _ in stats.timings)
    assert m["cat/modelled_s"] == pytest.approx(expect_modelled)
    assert m["cat/measured_s"] == pytest.approx(
        sum(true_c0 + true_c1 * 8 * b for b, _ in stats.timings)
    )
    assert pol.cost.c0 == pytest.approx(true_c0, rel=1e-6)  # refitted from step 0's timings
    assert pol.cost.c1 == pytest.approx(true_c1, rel=1e-6)
    _step(model, opt, seed=1)
    m = opt.last_stats.metrics
    assert m["cat/modelled_s"] == pytest.approx(m["cat/measured_s"], rel=1e-6)


def test_cat_state_travels_in_the_optimizer_state_dict(model):
    opt = _opt(model, "topk", CAT("topk", cost_model=AffineCost(1e-5, 1e-9), recompute_every=2))
    for s in range(3):
        _step(model, opt, seed=s)
    state = opt.state_dict()
    model2 = small_model()
    pol2 = CAT("topk", cost_model=AffineCost(1.0, 1.0), recompute_every=2)
    opt2 = _opt(model2, "topk", pol2)
    opt2.load_state_dict(state)
    assert pol2.budgets == opt.policy.budgets and (pol2.cost.c0, pol2.cost.c1) == (1e-5, 1e-9)
    assert all(opt2.compressor.level(n) == opt.compressor.level(n) for n in pol2.budgets)
    assert pol2.state_dict()["steps"] == 3
    with pytest.raises(ValueError, match="CAT"):
        CAT("topk+q", cost_model=AffineCost(1e-5, 1e-9)).load_state_dict(pol2.state_dict())


def _script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_policy_flags():
    train = _script("train")
    args = train.parse_args(["--compression", "powersgd", "--accordion", "2", "1"])
    pol = train.make_policy(args)
    assert isinstance(pol, Accordion) and (pol.low, pol.high) == (2, 1)
    args = train.parse_args(
        ["--compression", "topk", "--cat", "topk", "--cat-cost", "1e-5,1e-9,64"]
    )
    pol = train.make_policy(args)
    assert isinstance(pol, CAT) and isinstance(pol.cost, PacketCost)
    with pytest.raises(SystemExit, match="--compression topk"):
        train.make_policy(train.parse_args(["--compression", "3lc", "--cat", "topk"]))
    for kind, compression in (("topk+q", "topkq"), ("randomk", "gspar")):
        args = train.parse_args(["--compression", compression, "--cat", kind])
        assert train.make_policy(args).kind == kind


def test_plot_policy_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.csv").write_text("step,epoch,loss\n1,0,2.3\n2,0,2.1\n3,0,2.0\n")
    rows = ["step,key,value"] + [f"{s},level/fc.weight,{1.0 if s < 3 else 1.9}" for s in (1, 2, 3)]
    (tmp_path / "policy.csv").write_text("\n".join(rows) + "\n")
    assert _script("plot_policy").main([str(tmp_path)]) == 0
    assert (tmp_path / "policy.png").read_bytes()[:4] == b"\x89PNG"


def test_accordion_state_travels_in_the_optimizer_state_dict(model):
    opt = _opt(model, "3lc", Accordion(low=1.0, high=1.9, interval_steps=1))
    for s in range(3):
        _step(model, opt, seed=s % 2)
    state = opt.state_dict()
    model2 = small_model()
    opt2 = _opt(model2, "3lc", Accordion(low=1.0, high=1.9, interval_steps=1))
    opt2.load_state_dict(state)
    assert opt2.policy.current == opt.policy.current
    assert all(opt2.compressor.level(n) == opt.compressor.level(n) for n in opt.policy.names)


def test_accordion_compares_the_norm_of_the_intervals_gradient_sum(model):
    """The paper's rule (and its reference code): the gradients of an interval are summed,
    then normed. Two intervals whose steps have the same norms differ where the steps
    cancel: g, g (sum 2g) then g, -g (sum 0) is critical; a sum of the steps' norms (2|g|
    both times) would not see it."""
    pol = Accordion(low=1.0, high=1.9)  # interval = epoch: end_interval() by hand here
    opt = _opt(model, "3lc", pol)
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    for signs in ((1, 1), (1, 1), (1, -1)):
        for sign in signs:
            for name, g in grads.items():
                pol.observe(name, sign * g)
        pol.end_interval()
    reasons = [h["reason"] for h in pol.history]
    assert reasons == ["first", "first", "norms", "norms"]
    assert all(level == 1.9 for level in pol.history[2]["levels"].values())  # g, g twice
    assert all(level == 1.0 for level in pol.history[3]["levels"].values())  # g, -g: 0
    assert pol.history[3]["norms"] == [0.0] * len(grads)
    assert all(opt.compressor.level(n) == 1.0 for n in grads)


def test_accordion_state_keeps_the_intervals_sum_and_refuses_a_bad_one(model):
    pol = Accordion(low=1.0, high=1.9)
    _opt(model, "3lc", pol)
    names = [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        pol.observe(n, torch.full_like(p, 2.0))
    state = pol.state_dict()
    assert set(state["sums"]) == set(names)
    model2 = small_model()
    pol2 = Accordion(low=1.0, high=1.9)
    _opt(model2, "3lc", pol2)
    pol2.load_state_dict(state)
    pol.end_interval()
    pol2.end_interval()
    assert pol2.history[-1]["norms"] == pol.history[-1]["norms"] != [0.0] * len(names)
    bad = {**state, "sums": {**state["sums"], names[0]: torch.full((3,), float("nan"))}}
    with pytest.raises(CheckpointError, match="sums"):
        pol2.load_state_dict(bad)
    # a state from when the sums were the steps' norms (numbers): the interval starts over
    pol2.load_state_dict({**state, "sums": dict.fromkeys(names, 5.0)})
    pol2.end_interval()
    assert pol2.history[-1]["norms"] == [0.0] * len(names)
