"""Issue 61's screening candidates (docs/screening.md): the block-scaled 3LC compressor
("block3lc", hvdcompress.codecs.blockq) and the compression warm-up policy
(hvdcompress.policies.warmup), and their names in the methods table and train.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.checkpoint import CheckpointError
from hvdcompress.codecs import blockq
from hvdcompress.errors import PayloadError
from hvdcompress.policies.warmup import Warmup
from hvdcompress.training.methods import METHODS, build_policy
from tests.helpers import LocalTransport, small_model

TRAIN = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


def _comp(**params):
    return hvdcompress.get_compressor("block3lc", **params)


def _x(n=3000, seed=0, spikes=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if spikes:
        x[::700] *= 50.0  # a few large values, as attention rows have
    return x


# ---- the codec ---------------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 5, 64, 1000, 4096])
@pytest.mark.parametrize("sparsity", [1.0, 1.5, 1.9])
def test_ternary_round_trip_scale_per_block_and_error_feedback(block, sparsity):
    c = _comp(sparsity=sparsity, block=block)
    x = _x()
    payload, ctx = c.compress(x, "w")
    y = c.decompress(payload, ctx)
    e = c.memory.residuals["w"]
    torch.testing.assert_close(y + e, x, rtol=0, atol=1e-5)  # g_hat + e_new == a
    for b in range(0, x.numel(), block):  # each block: {-S_b, 0, S_b}, S_b = s max|a_b|
        xb, yb = x[b : b + block], y[b : b + block]
        s_b = float(np.float32(np.float32(sparsity) * float(xb.abs().max())))
        assert set(yb.abs().unique().tolist()) <= {0.0, s_b}
        if sparsity == 1.0:  # the block's largest value is sent exactly
            i = int(xb.abs().argmax())
            assert float(yb[i]) == float(xb[i])


@pytest.mark.parametrize("levels", [2, 3, 7, 127])
def test_levels_round_trip_within_half_a_step(levels):
    c = _comp(block=128, levels=levels)
    x = _x(1000, seed=levels)
    y = c.decompress(*c.compress(x, "w"))
    for b in range(0, 1000, 128):
        step = float(x[b : b + 128].abs().max()) / levels
        assert float((y[b : b + 128] - x[b : b + 128]).abs().max()) <= step / 2 + 1e-6
    torch.testing.assert_close(y + c.memory.residuals["w"], x, rtol=0, atol=1e-5)


def test_block_scales_keep_what_one_scale_per_tensor_zeroes():
    x = torch.full((2000,), 0.01)
    x[0] = 100.0  # one spike: 3LC's one scale zeroes every other value
    one = hvdcompress.get_compressor("3lc").decompress(
        *hvdcompress.get_compressor("3lc").compress(x, "w")
    )
    blocked = _comp(block=100).decompress(*_comp(block=100).compress(x, "w"))
    assert int((one != 0).sum()) == 1
    assert int((blocked != 0).sum()) == 2000 - 99  # only the spike's block loses its values


def test_bits_per_value_count_the_block_scales():
    x = torch.zeros(10_000)
    for block, levels in ((100, 1), (1000, 1), (1000, 3)):
        c = _comp(block=block, levels=levels)
        payload, _ = c.compress(x, "w")
        body = wire.parse(payload).body_len
        digits = -(-2000 // 14) if levels == 1 else 3 * 10_000 // 8  # runs of 14 zero bytes
        assert body == 4 * (10_000 // block) + digits


def test_same_input_same_bytes():  # every rank's encode is a pure function of its input
    a, b = _comp(block=256), _comp(block=256)
    for step in range(3):
        x = _x(seed=step)
        assert torch.equal(a.compress(x, "w")[0], b.compress(x.clone(), "w")[0])


def test_empty_and_zero_tensors():
    c = _comp(block=64)
    for x in (torch.zeros(0), torch.zeros(77), torch.zeros(3, 5, dtype=torch.float16)):
        y = c.decompress(*c.compress(x, f"t{x.numel()}{x.dtype}"))
        assert y.shape == x.shape and y.dtype == x.dtype and not bool(y.any())


def test_non_finite_input_is_flagged_and_leaves_the_residual():
    c = _comp(block=4)
    c.compress(torch.ones(10), "w")
    before = c.memory.residuals["w"].clone()
    x = torch.ones(10)
    x[3] = float("nan")
    payload, ctx = c.compress(x, "w")
    assert wire.parse(payload).nonfinite
    assert bool(c.decompress(payload, ctx).isnan().all())
    assert torch.equal(c.memory.residuals["w"], before)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"sparsity": 2.0}, "sparsity"),
        ({"sparsity": 0.5}, "sparsity"),
        ({"block": 0}, "block"),
        ({"block": 1.5}, "block"),
        ({"block": "64"}, "block"),
        ({"levels": 0}, "levels"),
        ({"levels": 128}, "levels"),
        ({"levels": True}, "levels"),
    ],
)
def test_bad_parameters_are_refused_naming_them(params, match):
    with pytest.raises(ValueError, match=match):
        _comp(**params)


def test_a_receiver_refuses_other_parameters_and_corrupt_bodies():
    x = _x(500)
    payload, ctx = _comp(block=64, levels=3).compress(x, "w")
    with pytest.raises(PayloadError) as err:
        _comp(block=64).decompress(payload, ctx)  # levels 1 expected
    assert err.value.field == "levels"
    with pytest.raises(PayloadError) as err:
        _comp(block=128, levels=3).decompress(payload, ctx)
    assert err.value.field == "block"
    ternary, ctx = _comp(block=64).compress(x, "w")
    header = wire.parse(ternary)
    body = ternary[len(ternary) - header.body_len :]
    with pytest.raises(PayloadError):  # a scale that is NaN
        bad = body.clone()
        bad[:4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
        blockq.decode_into(bad, 500, 1, 64, torch.zeros(500), False)
    with pytest.raises(PayloadError):  # digits cut short
        blockq.decode_into(body[:-1], 500, 1, 64, torch.zeros(500), False)


def test_state_dict_round_trip_and_settings_checked():
    a = _comp(block=64)
    a.compress(_x(300), "w")
    state = a.state_dict()
    b = _comp(block=64)
    b.load_state_dict(state)
    assert torch.equal(b.memory.residuals["w"], a.memory.residuals["w"])
    x = _x(300, seed=5)
    assert torch.equal(a.compress(x, "w")[0], b.compress(x, "w")[0])
    with pytest.raises(CheckpointError, match="block"):
        _comp(block=128).load_state_dict(state)


def test_shards_are_whole_blocks_and_quartic_bytes():
    assert _comp(block=64).shard_alignment() == 320
    assert _comp(block=1000).shard_alignment() == 1000


def test_contraction_is_a_bound():
    for s in (1.0, 1.5, 1.9):
        c = _comp(sparsity=s, block=32)
        delta = c.contraction(1000)
        assert 0 < delta <= 1
        for levels in (1, 3):
            c.set_level("w", levels)
            x = _x(1000, seed=levels)
            c.memory.residuals.clear()
            y = c.decompress(*c.compress(x, "w"))
            assert float((x - y).norm() ** 2) <= (1 - delta) * float(x.norm() ** 2) + 1e-6


# ---- the warm-up policy ------------------------------------------------------------------
def _opt(model, compression, policy):
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        compression=compression,
        backend=LocalTransport(),
        policy=policy,
    )


def _step(model, opt, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 10, generator=g)).pow(2).mean().backward()
    opt.step()


def test_warmup_holds_the_warm_level_then_the_compressors_own():
    model = small_model()
    pol = Warmup(3, steps=2)
    opt = _opt(model, _comp(block=16), pol)
    names = [n for n, _ in model.named_parameters()]
    seen = []
    for s in range(4):
        seen.append({opt.compressor.level(n) for n in names})
        _step(model, opt, seed=s)
    assert seen == [{3}, {3}, {1}, {1}]
    assert pol.state_dict() == {"steps": 4}


def test_warmup_decisions_depend_on_the_step_only_and_resume():
    a, b = Warmup(3, steps=5), Warmup(3, steps=5)  # two ranks
    ca, cb = _comp(block=16), _comp(block=16)
    a.bind(None, ca, None, ["w", "v"])
    b.bind(None, cb, None, ["w", "v"])
    for _ in range(3):
        a.after_step(None)
        b.after_step(None)
    assert ca.level("w") == cb.level("v") == 3
    c, cc = Warmup(3, steps=5), _comp(block=16)
    c.bind(None, cc, None, ["w", "v"])
    c.load_state_dict({"steps": 7})  # a checkpoint past the warm-up
    assert cc.level("w") == 1 and c.state_dict() == {"steps": 7}
    for bad in ({"steps": -1}, {"steps": 1.5}, {}, {"steps": 1, "x": 2}):
        with pytest.raises(CheckpointError):
            c.load_state_dict(bad)


def test_warmup_refuses_bad_levels_steps_and_compressors():
    with pytest.raises(ValueError, match="steps"):
        Warmup(3, steps=-1)
    with pytest.raises(ValueError, match="levels"):
        Warmup(200, steps=3).bind(None, _comp(), None, ["w"])
    with pytest.raises(TypeError, match="per-tensor levels"):
        Warmup(3, steps=3).bind(None, hvdcompress.get_compressor("dqsg"), None, ["w"])
    with pytest.raises(ValueError, match="levels"):
        build_policy("warmup", "block3lc", warm=0, steps=3)


# ---- reachable by name -------------------------------------------------------------------
def _train_module():
    spec = importlib.util.spec_from_file_location("_script_train_blockq", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", [n for n in METHODS if n.startswith("block3lc")])
def test_methods_train_with_their_flags(name):
    train = _train_module()
    m = METHODS[name]
    args = train.parse_args(m.train_flags())
    comp, _ = train.make_compression(args)
    assert type(comp).name == "block3lc" and comp.block == m.params["block"]
    policy = train.make_policy(args)
    assert (policy is None) == (m.policy is None)
    if m.policy == "warmup":
        assert isinstance(policy, Warmup) and policy.steps == m.policy_params["steps"]


def test_train_refuses_a_bad_warmup():
    train = _train_module()
    with pytest.raises(SystemExit):
        train.parse_args(["--compression", "block3lc", "--compression-warmup", "3", "1.5"])
    with pytest.raises(SystemExit):
        train.parse_args(["--compression", "3lc", "--compression-warmup", "3", "10"])
    with pytest.raises(SystemExit):
        train.parse_args(
            ["--compression", "block3lc", "--compression-warmup", "3", "10", "--cat", "topk"]
        )


# ---- momentum correction -----------------------------------------------------------------
def test_momentum_correction_masks_the_velocity_where_sent_and_keeps_the_invariant():
    c = _comp(block=64, momentum=0.9)
    total_u, total_sent = torch.zeros(500), torch.zeros(500)
    for step in range(4):
        g = _x(500, seed=step)
        u_before = c.velocity.residuals.get("w", torch.zeros(500)).clone()
        y = c.decompress(*c.compress(g, "w"))
        u = 0.9 * u_before + g  # what was compressed (with the residual)
        sent = y != 0
        assert bool((c.velocity.residuals["w"][sent] == 0).all())
        torch.testing.assert_close(c.velocity.residuals["w"][~sent], u[~sent])
        total_u += u
        total_sent += y
    e = c.memory.residuals["w"]
    # every velocity compressed is sent or in the residual, but for the masked velocity
    assert bool(torch.isfinite(e).all()) and float(total_sent.abs().sum()) > 0


def test_momentum_correction_state_and_optimizer_checks():
    a = _comp(block=64, momentum=0.9)
    a.compress(_x(300), "w")
    state = a.state_dict()
    assert set(state) == {"sparsity", "block", "momentum", "residuals", "velocity"}
    b = _comp(block=64, momentum=0.9)
    b.load_state_dict(state)
    x = _x(300, seed=3)
    assert torch.equal(a.compress(x, "w")[0], b.compress(x, "w")[0])
    with pytest.raises(CheckpointError, match="momentum"):
        _comp(block=64).load_state_dict(state)
    no_velocity = {k: v for k, v in state.items() if k != "velocity"}
    with pytest.raises(CheckpointError, match="velocity"):
        _comp(block=64, momentum=0.9).load_state_dict(no_velocity)
    model = small_model()
    with pytest.raises(ValueError, match="momentum"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            compression=_comp(momentum=0.9),
            backend=LocalTransport(),
        )
    with pytest.raises(ValueError, match="momentum"):
        _comp(momentum=1.0)


def test_train_runs_momentum_correction_without_the_optimizers_momentum():
    train = _train_module()
    args = train.parse_args(["--compression", "block3lc", "--compression-param", "momentum=0.9"])
    comp, momentum = train.make_compression(args)
    assert comp.momentum == 0.9 and momentum == 0.0


def test_a_block_past_the_tensor_is_3lcs_one_scale():
    x = _x(1000, seed=9)
    one = hvdcompress.get_compressor("3lc")
    big = _comp(block=1 << 24)  # no padding to the block
    for step in range(3):
        g = x * (step + 1)
        assert torch.equal(
            big.decompress(*big.compress(g, "w")), one.decompress(*one.compress(g, "w"))
        )


# ---- stochastic rounding -----------------------------------------------------------------
def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_is_not():
    # every value under half a step: rint sends nothing, stochastic rounding its mean
    n, block = 4096, 4096
    x = torch.full((n,), 0.1)
    x[0] = 1.0  # the block's scale: delta = 1.0, so 0.1 is a tenth of a step
    det = blockq.quantize(x, 1.0, 1, block)[0]
    assert int(det[1:].abs().sum()) == 0
    draws = []
    for key in range(40):
        u = hvdcompress.codecs.primitives.uniform(key, n, torch.device("cpu"))
        q, deltas = blockq.quantize(x, 1.0, 1, block, u)
        assert set(q[1:].unique().tolist()) <= {0, 1} and int(q[0]) == 1
        draws.append(blockq.dequantize(q, deltas, block)[1:].mean())
    assert abs(float(torch.stack(draws).mean()) - 0.1) < 0.005  # 163,800 draws: sd 0.0007


@pytest.mark.parametrize("levels", [1, 3])
def test_stochastic_rounding_keeps_error_feedback_and_the_body_format(levels):
    c = _comp(block=256, levels=levels, stochastic=True, seed=3)
    x = _x()
    payload, ctx = c.compress(x, "w")
    y = c.decompress(payload, ctx)
    torch.testing.assert_close(y + c.memory.residuals["w"], x, rtol=0, atol=1e-5)
    for b in range(0, x.numel(), 256):  # each value rounded to one of its two neighbours
        xb, yb = x[b : b + 256], y[b : b + 256]
        delta = float(np.float32(float(xb.abs().max()) / levels))
        assert bool(((xb - yb).abs() <= delta * (1 + 1e-5)).all())
    # a deterministic receiver decodes it: the noise is the sender's only
    plain = _comp(block=256, levels=levels)
    torch.testing.assert_close(plain.decompress(payload, ctx), y, rtol=0, atol=0)


def test_stochastic_streams_differ_by_rank_and_step_and_repeat_by_seed():
    def first_two(rank, seed=3):
        c = _comp(block=256, stochastic=True, seed=seed)
        c.bind(rank, 4)
        x = _x(seed=1)
        return [c.compress(x.clone(), "w")[0] for _ in range(2)], c

    (a0, a1), _ = first_two(0)
    (b0, _), _ = first_two(0)
    (r0, _), _ = first_two(1)
    (s0, _), _ = first_two(0, seed=4)
    assert torch.equal(a0, b0)  # the same seed, rank and step: the same bytes
    assert not torch.equal(a0, r0) and not torch.equal(a0, s0)
    assert not torch.equal(a0, a1)  # the next step draws anew (its residual differs too)


def test_stochastic_state_resumes_the_stream_and_is_checked():
    a = _comp(block=64, stochastic=True, seed=9)
    a.bind(2, 4)
    for _ in range(3):
        a.compress(_x(300), "w")
    state = a.state_dict()
    assert state["steps"] == {"w": 3} and state["stochastic"] is True
    b = _comp(block=64, stochastic=True, seed=9)
    b.bind(2, 4)
    b.load_state_dict(state)
    x = _x(300, seed=5)
    assert torch.equal(a.compress(x, "w")[0], b.compress(x, "w")[0])
    with pytest.raises(CheckpointError, match="seed"):
        _comp(block=64, stochastic=True, seed=8).load_state_dict(state)
    with pytest.raises(CheckpointError):  # a deterministic compressor: not its state
        _comp(block=64).load_state_dict(state)
    with pytest.raises(CheckpointError, match="steps"):
        _comp(block=64, stochastic=True, seed=9).load_state_dict(
            {k: v for k, v in state.items() if k != "steps"}
        )
    with pytest.raises(CheckpointError):
        _comp(block=64, stochastic=True, seed=9).load_state_dict({**state, "steps": {"w": -1}})


def test_stochastic_flag_is_refused_unless_a_bool():
    with pytest.raises(ValueError, match="stochastic"):
        _comp(stochastic="yes")
    with pytest.raises(ValueError, match="seed"):
        _comp(stochastic=True, seed=-1)


def test_stochastic_error_feedback_needs_sparsity_one_and_declares_no_contraction():
    with pytest.raises(ValueError, match="sparsity 1.0"):
        _comp(sparsity=1.5, stochastic=True)
    with pytest.raises(ValueError, match="needs stochastic"):
        _comp(error_feedback=False)
    assert _comp(stochastic=True).contraction(4096) is None
    assert _comp().contraction(4096) is not None


def test_stochastic_without_error_feedback_keeps_no_residual_and_is_unbiased():
    c = _comp(sparsity=1.5, block=4096, stochastic=True, error_feedback=False)
    x = torch.full((4096,), 0.1)
    x[0] = 1.0
    mean = torch.zeros(4096)
    for _ in range(200):
        payload, ctx = c.compress(x, "w")
        mean += c.decompress(payload, ctx) / 200
    assert not c.memory.residuals and "residuals" in c.state_dict()
    assert abs(float(mean[1:].mean()) - 0.1) < 0.005  # 819,000 draws of 0 or 1.5
    assert abs(float(mean[0]) - 1.0) < 0.15


def test_repr_names_the_later_options_only_where_set():
    # a checkpoint names its compressor by this text: ones saved before the options load
    base = "BlockThreeLC(sparsity=1.0, block=64, levels=1, momentum=0.0"
    assert repr(_comp(block=64)) == base + ")"
    assert repr(_comp(block=64, stochastic=True)) == base + ", stochastic=True)"
    assert repr(_comp(block=64, stochastic=True, error_feedback=False)) == (
        base + ", stochastic=True, error_feedback=False)"
    )


def test_a_state_names_error_feedback_only_where_it_is_off():
    on = _comp(block=64, stochastic=True)
    on.compress(_x(300), "w")
    assert "error_feedback" not in on.state_dict()  # as saved before the option existed
    off = _comp(block=64, stochastic=True, error_feedback=False)
    off.compress(_x(300), "w")
    assert off.state_dict()["error_feedback"] is False
    _comp(block=64, stochastic=True, error_feedback=False).load_state_dict(off.state_dict())
    with pytest.raises(CheckpointError):  # either way round: refused
        _comp(block=64, stochastic=True).load_state_dict(off.state_dict())
    with pytest.raises(CheckpointError):
        _comp(block=64, stochastic=True, error_feedback=False).load_state_dict(on.state_dict())
