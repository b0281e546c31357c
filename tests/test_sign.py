"""The sign compressors: signSGD (one bit, exact signs) and EF-signSGD (scaled signs
with error feedback)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdcompress import wire
from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import sign
from hvdcompress.errors import PayloadError
from tests.codec_inputs import gradients, special_tensor
from tests.helpers import comp


def test_signsgd_exact_signs_one_bit():
    x = torch.tensor([1.0, -2.0, 0.0, -0.0, 3e-30, -5.0, 7.0, 1.0, -1.0])
    c = comp("signsgd")
    payload, ctx = c.compress(x, "w")
    dec = c.decompress(payload, ctx)
    assert torch.equal(dec, torch.tensor([1.0, -1, 1, 1, 1, -1, 1, 1, -1]))
    assert wire.read_header(payload)[0].body_len == 2
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


# ---- the native codecs against the torch formulas ------------------------------------------
# The codecs run as one native pass (kernels/sign.c on the CPU); these are the formulas of
# hvdcompress.codecs.sign's docstring as plain torch ops (the codec before it went
# native), and the payload bytes must be the same for any input.


def reference_sign_bits(x: torch.Tensor) -> torch.Tensor:
    return prim.bitpack((x < 0).to(torch.uint8), 1)


def reference_ef_encode(g: torch.Tensor, e: torch.Tensor):
    """(body, scale, new e) of EF-signSGD, or None when g + e is not finite."""
    a = g + e
    if not prim.all_finite(a):
        return None
    n = a.numel()
    scale = 0.0 if n == 0 else float(torch.tensor(prim.abs_sum(a) / n, dtype=torch.float32))
    decoded = torch.where(a < 0, -scale, scale)
    return reference_sign_bits(a), scale, a - decoded


def reference_decode(body, n, scale, out, accumulate):
    bits = prim.bitunpack(body, n, 1)
    val = 1.0 - 2.0 * bits.to(torch.float32)
    if scale is not None:
        val = val * scale
    return out + val if accumulate else val


def check_signsgd(x: torch.Tensor) -> None:
    body = sign.encode(x)
    if not prim.all_finite(x):
        assert body is None
        return
    assert torch.equal(body, reference_sign_bits(x))
    n = x.numel()
    out = torch.randn(n)
    for scale in (None, 0.0, 0.375):
        for accumulate in (False, True):
            got = out.clone()
            sign.decode_into(body, n, scale, got, accumulate)
            want = reference_decode(body, n, scale, out, accumulate)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def check_efsignsgd(g: torch.Tensor, e: torch.Tensor) -> None:
    want = reference_ef_encode(g, e)
    e_native = e.clone()
    got = sign.ef_encode(g, e_native)
    if want is None:
        assert got is None
        assert torch.equal(e_native, e), "the residual changed on non-finite input"
        return
    body, scale = got
    assert torch.equal(body, want[0])
    assert scale == want[1]
    assert torch.equal(e_native.view(torch.int32), want[2].view(torch.int32))


@settings(max_examples=150)
@given(x=gradients())
def test_signsgd_native_matches_torch_formulas(x):
    check_signsgd(x)


@settings(max_examples=150)
@given(g=gradients(), e_seed=st.integers(0, 2**32 - 1), e_scale=st.sampled_from([0.0, 1e-3, 1.0]))
def test_efsignsgd_native_matches_torch_formulas(g, e_seed, e_scale):
    e = torch.randn(g.numel(), generator=torch.Generator().manual_seed(e_seed)) * e_scale
    check_efsignsgd(g, e)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1023, 1024, 1025, 4097])
@pytest.mark.parametrize("kind", ["zeros", "negzeros", "subnormal", "huge", "inf", "nan", "mixed"])
def test_sign_codecs_edge_sizes_and_specials(n, kind):
    x = special_tensor(n, kind)
    check_signsgd(x)
    check_efsignsgd(x, torch.zeros(n))
    check_efsignsgd(x, special_tensor(n, "mixed"))


def test_sign_decode_rejects_bad_bodies_out_untouched():
    out = torch.full((9,), 7.0)
    with pytest.raises(PayloadError, match="padding"):
        sign.decode_into(torch.tensor([0, 0x02], dtype=torch.uint8), 9, None, out, True)
    with pytest.raises(PayloadError, match="sign bits"):
        sign.decode_into(torch.zeros(3, dtype=torch.uint8), 9, None, out, False)
    assert torch.equal(out, torch.full((9,), 7.0))


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_sign_codecs_bytes_independent_of_threads(monkeypatch, threads):
    """HVDC_NUM_THREADS splits the native passes; the bytes and residuals do not change."""
    monkeypatch.setenv("HVDC_NUM_THREADS", threads)
    monkeypatch.setattr(cpu_backend._library, "_MIN_PART", 64)
    gen = torch.Generator().manual_seed(11)
    for n in (1, 100, 5003, 20000):
        g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        assert torch.equal(sign.encode(g), reference_sign_bits(g))
        want = reference_ef_encode(g, e)
        body, scale = sign.ef_encode(g, e)
        assert (torch.equal(body, want[0]), scale) == (True, want[1])
        assert torch.equal(e, want[2])


@pytest.mark.parametrize("threads", ["1", "3"])
def test_ef_encode_segments_is_ef_encode_of_each(monkeypatch, threads):
    """A bucket's one-call EF-signSGD encoder gives each tensor's ef_encode (bytes, scale,
    residual); with codec threads, tensors big enough to be cut into parts take the
    per-tensor path beside the others."""
    monkeypatch.setenv("HVDC_NUM_THREADS", threads)
    monkeypatch.setattr(cpu_backend._library, "_MIN_PART", 64)
    gen = torch.Generator().manual_seed(5)
    gs = [torch.randn(n, generator=gen) for n in (0, 1, 100, 127, 5003, 3)]
    gs[5][1] = float("nan")
    es = [torch.randn(g.numel(), generator=gen) for g in gs]
    wants = [(g, e.clone()) for g, e in zip(gs, es, strict=True)]
    got = sign.ef_encode_segments(gs, es)
    for (g, e_want), result, e_got in zip(wants, got, es, strict=True):
        want = sign.ef_encode(g, e_want)
        if want is None:
            assert result is None
        else:
            assert torch.equal(result[0], want[0]) and result[1] == want[1]
        assert torch.equal(e_got, e_want)


def test_signsgd_payload_nonfinite_flag():
    c = comp("signsgd")
    payload, _ = c.compress(torch.tensor([1.0, float("inf")]), "w")
    assert wire.read_header(payload)[0].flags & wire.FLAG_NONFINITE
