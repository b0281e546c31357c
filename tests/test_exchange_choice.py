"""Choosing each bucket's exchange (``choose_exchanges``, docs/exchanges.md, "Choosing the
exchange"): dense where compression would send more, and by seconds with a ``LinkCost``
(fitted by ``calibrate_link``)."""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.buckets import make_buckets
from hvdcompress.exchange import choose_exchanges
from hvdcompress.exchange.choose import ComputeCost, predicted_seconds
from hvdcompress.training.simulate import run_ranks
from hvdcompress.transports import Handle, Transport
from hvdcompress.transports.cost import COLLECTIVES, LinkCost, calibrate_link


class Clocked(Transport):
    """``size`` ranks that agree with this one; each collective advances ``now`` by the
    seconds ``cost`` gives for the bytes this rank hands it."""

    name = "clocked"
    tunable = False  # its clock is the test's: the first guess is what it checks

    def __init__(self, size: int, cost: LinkCost) -> None:
        self.rank, self.size, self.cost, self.now = 0, size, cost, 0.0

    def _done(self, kind, nbytes, result) -> Handle:
        self.now += self.cost.seconds(kind, nbytes)
        handle = Handle()
        handle._finish(result)
        return handle

    def start_allgatherv(self, local, *, key=None):
        return self._done(
            "allgatherv", local.numel(), (local.repeat(self.size), [local.numel()] * self.size)
        )

    def start_alltoallv(self, parts, *, key=None):
        return self._done("alltoallv", sum(p.numel() for p in parts), [p.clone() for p in parts])

    def start_allreduce_sum(self, dense):
        return self._done("allreduce", dense.numel() * dense.element_size(), dense * self.size)

    def allgather_object(self, obj):
        return [obj] * self.size


def _kinds(compressor, transport, link_cost=None, model=None):
    model = model or torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 1))
    buckets = make_buckets(list(model.named_parameters()), 0)
    chosen = choose_exchanges(compressor, transport, buckets, "auto", link_cost=link_cost)
    out = {}
    for b in buckets:
        out[b.names[0]] = chosen[b.index].kind
        assert b.compressed  # the chooser leaves its input alone
        assert (b.index in chosen.dense) == (chosen[b.index].kind == "allreduce")  # dense
    return out


def test_calibrate_link_fits_each_collective():
    truth = LinkCost(allgatherv=(1e-3, 2e-8), allreduce=(5e-4, 4e-8), alltoallv=(2e-3, 1e-8))
    t = Clocked(4, truth)
    fitted = calibrate_link(t, clock=lambda: t.now)
    for kind in COLLECTIVES:
        assert getattr(fitted, kind) == pytest.approx(getattr(truth, kind), rel=1e-6)


def test_auto_goes_dense_where_the_headers_alone_outweigh_the_dense_bytes():
    t = Clocked(4, LinkCost((0, 0), (0, 0), (0, 0)))
    # by the headers only: a body that costs more than dense (top-k at ratio 0.9, 8 bytes
    # per kept value; DGC in its warm-up) stays compressed, since its size changes in
    # training; the one-value bias goes dense either way
    for comp in (
        hvdcompress.get_compressor("topk", ratio=0.9),
        hvdcompress.get_compressor("dgc", ratio=0.05, warmup_steps=6),
    ):
        dense = {name: kind == "allreduce" for name, kind in _kinds(comp, t).items()}
        assert dense == {"0.weight": False, "0.bias": False, "1.weight": False, "1.bias": True}
    three = _kinds(hvdcompress.get_compressor("3lc"), t)
    assert three == {
        "0.weight": "twostage",
        "0.bias": "allgather",
        "1.weight": "allgather",
        "1.bias": "allreduce",
    }
    # one rank: no bytes either way; compression stays (a tie keeps the compressed exchange)
    assert "allreduce" not in _kinds(hvdcompress.get_compressor("3lc"), Clocked(1, t.cost)).values()


