"""DistributedOptimizer in one process, with an in-process transport of world size 1.

Covers what needs no MPI: bucketing, hooks, uncompressed small tensors, zero_grad
checks, and the compressors' optimizer hooks (NDQSG's side information and metrics,
DGC's inner-momentum check, PowerSGD's two allreduces per bucket). The framing of a
bucket's payloads is in test_wire.py, the Compression namespace in test_compressor_api.py.
"""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.buckets import make_buckets
from tests.helpers import LocalTransport, powersgd_one_rank


def test_buckets_follow_reversed_parameter_order_and_threshold(model):
    named = list(model.named_parameters())
    one = make_buckets(named, 1 << 30)
    assert len(one) == 1 and one[0].names == [n for n, _ in reversed(named)]
    each = make_buckets(named, 0)
    assert [b.names for b in each] == [[n] for n, _ in reversed(named)]
    mid = make_buckets(named, 4 * 20 * 10)  # the first weight alone fills a bucket
    assert sum(len(b.names) for b in mid) == len(named) and 1 < len(mid) < len(named)


@pytest.mark.parametrize("compression", ["none", "3lc"])
def test_hooks_launch_during_backward_and_step_applies_decoded_average(
    compression, model, transport
):
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression=compression, backend=transport, fusion_threshold=0,
    )  # fmt: skip
    x = torch.randn(5, 10)
    model(x).sum().backward()
    assert transport.calls == 4, "every bucket should start during backward"
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    comp = hvdcompress.get_compressor(compression)
    for n, p in model.named_parameters():
        payload, ctx = comp.compress(raw[n], n)
        assert torch.equal(p.grad, comp.decompress(payload, ctx)), n
    with opt.skip_synchronize():
        opt.step()
    assert transport.calls == 4
    state = opt.state_dict()
    assert state["hvdcompress"]["compressor"] == repr(opt.compressor)
    assert isinstance(opt, torch.optim.SGD)


def test_tensors_below_compress_min_numel_travel_uncompressed(model, transport):
    # model: 0.weight 200, 0.bias 20, 2.weight 60, 2.bias 3 elements
    policy = hvdcompress.Accordion(low=1.0, high=1.75, interval_steps=1)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend=transport, compress_min_numel=61, policy=policy,
    )  # fmt: skip
    kinds = {n: b.compressed for b in opt.buckets for n in b.names}
    assert kinds == {"0.weight": True, "0.bias": False, "2.weight": False, "2.bias": False}
    assert policy.names == ["0.weight"]  # the policy only sees what is compressed
    model(torch.randn(5, 10)).sum().backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.synchronize()
    comp = hvdcompress.get_compressor("3lc")
    for n, p in model.named_parameters():
        if kinds[n]:
            payload, ctx = comp.compress(raw[n], n)
            assert torch.equal(p.grad, comp.decompress(payload, ctx)), n
            assert not torch.equal(p.grad, raw[n])
        else:
            assert torch.equal(p.grad, raw[n]), n  # sent as is
    with pytest.raises(ValueError, match="compress_min_numel"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            compression="3lc", backend=LocalTransport(), compress_min_numel=-1,
        )  # fmt: skip


def test_zero_grad_between_backward_and_step_is_refused(model):
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend=LocalTransport(),
    )  # fmt: skip
    model(torch.randn(2, 10)).sum().backward()
    with pytest.raises(AssertionError, match="before"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


# ---- compressors' optimizer hooks ----------------------------------------------------------


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


def test_powersgd_optimizer_runs_two_allreduces_per_bucket(transport):
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 3))
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
        torch.testing.assert_close(p.grad, powersgd_one_rank(ref, grads[n], n), rtol=0, atol=0)
    with opt.skip_synchronize():
        opt.step()
    state = opt.state_dict()["hvdcompress"]["compressor_state"]
    assert set(state["qs"]) == {"0.weight", "1.weight"}


# ---- Horovod's keywords (one process; the comparisons with stock Horovod are in
# tests/mpi/test_horovod_parity.py) ------------------------------------------------------------
def _wrap(model, transport, **kw):
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        backend=transport, **kw,
    )  # fmt: skip


def test_groups_make_one_bucket_per_group_in_readiness_order(model, transport):
    # model: 0.weight, 0.bias, 2.weight, 2.bias
    by_count = _wrap(model, transport, groups=2)
    assert [b.names for b in by_count.buckets] == [["2.bias", "2.weight"], ["0.bias", "0.weight"]]
    listed = _wrap(model, transport, groups=[[model[0].weight, model[2].bias]])
    assert [b.names for b in listed.buckets] == [["2.bias", "0.weight"], ["2.weight"], ["0.bias"]]
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert len(_wrap(model, transport, num_groups=4).buckets) == 4
    with pytest.raises(ValueError, match="only appear once"):
        _wrap(model, transport, groups=[[model[0].weight], [model[0].weight]])


def test_gradient_predivide_factor_scales_before_and_after_the_sum(model, transport):
    x = torch.randn(4, 10)
    model(x).sum().backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = _wrap(model, transport, gradient_predivide_factor=4.0)
    model.zero_grad()
    model(x).sum().backward()
    opt.synchronize()
    for n, p in model.named_parameters():  # (g / 4) summed over 1 rank, times 4 / 1
        torch.testing.assert_close(p.grad, raw[n] * 0.25 * 4.0, rtol=0, atol=0)
    with pytest.raises(ValueError, match="op != Average"):
        _wrap(model, transport, op=hvdcompress.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="finite number > 0"):
        _wrap(model, transport, gradient_predivide_factor=-1.0)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("compression", ["none", "3lc"])
def test_sparse_gradients_are_exchanged_and_stay_sparse(transport, compression, sparse_as_dense):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters(),
        compression=compression, sparse_as_dense=sparse_as_dense, backend=transport,
    )  # fmt: skip
    emb(torch.tensor([1, 3, 3])).sum().backward()
    local = emb.weight.grad.to_dense().clone()
    opt.synchronize()
    assert emb.weight.grad.is_sparse
    if compression == "none" or not sparse_as_dense:  # the sparse path is uncompressed
        assert torch.equal(emb.weight.grad.to_dense(), local)
    with opt.skip_synchronize():
        opt.step()


def test_horovod_attributes_and_set_backward_passes_per_step(model, transport):
    opt = _wrap(model, transport, op=1, backward_passes_per_step=2)
    assert (opt.op, opt.backward_passes_per_step, opt.gradient_predivide_factor) == (1, 2, 1.0)
    assert opt.sparse_as_dense is False and opt.process_set is None
    assert sorted(opt._parameter_names.values()) == sorted(n for n, _ in model.named_parameters())
    opt.set_backward_passes_per_step(1)
    model(torch.randn(2, 10)).sum().backward()
    with pytest.raises(AssertionError, match="Increase backward_passes_per_step"):
        model(torch.randn(2, 10)).sum().backward()
    opt.synchronize()


def test_adasum_with_a_gather_only_codec_is_refused_with_the_reason(model, transport):
    with pytest.raises(ValueError, match="gather-only codec"):
        _wrap(model, transport, op=2, compression="3lc")
