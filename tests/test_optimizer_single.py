"""DistributedOptimizer in one process, with an in-process transport of world size 1.

Covers what needs no MPI: bucketing, framing, hooks, checkpoint keys, compat classes.
"""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.optimizer import _frame, _unframe, make_buckets
from hvdcompress.wire import PayloadError
from tests.local_transport import LocalTransport


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))


def test_buckets_follow_reversed_parameter_order_and_threshold():
    named = list(_model().named_parameters())
    one = make_buckets(named, 1 << 30)
    assert len(one) == 1 and one[0].names == [n for n, _ in reversed(named)]
    each = make_buckets(named, 0)
    assert [b.names for b in each] == [[n] for n, _ in reversed(named)]
    mid = make_buckets(named, 4 * 20 * 10)  # the first weight alone fills a bucket
    assert sum(len(b.names) for b in mid) == len(named) and 1 < len(mid) < len(named)


def test_frame_roundtrip_and_malformed_frame_names_the_rank():
    parts = [torch.arange(n, dtype=torch.uint8) for n in (3, 0, 7)]
    frame = _frame(parts)
    back = _unframe(frame, 3, 0, ["a", "b", "c"])
    assert [torch.equal(a, b) for a, b in zip(parts, back, strict=True)] == [True] * 3
    with pytest.raises(PayloadError, match="from rank 2"):
        _unframe(frame[:-1], 3, 2, ["a", "b", "c"])
    with pytest.raises(PayloadError, match="expected 4"):
        _unframe(frame, 4, 1, ["a", "b", "c", "d"])


@pytest.mark.parametrize("compression", ["none", "3lc"])
def test_hooks_launch_during_backward_and_step_applies_decoded_average(compression):
    model = _model()
    transport = LocalTransport()
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


def test_tensors_below_compress_min_numel_travel_uncompressed():
    model = _model()  # 0.weight 200, 0.bias 20, 2.weight 60, 2.bias 3 elements
    transport = LocalTransport()
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


def test_zero_grad_between_backward_and_step_is_refused():
    model = _model()
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend=LocalTransport(),
    )  # fmt: skip
    model(torch.randn(2, 10)).sum().backward()
    with pytest.raises(AssertionError, match="before"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_compat_classes():
    t = torch.randn(4)
    half, ctx = hvdcompress.Compression.fp16.compress(t)
    assert half.dtype == torch.float16
    assert hvdcompress.Compression.fp16.decompress(half, ctx).dtype == torch.float32
    tlc = hvdcompress.Compression.threelc(sparsity=1.5)
    assert repr(tlc.make_compressor()) == "ThreeLC(sparsity=1.5)"
    with pytest.raises(TypeError, match="hvdcompress.DistributedOptimizer"):
        tlc.compress(t)
    with pytest.raises(ValueError):
        hvdcompress.Compression.threelc(sparsity=2.5)
    with pytest.raises(TypeError, match="not a compressor"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(_model().parameters(), lr=0.1), compression=3,
            backend=LocalTransport(),
        )  # fmt: skip


def test_compression_has_an_entry_for_every_compressor():
    from hvdcompress.compressors import REGISTRY

    for name, cls in REGISTRY.items():
        entry = getattr(hvdcompress.Compression, "threelc" if name == "3lc" else name)
        if name in ("none", "fp16", "bf16"):
            assert entry.make_compressor().name == name
            continue
        made = entry()
        assert type(made.make_compressor()) is cls
        with pytest.raises(TypeError, match=r"hvdcompress\.DistributedOptimizer"):
            made.compress(torch.randn(3))