def test_a_link_cost_chooses_by_seconds():
    three = hvdcompress.get_compressor("3lc")
    free_allreduce = LinkCost(allgatherv=(1.0, 1.0), allreduce=(0.0, 0.0), alltoallv=(1.0, 1.0))
    assert set(_kinds(three, Clocked(4, free_allreduce), free_allreduce).values()) == {"allreduce"}
    # a slow link, per byte a rank hands each collective as a ring moves them (an
    # allgatherv sends its part N - 1 times), no latency: the bytes model's choice
    slow = LinkCost(allgatherv=(1e-6, 3e-6), allreduce=(1e-6, 1.5e-6), alltoallv=(1e-6, 7.5e-7))
    assert _kinds(three, Clocked(4, slow), slow) == _kinds(three, Clocked(4, slow))
    # an alltoallv with a latency of a second: never the two-stage exchange
    late = LinkCost(allgatherv=(1e-3, 1e-6), allreduce=(1.0, 1e-6), alltoallv=(1.0, 1e-6))
    assert set(_kinds(three, Clocked(4, late), late).values()) == {"allgather"}
    with pytest.raises(TypeError, match="link_cost"):
        _kinds(three, Clocked(4, slow), link_cost=(1, 2))


def test_predicted_seconds_counts_encode_collectives_and_decodes():
    link = LinkCost(allgatherv=(1.0, 0.01), allreduce=(0, 0), alltoallv=(2.0, 0.1))
    compute = ComputeCost(encode=1e-3, decode=1e-4)
    # allgather: encode n, one allgatherv of the frame, decode N payloads of n
    assert predicted_seconds(link, compute, 4, 1000, [100.0]) == pytest.approx(1 + 0.4 + 1 + 1)
    # two-stage: encode n and the own shard again, decode twice n in all, both collectives
    two = predicted_seconds(link, compute, 4, 1000, [30.0, 30.0, 30.0, 30.0])
    assert two == pytest.approx(1.25 + 0.2 + 2 + 12 + 1 + 0.3)


def test_measure_on_a_one_process_world_runs_and_agrees_with_itself():
    t = Clocked(1, LinkCost((0, 0), (0, 0), (0, 0)))
    kinds = _kinds(hvdcompress.get_compressor("3lc"), t, "measure")
    assert set(kinds) == {"0.weight", "0.bias", "1.weight", "1.bias"}


class TwoTensors(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.w = torch.nn.Parameter(torch.zeros(20000))


def test_a_bucket_sent_dense_is_averaged_exactly_and_left_out_of_the_policy():
    """The optimizer over 4 simulated ranks: the one-value tensor goes dense (allreduce,
    no residual, not a policy's tensor), the large one by the two-stage exchange; every
    rank ends with the same gradients, the dense one the float32 average."""
    grads = [{"scale": torch.randn(1), "w": torch.randn(20000)} for _ in range(4)]

    def rank(t):
        model = TwoTensors()
        policy = hvdcompress.Accordion(low=1.0, high=1.75, interval_steps=2)
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression="3lc",
            backend=t,
            fusion_threshold=0,
            policy=policy,
        )
        for n, p in model.named_parameters():
            p.grad = grads[t.rank][n].clone()
        opt.synchronize()
        kinds = {b.names[0]: opt.reducer.planned(b).kind for b in opt.buckets}
        residuals = set(opt.compressor.state_dict()["residuals"])
        return kinds, policy.names, residuals, model.scale.grad.clone(), model.w.grad.clone()

    results = run_ranks(4, rank)
    mean = (grads[0]["scale"] + grads[1]["scale"] + grads[2]["scale"] + grads[3]["scale"]) * 0.25
    for kinds, policy_names, residuals, scale, w in results:
        assert kinds == {"scale": "allreduce", "w": "twostage"}
        assert policy_names == ["w"] and not any(r.startswith("scale") for r in residuals)
        assert torch.equal(scale, mean)
        assert torch.equal(w, results[0][4])
