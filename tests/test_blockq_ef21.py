"""block3lc's ``ef21``: EF21-SGDM's estimate in place of the error-feedback residual
(Fatkhullin et al., NeurIPS 2023; issue 61, docs/screening.md). Each rank sends
c = C(v - h) and moves h by c; the wrapped SGD at momentum 1 adds up the averaged c's."""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.checkpoint import CheckpointError
from hvdcompress.training.methods import METHODS
from hvdcompress.training.simulate import run_ranks
from tests.helpers import LocalTransport, small_model
from tests.test_blockq import _train_module


def _comp(**params):
    return hvdcompress.get_compressor("block3lc", ef21=True, **params)


def _g(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_the_estimate_is_the_sum_of_what_was_sent_and_tracks_the_momentum():
    c = _comp(block=64, momentum=0.9)
    v, h = torch.zeros(500), torch.zeros(500)
    gaps = []
    for step in range(30):
        g = _g(500, step) + 3.0  # a drifting mean the momentum follows
        v = 0.9 * v + g
        sent = c.decompress(*c.compress(g, "w"))
        h += sent
        torch.testing.assert_close(-c.memory.residuals["w"], h)
        torch.testing.assert_close(c.velocity.residuals["w"], v)  # no masking
        gaps.append(float((v - h).norm() / v.norm()))
    # the estimate follows the momentum: the gap shrinks from the first (h = 0) steps
    assert gaps[0] > 0.1 and max(gaps[-5:]) < 0.5 * gaps[0]


def test_without_momentum_the_first_payload_is_3lcs_residual_free_code():
    x = _g(1000, 1)
    ef21 = _comp(block=1 << 24).compress(x, "w")[0]
    plain = hvdcompress.get_compressor("block3lc", block=1 << 24).compress(x, "w")[0]
    assert torch.equal(ef21, plain)  # h = 0 and no residual yet: the same bytes


def test_non_finite_input_leaves_the_estimate_and_the_momentum():
    c = _comp(block=64, momentum=0.9)
    c.compress(_g(200, 0), "w")
    h, v = c.memory.residuals["w"].clone(), c.velocity.residuals["w"].clone()
    bad = _g(200, 1)
    bad[7] = float("nan")
    payload, ctx = c.compress(bad, "w")
    assert bool(torch.isnan(c.decompress(payload, ctx)).any())
    assert torch.equal(c.memory.residuals["w"], h)
    assert torch.equal(c.velocity.residuals["w"], v)


def test_absorb_is_refused_and_no_contraction_is_declared():
    c = _comp(block=64)
    c.compress(_g(100, 0), "w")
    assert c.absorb("w", torch.ones(100)) is False and c.contraction(100) is None
    assert not c.recompressible  # a two-stage owner would move h twice


def test_state_round_trip_names_ef21_and_is_checked():
    a = _comp(block=64, momentum=0.9)
    a.compress(_g(300, 0), "w")
    state = a.state_dict()
    assert state["ef21"] is True and {"residuals", "velocity"} <= set(state)
    b = _comp(block=64, momentum=0.9)
    b.load_state_dict(state)
    x = _g(300, 5)
    assert torch.equal(a.compress(x, "w")[0], b.compress(x, "w")[0])
    with pytest.raises(CheckpointError):  # a residual is not an estimate, either way round
        hvdcompress.get_compressor("block3lc", block=64, momentum=0.9).load_state_dict(state)
    plain = hvdcompress.get_compressor("block3lc", block=64)
    plain.compress(_g(300, 0), "w")
    with pytest.raises(CheckpointError):
        _comp(block=64).load_state_dict(plain.state_dict())
    assert repr(_comp(block=64)).endswith(", ef21=True)")
    assert "ef21" not in repr(hvdcompress.get_compressor("block3lc", block=64))


@pytest.mark.parametrize(
    "params, match",
    [
        ({"stochastic": True}, "ef21"),
        ({"ef21": "yes"}, "ef21"),
    ],
)
def test_bad_combinations_are_refused(params, match):
    with pytest.raises((TypeError, ValueError), match=match):
        hvdcompress.get_compressor("block3lc", **{"ef21": True, **params})


@pytest.mark.parametrize(
    "sgd",
    [
        {"momentum": 0.9},
        {"momentum": 0.0},
        {"momentum": 1.0, "dampening": 0.1},
        {"momentum": 1.0, "nesterov": True},
        {"momentum": 1.0, "weight_decay": 1e-4},
    ],
)
def test_the_optimizer_must_add_up_the_differences(sgd):
    model = small_model()
    with pytest.raises(ValueError, match="ef21"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, **sgd),
            model.named_parameters(),
            compression=_comp(),
            backend=LocalTransport(),
        )


def test_ranks_buffers_are_the_average_of_their_estimates():
    """Three simulated ranks, different data: every rank's SGD buffer is the same and
    equals the average over ranks of the compressors' estimates h."""
    size, steps = 3, 6

    def rank_program(transport):
        torch.manual_seed(0)
        model = torch.nn.Linear(40, 8)
        comp = _comp(block=64, momentum=0.9)
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=1.0),
            model.named_parameters(),
            compression=comp,
            backend=transport,
            exchange="allgather",
            compress_min_numel=0,
        )
        gen = torch.Generator().manual_seed(100 + transport.rank)
        for _ in range(steps):
            opt.zero_grad()
            x = torch.randn(16, 40, generator=gen)
            model(x).pow(2).mean().backward()
            opt.step()
        bufs = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
        hs = {n: -r.clone() for n, r in comp.memory.residuals.items()}
        return bufs, hs

    results = run_ranks(size, rank_program)
    for name, buf in results[0][0].items():
        for bufs, _ in results[1:]:
            assert torch.equal(bufs[name], buf)  # rank-identical
        mean_h = sum(hs[name] for _, hs in results) / size
        torch.testing.assert_close(buf.reshape(-1), mean_h, rtol=1e-5, atol=1e-6)


def test_train_sets_the_sgd_momentum_to_one_and_the_method_is_named():
    train = _train_module()
    m = METHODS["block3lc-tensor-ef21-allgather"]
    comp, momentum = train.make_compression(train.parse_args(m.train_flags()))
    assert comp.ef21 and comp.momentum == 0.9 and momentum == 1.0


def test_the_ddp_hook_refuses_it_for_it_never_sees_the_optimizer():
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        hvdcompress.DDPHookState(compression=_comp())
    hvdcompress.DDPHookState(compression=hvdcompress.get_compressor("block3lc"))  # no ef21
