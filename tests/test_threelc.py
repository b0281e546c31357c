"""3LC: the codec on the CPU backend (design-doc vectors, oracle agreement, building blocks,
64-bit sizes) and the compressor (wire bytes, dtypes and shapes, error feedback,
non-finite input, GradScaler, state)."""

import io

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.codecs import threelc
from tests import reference
from tests.helpers import comp
from tests.reference import DESIGN_VECTORS, DESIGN_X


def threelc_compressor(sparsity=1.0):
    return comp("3lc", sparsity=sparsity)


# ---- codec (hvdcompress.codecs.threelc) ----------------------------------------------------

SIZES = [0, 1, 4, 5, 6, 7, 13, 69, 70, 71, 1000, 100003]


@pytest.mark.parametrize("sparsity,scale,quartic,zre", DESIGN_VECTORS)
def test_spec_vectors(sparsity, scale, quartic, zre):
    x = torch.tensor(DESIGN_X)
    q, s = threelc.quantize(x, sparsity)
    assert s.item() == np.float32(scale)
    assert threelc.quartic_encode(q).tolist() == quartic
    assert threelc.zero_run_encode(threelc.quartic_encode(q)).tolist() == zre
    back = threelc.quartic_decode(threelc.zero_run_decode(torch.tensor(zre, dtype=torch.uint8)), 20)
    assert back.tolist() == q.tolist()


def test_spec_zre_vector():
    buf = torch.tensor([5] + [121] * 31 + [7] + [121] * 3, dtype=torch.uint8)
    assert threelc.zero_run_encode(buf).tolist() == [5, 255, 255, 244, 7, 244]
    assert (
        threelc.zero_run_decode(
            torch.tensor([5, 255, 255, 244, 7, 244], dtype=torch.uint8)
        ).tolist()
        == buf.tolist()
    )


def _sparse_gradient(n, rng, zero_fraction):
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < zero_fraction] = 0
    if n > 200:  # long zero runs that cross the 14-group boundary several times
        x[50 : 50 + 5 * 14 * 3 + 7] = 0
    return x


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sparsity", [1.0, 1.3, 1.75, 1.99])
def test_encode_matches_oracle(n, sparsity):
    rng = np.random.default_rng(n * 7 + int(sparsity * 100))
    g = _sparse_gradient(n, rng, 0.5)
    e = (rng.standard_normal(n) * 0.1).astype(np.float32)
    zre, scale, new_e = reference.encode(g, e, sparsity)
    e_t = torch.from_numpy(e.copy())
    enc = threelc.encode(torch.from_numpy(g), e_t, sparsity)
    assert not enc.nonfinite
    assert np.float32(enc.scale) == scale
    assert enc.body.numpy().tobytes() == zre.tobytes()
    assert e_t.numpy().tobytes() == new_e.tobytes()
    out = torch.full((n,), 7.0)
    threelc.decode_into(enc.body, n, enc.scale, out)
    q = reference.quantize(g + e, sparsity)[0]
    assert out.numpy().tobytes() == (scale * q.astype(np.float32)).tobytes()


