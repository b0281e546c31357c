"""The unbiased stochastic quantizers: QSGD (levels per bucket norm) and TernGrad
(ternary). Statistical tests use fixed seeds, so they are deterministic; their bounds are
5-sigma ones."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdcompress import wire
from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import quant, threelc
from hvdcompress.errors import PayloadError
from tests import bucket_of_one as one
from tests.codec_inputs import gradients, special_tensor
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
    header, _ = wire.read_header(payload)
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


# ---- the native codecs against the torch formulas ------------------------------------------
# QSGD and TernGrad run as native passes (kernels/quant.c on the CPU); these are the
# formulas of hvdcompress.codecs.quant's docstring as plain torch ops (the codecs before
# they went native): the bodies and decoded values must be the same bytes for any input.


def reference_qsgd_encode(x, levels, bucket, key):
    n = x.numel()
    if not prim.all_finite(x):
        return None
    norms = torch.sqrt(prim.chunk_sums(x, bucket, True)).to(torch.float32)
    if not prim.all_finite(norms):
        return None
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]
    x2 = quant.padded(x, bucket)
    r = (x2.abs() / safe) * float(levels)
    r += prim.uniform(key, x2.numel(), x.device).view(x2.shape)
    lvl = torch.floor_(r).clamp_(0, levels).to(torch.uint8)
    neg = ((x2 < 0) & (lvl > 0)).to(torch.uint8)
    codes = (lvl * 2 + neg).view(-1)[:n]
    return torch.cat([prim.float_bytes(norms), prim.bitpack(codes, quant.qsgd_bits(levels))])


def reference_qsgd_decode(body, n, levels, bucket, out, accumulate):
    nb = quant.num_buckets(n, bucket)
    norms = prim.floats_from(body, nb)
    codes = prim.bitunpack(body[4 * nb :], n, quant.qsgd_bits(levels))
    lvl, neg = codes >> 1, codes & 1
    mag = prim.divide(quant.padded(lvl, bucket).to(torch.float32), float(levels)) * norms[:, None]
    val = torch.where(neg.bool(), -mag.view(-1)[:n], mag.view(-1)[:n])
    return out + val if accumulate else val


def reference_terngrad_encode(x, key):
    if not prim.all_finite(x):
        return None
    n = x.numel()
    scale = prim.absmax(x)
    if scale == 0.0:
        q = torch.zeros(n, dtype=torch.int8)
    else:
        keep = prim.uniform(key, n, x.device) < prim.divide(x.abs(), scale)
        q = torch.where(keep, torch.sign(x), torch.zeros_like(x)).to(torch.int8)
    return threelc.zero_run_encode(threelc.quartic_encode(q)), scale


def check_qsgd(x, levels, bucket, key):
    want = reference_qsgd_encode(x, levels, bucket, key)
    got = quant.qsgd_encode(x, levels, bucket, key)
    if want is None:
        assert got is None
        return
    assert torch.equal(got, want)
    n = x.numel()
    out = torch.randn(n)
    for accumulate in (False, True):
        dec = out.clone()
        quant.qsgd_decode_into(got, n, levels, bucket, dec, accumulate)
        ref = reference_qsgd_decode(want, n, levels, bucket, out, accumulate)
        assert torch.equal(dec.view(torch.int32), ref.view(torch.int32))


def check_terngrad(x, key):
    want = reference_terngrad_encode(x, key)
    got = quant.terngrad_encode(x, key)
    if want is None:
        assert got is None
        return
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


KEYS = st.integers(0, 2**64 - 1)


@settings(max_examples=150)
@given(
    x=gradients(),
    levels=st.sampled_from([1, 2, 3, 7, 9, 16, 31, 40, 64, 127]),  # codes of 2..8 bits
    bucket=st.sampled_from([1, 7, 64, 512, 1000]),
    key=KEYS,
)
def test_qsgd_native_matches_torch_formulas(x, levels, bucket, key):
    check_qsgd(x, levels, bucket, key)


@settings(max_examples=150)
@given(x=gradients(), key=KEYS)
def test_terngrad_native_matches_torch_formulas(x, key):
    check_terngrad(x, key)


@pytest.mark.parametrize("n", [0, 1, 5, 7, 8, 9, 511, 512, 513, 1021, 4097])
@pytest.mark.parametrize("kind", ["zeros", "negzeros", "subnormal", "huge", "inf", "nan", "mixed"])
def test_quantizers_edge_sizes_and_specials(n, kind):
    x = special_tensor(n, kind)
    for levels, bucket in ((16, 512), (1, 7), (127, 64)):
        check_qsgd(x, levels, bucket, 12345)
    check_terngrad(x, 2**64 - 1)


def test_qsgd_decode_rejects_bad_bodies_out_untouched():
    x = torch.randn(700)
    body = quant.qsgd_encode(x, 2, 512, 1)  # 3-bit codes: 6 and 7 are not codes
    out = torch.full((700,), 5.0)
    bad_norm = body.clone()
    bad_norm[:4] = torch.tensor([0, 0, 0x80, 0xBF], dtype=torch.uint8)  # -1.0
    bad_code = body.clone()
    bad_code[8] = 0xFF  # code 7: level 3 > 2
    signed_zero = body.clone()
    signed_zero[8] = (signed_zero[8] & 0xF8) | 0x01  # code 1: level 0 with the sign bit
    bad_pad = body.clone()
    bad_pad[-1] |= 0x80  # 700 * 3 bits leave 4 padding bits
    for bad, match in (
        (bad_norm, "norm"),
        (bad_code, "level"),
        (signed_zero, "level"),
        (bad_pad, "padding"),
        (body[:-1], "bytes"),
    ):
        with pytest.raises(PayloadError, match=match):
            quant.qsgd_decode_into(bad, 700, 2, 512, out, True)
    assert torch.equal(out, torch.full((700,), 5.0))


@pytest.mark.parametrize("levels", [0, 128, 200])
def test_qsgd_decode_refuses_levels_past_one_byte_codes(levels):
    """Levels come from the receiver's own compressor, never from a payload, but the
    decoder's byte-wide codes and value table hold at most 127: the codec refuses others
    (ValueError), and so does the native decoder called directly, out untouched."""
    body = quant.qsgd_encode(torch.randn(700), 2, 512, 1)
    out = torch.full((700,), 5.0)
    with pytest.raises(ValueError, match="levels"):
        quant.qsgd_decode_into(body, 700, levels, 512, out, True)
    with pytest.raises(PayloadError, match="levels outside 1..127"):
        one.qsgd_decode(cpu_backend, body, 700, levels, 8, 512, out, True)
    assert torch.equal(out, torch.full((700,), 5.0))


@pytest.mark.parametrize("bucket", [8, 9, 10, 11, 12, 13, 100, 1001])
def test_qsgd_norms_eight_buckets_at_a_time(bucket):
    """The encoder sums the squares of eight whole buckets at once in vector lanes (AVX2),
    then a bucket's last bucket % 4 elements, and the leftover buckets four at a time:
    the norms (and so the body) are the reference's, left-to-right sums in double, for
    bucket sizes with every remainder mod 4 and tensors ending mid-bucket."""
    gen = torch.Generator().manual_seed(bucket)
    for n in (8 * bucket, 16 * bucket + 3 * bucket + 5, 9 * bucket - 1):
        x = torch.randn(n, generator=gen) * torch.logspace(-3, 3, n)
        assert torch.equal(
            quant.qsgd_encode(x, 16, bucket, 9), reference_qsgd_encode(x, 16, bucket, 9)
        )


@pytest.mark.parametrize("levels", [16, 7, 9, 127])
def test_qsgd_decode_value_rule_at_every_level(levels):
    """The decoder forms +-((l / s) * norm) from l * (1 / s) when that rounds to l / s at
    every level (s = 16, 9: vector products) and from a table of l / s otherwise (7, 127):
    both give the reference's values for every code, written and accumulated."""
    # buckets of two, (cos t, sin t) with both signs: |x| / norm sweeps [0, 1]
    t = torch.linspace(0.0, 2 * math.pi, 64 * levels)
    x = torch.stack([torch.cos(t), torch.sin(t)], 1).reshape(-1)
    n = x.numel()
    body = quant.qsgd_encode(x, levels, 2, 3)
    codes = prim.bitunpack(body[4 * (n // 2) :], n, quant.qsgd_bits(levels))
    assert set(codes.tolist()) == set(range(2 * levels + 2)) - {1}  # every code
    out = torch.randn(n)
    for accumulate in (False, True):
        got = out.clone()
        quant.qsgd_decode_into(body, n, levels, 2, got, accumulate)
        want = reference_qsgd_decode(body, n, levels, 2, out, accumulate)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_quantizer_bytes_independent_of_threads(monkeypatch, threads):
    """HVDC_NUM_THREADS splits the native passes; the bytes do not change."""
    monkeypatch.setenv("HVDC_NUM_THREADS", threads)
    monkeypatch.setattr(cpu_backend._library, "_MIN_PART", 64)
    gen = torch.Generator().manual_seed(5)
    for n in (1, 100, 5003, 20000):
        x = torch.randn(n, generator=gen)
        for levels, bucket in ((16, 512), (3, 100), (127, 1)):
            assert torch.equal(
                quant.qsgd_encode(x, levels, bucket, 77),
                reference_qsgd_encode(x, levels, bucket, 77),
            )
        got, want = quant.terngrad_encode(x, 78), reference_terngrad_encode(x, 78)
        assert torch.equal(got[0], want[0]) and got[1] == want[1]
