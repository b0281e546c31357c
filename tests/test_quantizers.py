"""The unbiased stochastic quantizers: QSGD (levels per bucket norm) and TernGrad
(ternary). Statistical tests use fixed seeds, so they are deterministic; their bounds are
5-sigma ones."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import comp


@pytest.mark.parametrize("levels,bucket", [(16, 512), (1, 64), (4, 1000)])
def test_qsgd_is_unbiased_and_on_its_grid(levels, bucket):
    n, steps = 1000, 1500
    x = torch.randn(n)
    c = comp("qsgd", levels=levels, bucket_size=bucket, seed=9)
    norms = torch.cat([x[i : i + bucket].norm().reshape(1) for i in range(0, n, bucket)])
    unit = norms.repeat_interleave(bucket)[:n] / levels
    total = torch.zeros(n)
    for step in range(steps):
        dec = c.decode(c.compress(x, "w")[0])
        if step == 0:
            lv = dec.abs() / unit
            torch.testing.assert_close(lv, lv.round(), rtol=0, atol=1e-3)
            assert ((dec - x).abs() <= unit * 1.0001).all()
            assert ((dec == 0) | (torch.sign(dec) == torch.sign(x))).all()
        total += dec
    bound = 5 * unit * math.sqrt(0.25 / steps) + 1e-5
    assert ((total / steps - x).abs() <= bound).all()


def test_qsgd_bits_per_value():
    c = comp("qsgd", levels=16)
    payload, _ = c.compress(torch.randn(512 * 40), "w")
    header, _ = c.read_header(payload)
    assert header.body_len == 40 * 4 + 512 * 40 * 6 // 8


def test_terngrad_is_unbiased_and_ternary():
    n, steps = 500, 2000
    x = torch.randn(n)
    c = comp("terngrad", seed=4)
    m = float(x.abs().max())
    total = torch.zeros(n)
    for _ in range(steps):
        dec = c.decode(c.compress(x, "w")[0])
        assert set(dec.unique().tolist()) <= {-m, 0.0, m}
        assert ((dec == 0) | (torch.sign(dec) == torch.sign(x))).all()
        total += dec
    bound = 5 * m * math.sqrt(0.25 / steps)
    assert ((total / steps - x).abs() <= bound).all()
    assert c.decode(c.compress(x, "w")[0])[int(x.abs().argmax())] == m * torch.sign(
        x[int(x.abs().argmax())]
    )
