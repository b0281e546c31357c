"""The sign compressors: signSGD (one bit, exact signs) and EF-signSGD (scaled signs
with error feedback)."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers import comp


def test_signsgd_exact_signs_one_bit():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3e-30, -5.0, 7.0, 1.0, -1.0])
    c = comp("signsgd")
    payload, ctx = c.compress(x, "w")
    dec = c.decompress(payload, ctx)
    assert torch.equal(dec, torch.tensor([1.0, -1, 1, 1, 1, -1, 1, 1, -1]))
    assert c.read_header(payload)[0].body_len == 2
    y = torch.randn(10007)
    assert torch.equal(c.decode(c.compress(y, "y")[0]), torch.where(y < 0, -1.0, 1.0))


def test_efsignsgd_scale_signs_and_error_feedback():
    c = comp("efsignsgd")
    torch.manual_seed(3)
    total_g, total_dec = torch.zeros(3001), torch.zeros(3001)
    e = torch.zeros(3001)
    for _ in range(10):
        g = torch.randn(3001)
        a = g + e
        payload, ctx = c.compress(g, "w")
        dec = c.decompress(payload, ctx)
        scale = np.float32(np.abs(a.numpy().astype(np.float64)).sum() / a.numel())
        assert torch.equal(dec, torch.where(a < 0, -float(scale), float(scale)))
        e = c.memory.residuals["w"].clone()
        assert torch.equal(e, a - dec)
        total_g += g
        total_dec += dec
    torch.testing.assert_close(total_dec + e, total_g)