@pytest.mark.parametrize("n", SIZES)
def test_building_blocks_roundtrip(n):
    rng = np.random.default_rng(n)
    q = torch.from_numpy(rng.integers(-1, 2, n).astype(np.int8))
    q[: n // 2] = 0
    quartic = threelc.quartic_encode(q)
    assert quartic.numpy().tobytes() == reference.quartic(q.numpy()).tobytes()
    zre = threelc.zero_run_encode(quartic)
    assert zre.numpy().tobytes() == reference.zre(quartic.numpy()).tobytes()
    assert torch.equal(threelc.zero_run_decode(zre, threelc.quartic_len(n)), quartic)
    assert torch.equal(threelc.quartic_decode(quartic, n), q)


def _zre_through(entry, quartic: np.ndarray) -> bytes:
    out = np.zeros(quartic.size + 2, np.uint8)
    length = entry(quartic.ctypes.data, quartic.size, out.ctypes.data)
    return out[:length].tobytes()


@pytest.mark.parametrize("zero_fraction", [0.0, 0.2, 0.5, 0.8, 0.97, 1.0])
def test_zero_run_encode_word_path_matches_oracle_and_portable_path(zero_fraction):
    """The word-table zero-run encoder (one shuffle per mixed 8-byte word, x86-64) gives the
    oracle's bytes and the portable byte-at-a-time path's, at every mix of zero groups and
    literals, at every length around the 8-byte words and 256-byte chunks, with runs that
    cross words, chunks and the 14-group code limit."""
    from hvdcompress.backends.cpu import LIB

    rng = np.random.default_rng(int(zero_fraction * 1000))
    for m in [*range(40), 255, 256, 257, 263, 264, 511, 512, 513, 4099]:
        for _ in range(4):
            quartic = rng.integers(0, 243, m).astype(np.uint8)
            quartic[rng.random(m) < zero_fraction] = threelc.ZERO_GROUP
            if m > 60 and rng.random() < 0.5:  # one long run at a random place
                start = int(rng.integers(0, m - 40))
                quartic[start : start + int(rng.integers(13, 40))] = threelc.ZERO_GROUP
            expected = reference.zre(quartic).tobytes()
            assert _zre_through(LIB.hvdc_threelc_zre_encode, quartic) == expected, (m, quartic)
            assert _zre_through(LIB.hvdc_threelc_zre_encode_portable, quartic) == expected


@pytest.mark.parametrize(
    "peak",
    [1.0, 3.0e-3, 1.7e38, 2.0**-124, 2.0**-125, 2.0**-125 * 1.5, 2.0**-126, 1.0e-40, 1.4e-45],
)
@pytest.mark.parametrize("sparsity", [1.0, 1.5, 1.99])
def test_quantize_at_half_the_scale_is_the_division_rule(peak, sparsity):
    """The quantiser compares |a| with S / 2 instead of rounding fl(a / S) (docs/codecs.md,
    "Quantisation with sparsity multiplication"):
    the same q at the boundary itself, the floats on either side of it and the rounding
    ties, for scales whose half is exact and for the tiny ones (S / 2 below the least
    normal float) that take the division."""
    peak = np.float32(peak)
    scale = np.float32(np.float32(sparsity) * peak)
    half = np.float32(scale * np.float32(0.5))
    near = [half]
    for _ in range(3):
        near += [np.nextafter(near[-1], np.float32(np.inf))]
    down = half
    for _ in range(3):
        down = np.nextafter(down, np.float32(0))
        near.append(down)
    near += [scale * np.float32(0.25), peak, np.float32(0)]
    near = [v for v in near if v <= peak]  # the peak stays the largest (smallest subnormals)
    values = np.array([peak] + [s * v for v in near for s in (1, -1)], np.float32)
    zre, s_sent, new_e = reference.encode(values, np.zeros_like(values), sparsity)
    e_t = torch.zeros(values.size)
    enc = threelc.encode(torch.from_numpy(values), e_t, sparsity)
    assert np.float32(enc.scale) == s_sent == scale
    assert enc.body.numpy().tobytes() == zre.tobytes()
    assert e_t.numpy().tobytes() == new_e.tobytes()


def test_all_zero_tensor_is_all_runs():
    enc = threelc.encode(torch.zeros(1000), None, 1.0)
    assert enc.scale == 0.0
    assert enc.body.tolist() == [255] * 14 + [241 + 4]  # 200 zero groups = 14*14 + 4


def test_largest_element_always_survives():
    x = torch.tensor([1e-3, -5.0, 2.0, 0.1, 4.9])
    for s in (1.0, 1.5, 1.999):
        q, _ = threelc.quantize(x, s)
        assert q[1].item() == -1


def test_decode_accumulate_adds_in_float32():
    g = torch.randn(1003)
    enc = threelc.encode(g, None, 1.0)
    acc = torch.randn(1003)
    expected = acc + torch.from_numpy(reference.quantize(g.numpy(), 1.0)[0]).float() * enc.scale
    threelc.decode_into(enc.body, 1003, enc.scale, acc, accumulate=True)
    assert torch.equal(acc, expected)


@pytest.mark.parametrize("n", [5 * 700, 5 * 700 - 3])
def test_decode_accumulate_leaves_run_groups_untouched(n):
    """Accumulating decode adds S * q for every group of a literal byte (a zero digit adds
    +0.0, turning a -0.0 into +0.0) and leaves the groups of every run code as they were
    (a -0.0 stays -0.0), for runs of every length 1..30 between literals (docs/codecs.md,
    "Decoded values")."""
    rng = np.random.default_rng(n)
    groups = -(-n // 5)
    quartic = rng.integers(0, 243, groups).astype(np.uint8)
    j = 0
    while j < groups:  # alternate literals and runs of 1, 2, ..., 30 zero groups
        r = int(rng.integers(1, 31))
        quartic[j + 1 : j + 1 + r] = threelc.ZERO_GROUP
        j += 1 + r
    if n % 5:
        quartic[-1] = 81 * int(rng.integers(0, 3)) + 27 * int(rng.integers(0, 3)) + 13
    body = reference.zre(quartic)
    levels = np.float32([-0.75, 0.0, 0.75])
    base = np.where(rng.random(n) < 0.5, np.float32(-0.0), rng.standard_normal(n)).astype(
        np.float32
    )
    expected = base.copy()
    digits = np.stack(
        [quartic // 81, quartic // 27 % 3, quartic // 9 % 3, quartic // 3 % 3, quartic % 3], 1
    )
    values = levels[digits.reshape(-1)][:n]
    # groups written as a run code (not a literal 121) are the ones to leave alone
    from_run = np.zeros(groups, bool)
    g = 0
    for b in body.tolist():
        if b >= 243:
            from_run[g : g + b - 241] = True
            g += b - 241
        else:
            g += 1
    add = ~np.repeat(from_run, 5)[:n]
    expected[add] = expected[add] + values[add]
    out = torch.from_numpy(base.copy())
    threelc.decode_into(torch.from_numpy(body), n, 0.75, out, accumulate=True)
    assert out.numpy().view(np.uint32).tolist() == expected.view(np.uint32).tolist()
    assert from_run.any() and (~from_run & (quartic == threelc.ZERO_GROUP)).any()


@pytest.mark.parametrize(
    "bad,field",
    [
        ([243] * 10, "body"),  # expands past ceil(n/5)
        ([121, 121], "body"),  # too short
    ],
)
def test_zero_run_decode_length_mismatch(bad, field):
    with pytest.raises(hvdcompress.PayloadError) as err:
        threelc.zero_run_decode(torch.tensor(bad, dtype=torch.uint8), expected_len=3)
    assert err.value.field == field


def test_quartic_decode_rejects_bad_bytes_and_padding():
    with pytest.raises(hvdcompress.PayloadError, match="above 242"):
        threelc.quartic_decode(torch.tensor([250], dtype=torch.uint8), 5)
    # n = 3: digits 3 and 4 are padding and must be 1; byte 120 has d4 = 0
    with pytest.raises(hvdcompress.PayloadError, match="padding"):
        threelc.quartic_decode(torch.tensor([120], dtype=torch.uint8), 3)
    with pytest.raises(hvdcompress.PayloadError, match="cannot hold"):
        threelc.quartic_decode(torch.tensor([121, 121], dtype=torch.uint8), 3)


def test_sparsity_range_is_checked():
    for bad in (0.5, 0.999, 2.0, 1.99999999, 3, float("nan")):
        with pytest.raises(ValueError, match=r"\[1.0, 2.0\)"):
            hvdcompress.get_compressor("3lc", sparsity=bad)


def test_size_math_is_64_bit():
    """Tensors past 2^31 (and 2^32) elements: the size arithmetic never wraps."""
    n = 2**33 + 3
    assert threelc.quartic_len(n) == (2**33 + 3 + 4) // 5
    header = wire.Header("3lc", 0, torch.float32, (2**31 + 1, 4), b"\0" * 8, 5)
    packed = header.pack()
    parsed = wire.parse_header(packed + b"\0" * 5, len(packed) + 5)
    assert parsed.numel == (2**31 + 1) * 4 and parsed.shape == (2**31 + 1, 4)
    # The C decoder's guard: a body must be able to expand to numel values.
    comp = hvdcompress.get_compressor("3lc")
    assert comp.max_numel(2**31, None) == 70 * 2**31  # Python ints: no overflow
    lib = __import__("hvdcompress.backends.cpu", fromlist=["LIB"]).LIB
    run = torch.tensor([255], dtype=torch.uint8)
    # 2^34 fake run bytes would decode to 14 * 2^34 > 2^32 groups: the length count is int64.
    assert lib.hvdc_threelc_zre_decoded_len(run.data_ptr(), 1) == 14


def test_zero_run_decoded_length_counts_every_byte():
    """The length a body expands to (sixteen bytes a step on x86-64, then a scalar tail):
    one group per literal, b - 241 per run byte, at every length around the step."""
    lib = __import__("hvdcompress.backends.cpu", fromlist=["LIB"]).LIB
    rng = np.random.default_rng(5)
    for length in [*range(0, 40), 255, 256, 257, 4099]:
        body = rng.integers(0, 256, length, dtype=np.uint8)
        body[rng.random(length) < 0.5] = 255  # runs and literals both common
        want = int(np.where(body > 242, body.astype(np.int64) - 241, 1).sum())
        got = lib.hvdc_threelc_zre_decoded_len(body.ctypes.data, length)
        assert got == want, length


def test_decode_indexes_past_2_to_the_31_groups():
    """A body describing 14 k + 1 > 2^31 groups (10.7e9 values): only the last group is real.

    Accumulating decode skips full zero runs (code 255) without touching ``out``, so ``out``
    can point 43 GB before a 5-float buffer: the last group lands in that buffer only if
    every index is 64-bit.
    """
    head = 14 * (2**31 // 14 + 1)  # zero groups before the real one: 2^31 + 12
    groups = head + 1
    n = 5 * groups
    body = torch.full((head // 14 + 1,), 255, dtype=torch.uint8)
    body[-1] = 201  # digits 2,1,1,1,0 -> q = 1, 0, 0, 0, -1
    real = torch.zeros(5)
    fake_out = real.data_ptr() - 4 * 5 * head  # address arithmetic only; never dereferenced
    lib = __import__("hvdcompress.backends.cpu", fromlist=["LIB"]).LIB
    assert lib.hvdc_threelc_decode(body.data_ptr(), body.numel(), n, 2.0, fake_out, 1) == 0
    assert real.tolist() == [2.0, 0.0, 0.0, 0.0, -2.0]


def test_building_blocks_reject_values_outside_their_alphabet():
    with pytest.raises(ValueError, match="digits"):
        threelc.quartic_encode(torch.tensor([0, 2, -1], dtype=torch.int8))
    with pytest.raises(ValueError, match="242"):
        threelc.zero_run_encode(torch.tensor([121, 250], dtype=torch.uint8))


# ---- compressor ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 0, 3), (3, 5), (4, 3, 2, 9), (100003,)])
def test_roundtrip_shape_dtype(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    c = threelc_compressor()
    payload, ctx = c.compress(x, "t")
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    for out in (c.decompress(payload, ctx), threelc_compressor().decode(payload)):
        assert out.shape == x.shape and out.dtype == dtype
    # math in float32: the decoded value plus the new residual is the float32 input
    if x.numel():
        e = c.memory.residuals["t"].view(shape)
        back = c.decompress(payload, ctx).float()
        assert torch.equal(back + e, x.float()) or torch.allclose(
            back + e, x.float(), rtol=0, atol=1e-6
        )


def test_payload_bytes_match_oracle_and_header():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((20, 51)).astype(np.float32)
    c = threelc_compressor(1.75)
    payload, _ = c.compress(torch.from_numpy(g), "w")
    zre, scale, _ = reference.encode(g.reshape(-1), np.zeros(g.size, np.float32), 1.75)
    header, raw = wire.read_header(payload)
    assert header.codec == "3lc" and header.shape == (20, 51) and header.dtype == torch.float32
    assert payload[header.size :].numpy().tobytes() == zre.tobytes()
    assert len(raw) == header.size == 32 + 16 + 8
    assert c.bits_per_value(payload) == 8 * payload.numel() / g.size


def test_non_contiguous_input():
    base = torch.randn(64, 48)
    x = base.t()[::2]
    assert not x.is_contiguous()
    a, ctx = threelc_compressor().compress(x, "nc")
    b, _ = threelc_compressor().compress(x.contiguous(), "nc")
    assert torch.equal(a, b)
    assert threelc_compressor().decompress(a, ctx).shape == x.shape


def test_error_feedback_accumulates_what_was_dropped():
    torch.manual_seed(3)
    c = threelc_compressor(1.5)
    total_true, total_sent = torch.zeros(5000), torch.zeros(5000)
    for _ in range(30):
        g = torch.randn(5000)
        payload, ctx = c.compress(g, "layer")
        total_true += g
        total_sent += c.decompress(payload, ctx)
    e = c.memory.residuals["layer"]
    assert torch.allclose(total_sent + e, total_true, atol=1e-4)
    # error feedback keeps the residual bounded, it does not grow with the step count
    assert e.abs().max() < 10 * total_true.abs().max() / 30**0.5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gives_all_nan_and_keeps_residual(bad):
    c = threelc_compressor()
    c.compress(torch.randn(100), "g")
    before = c.memory.residuals["g"].clone()
    x = torch.randn(100)
    x[17] = bad
    payload, ctx = c.compress(x, "g")
    header, _ = wire.read_header(payload)
    assert header.nonfinite and header.body_len == 0
    out = c.decompress(payload, ctx)
    assert out.shape == x.shape and torch.isnan(out).all()
    assert torch.equal(c.memory.residuals["g"], before)
    acc = torch.zeros(100)
    assert torch.isnan(threelc_compressor().decode(payload, out=acc, accumulate=True)).all()


def test_scale_overflow_is_treated_as_nonfinite():
    x = torch.tensor([3.0e38, 1.0])  # finite, but 1.9 * 3e38 overflows float32
    payload, ctx = threelc_compressor(1.9).compress(x, "big")
    assert wire.read_header(payload)[0].nonfinite
    assert torch.isnan(threelc_compressor(1.9).decompress(payload, ctx)).all()


def test_gradscaler_skips_the_step_on_nonfinite_gradient():
    """A NaN in one gradient travels as the non-finite flag: GradScaler skips the step."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    c = threelc_compressor()
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(3, 4)).sum()
    scaler.scale(loss).backward()
    model.weight.grad[0, 0] = float("inf")
    for name, p in model.named_parameters():
        payload, ctx = c.compress(p.grad, name)
        p.grad.copy_(c.decompress(payload, ctx))
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**3  # backed off: the step was skipped
    # and a finite step then goes through
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    for name, p in model.named_parameters():
        payload, ctx = c.compress(p.grad, name)
        p.grad.copy_(c.decompress(payload, ctx))
    scaler.step(opt)
    assert not torch.equal(before[0], model.weight.detach())


def test_state_dict_roundtrip_is_exact():
    torch.manual_seed(5)
    a = threelc_compressor(1.25)
    grads = [torch.randn(300) for _ in range(6)]
    for g in grads[:3]:
        a.compress(g, "p")
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = threelc_compressor(1.25)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    for g in grads[3:]:
        pa, _ = a.compress(g, "p")
        pb, _ = b.compress(g, "p")
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="sparsity"):
        threelc_compressor(1.5).load_state_dict(a.state_dict())
