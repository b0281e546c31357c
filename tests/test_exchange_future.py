"""The exchange core's interface (hvdcompress/exchange.py): it averages the gradient
tensors it is handed in place, never touches a parameter, and ``finish`` hands back those
tensors, raises the error, or (draining) writes nothing. No future per bucket: the DDP
hook makes the one future of its call (tests/test_ddp_hook.py)."""

from __future__ import annotations

import pytest
import torch

from hvdcompress.buckets import Bucket
from hvdcompress.errors import PayloadError
from hvdcompress.exchange import GatheredExchange, SummedExchange
from tests.helpers import LocalTransport, comp


class FlippingTransport(LocalTransport):
    """World size 1 whose allgather delivers the frame with its last byte flipped."""

    def start_allgatherv(self, local, *, key=None):
        bad = local.clone()
        bad[-1] ^= 0xFF
        return self._done((bad, [bad.numel()]))


def _bucket(n: int = 2):
    params = [torch.nn.Parameter(torch.zeros(7 * (i + 1))) for i in range(n)]
    grads = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        for i, p in enumerate(params)
    ]
    return Bucket(0, params, [f"w{i}" for i in range(n)]), params, grads


@pytest.mark.parametrize(
    "exchange_cls, name", [(SummedExchange, "none"), (GatheredExchange, "3lc")]
)
def test_finish_returns_the_tensors_it_averaged_in_place(exchange_cls, name):
    bucket, params, grads = _bucket()
    compressor = comp(name)
    exchange = exchange_cls(LocalTransport())
    before = [g.clone() for g in grads]
    flight = exchange.start(bucket, compressor, grads)
    value = exchange.finish(bucket, compressor, flight, 0.5, decode=True)
    assert len(value) == len(grads) and all(v is g for v, g in zip(value, grads, strict=True))
    assert all(p.grad is None for p in params)  # the exchange never touches a parameter
    for g, b in zip(grads, before, strict=True):
        if name == "none":  # one rank: the sum is the gradient, times the scale
            assert torch.equal(g, b * 0.5)
        else:  # 3LC's decode of one rank, halved: not the input, same shape
            assert not torch.equal(g, b) and g.shape == b.shape


def test_a_payload_that_fails_to_decode_raises_from_finish():
    bucket, _, grads = _bucket()
    compressor = comp("3lc")
    exchange = GatheredExchange(FlippingTransport())
    flight = exchange.start(bucket, compressor, grads)
    with pytest.raises(PayloadError):
        exchange.finish(bucket, compressor, flight, 1.0, decode=True)


def test_a_drained_bucket_returns_nothing_and_writes_nothing():
    bucket, _, grads = _bucket()
    compressor = comp("3lc")
    exchange = GatheredExchange(LocalTransport())
    before = [g.clone() for g in grads]
    flight = exchange.start(bucket, compressor, grads)
    assert exchange.finish(bucket, compressor, flight, 1.0, decode=False) is None
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
