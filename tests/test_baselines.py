"""The gather-only baselines (topk, randomk, qsgd, terngrad, signsgd, efsignsgd, dqsg):
each codec's defining property, the wire format, error feedback, non-finite input, state,
and the CPU primitives (counter-based uniforms, bit packing, chunk sums) against
independent Python / NumPy references. Statistical tests use fixed seeds, so they are
deterministic; their bounds are 5-sigma ones.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress.codecs import dqsg as dqsg_codec
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import sparse
from hvdcompress.wire import PayloadError

CONFIGS = [
    ("topk", {}),
    ("topk", {"ratio": 0.3}),
    ("randomk", {"ratio": 0.2}),
    ("randomk", {"ratio": 0.2, "unbiased": False, "error_feedback": True}),
    ("topkq", {"ratio": 0.1}),
    ("gspar", {"ratio": 0.1}),
    ("gspar", {"ratio": 0.3, "error_feedback": True}),
    ("qsgd", {}),
    ("qsgd", {"levels": 1, "bucket_size": 7}),
    ("terngrad", {}),
    ("signsgd", {}),
    ("efsignsgd", {}),
    ("dqsg", {}),
    ("dqsg", {"levels": 1}),
    ("dqsg", {"levels": 127, "bucket_size": 100}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in CONFIGS]


def comp(name, **kw):
    return hvdcompress.get_compressor(name, **kw)


# ---- primitives ------------------------------------------------------------------------


def _uniform_python(key: int, i: int) -> float:
    z = (key + (i + 1) * prim.GOLDEN) & prim.MASK64
    return (prim.mix64(z) >> 40) * 2.0**-24


@pytest.mark.parametrize("key", [0, 1, 2**64 - 1, prim.rng_key(7, 3, 1, prim.tensor_id("w"))])
def test_uniform_matches_python_and_numpy(key):
    n = 1000
    got = prim.uniform(key, n, torch.device("cpu")).numpy()
    np.testing.assert_array_equal(got, prim.uniform_numpy(key, n))
    assert [float(v) for v in got[:50]] == [_uniform_python(key, i) for i in range(50)]
    assert got.min() >= 0.0 and got.max() < 1.0
    assert abs(got.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)


def test_rng_key_pins_the_format():
    # Changing these changes every stochastic payload: they are part of the wire format.
    assert prim.mix64(1) == 0x5692161D100B05E5
    assert prim.tensor_id("w") == int.from_bytes(
        __import__("hashlib").blake2b(b"w", digest_size=8).digest(), "little"
    )
    keys = {prim.rng_key(s, t, r, 5) for s in range(3) for t in range(3) for r in range(3)}
    assert len(keys) == 27


def _pack_numpy(codes: np.ndarray, bits: int) -> np.ndarray:
    stream = ((codes[:, None].astype(np.int64) >> np.arange(bits)) & 1).reshape(-1)
    stream = np.concatenate([stream, np.zeros(-len(stream) % 8, np.int64)])
    return (stream.reshape(-1, 8) << np.arange(8)).sum(1).astype(np.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 3, 8, 13, 1001])
def test_bitpack_matches_numpy_and_roundtrips(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 2**bits, n).astype(np.uint8)
    packed = prim.bitpack(torch.from_numpy(codes), bits)
    np.testing.assert_array_equal(packed.numpy(), _pack_numpy(codes, bits))
    np.testing.assert_array_equal(prim.bitunpack(packed, n, bits).numpy(), codes)


@pytest.mark.parametrize("bits", [1, 3, 5, 7])
def test_bitunpack_rejects_padding_and_length(bits):
    n = 9  # 9 * bits is not a multiple of 8 for odd bits
    packed = prim.bitpack(torch.zeros(n, dtype=torch.uint8), bits).clone()
    packed[-1] |= 0x80
    with pytest.raises(PayloadError, match="padding"):
        prim.bitunpack(packed, n, bits)
    with pytest.raises(PayloadError):
        prim.bitunpack(packed[:-1], n, bits)


@pytest.mark.parametrize("square", [False, True])
def test_chunk_sums_are_left_to_right_doubles(square):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(10007) * 10.0 ** rng.integers(-6, 6, 10007)).astype(np.float32)
    got = prim.chunk_sums(torch.from_numpy(x), 512, square).numpy()
    v = x.astype(np.float64)
    v = v * v if square else np.abs(v)
    want = [np.add.accumulate(v[i : i + 512])[-1] for i in range(0, len(v), 512)]
    np.testing.assert_array_equal(got, want)


# ---- common behaviour -------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 0, 3), (3, 5), (4, 3, 2, 9), (10007,)])
def test_roundtrip_shape_dtype_and_receiver_needs_only_the_payload(name, kw, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    c = comp(name, **kw)
    payload, ctx = c.compress(x, "t")
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    a = c.decompress(payload, ctx)
    b = comp(name, **kw).decode(payload)  # a fresh receiver: no state, same agreed params
    assert a.shape == x.shape and a.dtype == dtype
    assert torch.equal(a, b) or (a.isnan() == b.isnan()).all()
    header, _ = c.read_header(payload)
    assert c.bits_per_value(payload) == 8 * payload.numel() / max(x.numel(), 1)
    assert header.codec == name
    if x.numel():
        ref = torch.zeros(x.numel())
        c.decode(payload, out=ref)
        assert torch.equal(ref.to(dtype).view(shape), a)
        out = torch.full((x.numel(),), 2.0)
        c.decode(payload, out=out, accumulate=True)
        assert torch.equal(out, ref + 2.0)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_flags_and_keeps_residual(name, kw, bad):
    c = comp(name, **kw)
    x = torch.randn(1000)
    c.compress(x, "w")
    before = (
        {k: v.clone() for k, v in getattr(c, "memory", None).residuals.items()}
        if hasattr(c, "memory")
        else {}
    )
    y = x.clone()
    y[17] = bad
    payload, ctx = c.compress(y, "w")
    header, _ = c.read_header(payload)
    assert header.nonfinite and header.body_len == 0
    assert c.decompress(payload, ctx).isnan().all()
    out = torch.zeros(1000)
    c.decode(payload, out=out, accumulate=True)
    assert out.isnan().all()
    if hasattr(c, "memory"):
        for k, v in before.items():
            assert torch.equal(c.memory.residuals[k], v)


@pytest.mark.parametrize(
    "name,kw,match",
    [
        ("topk", {"ratio": 0.0}, r"\(0, 1\]"),
        ("topk", {"ratio": 1.5}, r"\(0, 1\]"),
        ("randomk", {"ratio": -0.1}, r"\(0, 1\]"),
        ("qsgd", {"levels": 0}, r"\[1, 127\]"),
        ("qsgd", {"levels": 128}, r"\[1, 127\]"),
        ("qsgd", {"bucket_size": 0}, "bucket_size"),
        ("dqsg", {"levels": 0}, r"\[1, 127\]"),
        ("dqsg", {"levels": 2.5}, r"\[1, 127\]"),
        ("dqsg", {"seed": -1}, "seed"),
        ("terngrad", {"rank": -1}, "rank"),
    ],
)
def test_parameters_out_of_range_raise_at_construction(name, kw, match):
    with pytest.raises(ValueError, match=match):
        comp(name, **kw)


@pytest.mark.parametrize("name", ["randomk", "qsgd", "terngrad", "dqsg"])
def test_seeded_payloads_are_reproducible_and_checked(name):
    x = torch.randn(3000)
    p1, ctx = comp(name, seed=11).compress(x, "w")
    p2, _ = comp(name, seed=11).compress(x, "w")
    p3, _ = comp(name, seed=12).compress(x, "w")
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)
    with pytest.raises(PayloadError, match="seed"):
        comp(name, seed=12).decode(p1)
    other = hvdcompress.compressors.base.Ctx("v", ctx.shape, ctx.dtype, ctx.device)
    with pytest.raises(PayloadError, match="tensor"):
        comp(name, seed=11).decompress(p1, other)
    # ranks draw independent numbers; steps advance
    c = comp(name, seed=11, rank=1)
    q1, _ = c.compress(x, "w")
    q2, _ = c.compress(x, "w")
    assert not torch.equal(q1, p1) and not torch.equal(q1, q2)
    assert c.state_dict()["steps"] == {"w": 2}


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_state_dict_roundtrip(name, kw):
    c = comp(name, **kw)
    x = torch.randn(500)
    c.compress(x, "w")
    state = c.state_dict()
    d = comp(name, **kw)
    d.load_state_dict(state)
    assert torch.equal(c.compress(x, "w")[0], d.compress(x, "w")[0])


def test_registry_lists_the_baselines():
    for name in ("topk", "randomk", "qsgd", "terngrad", "signsgd", "efsignsgd", "dqsg"):
        assert name in hvdcompress.compressors.REGISTRY
        assert not hvdcompress.compressors.REGISTRY[name].summable


# ---- top-k ------------------------------------------------------------------------------


@pytest.mark.parametrize("n,ratio", [(1, 0.01), (100, 0.01), (1000, 0.05), (10007, 0.01)])
def test_topk_keeps_exactly_the_k_largest_and_residual_holds_the_rest(n, ratio):
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32)
    c = comp("topk", ratio=ratio)
    payload, ctx = c.compress(torch.from_numpy(g), "w")
    dec = c.decompress(payload, ctx).numpy()
    k = max(1, math.ceil(n * ratio))
    kept = np.flatnonzero(dec)
    assert len(kept) == k
    order = np.argsort(-np.abs(g), kind="stable")
    assert set(kept) == set(order[:k])
    np.testing.assert_array_equal(dec[kept], g[kept])
    e = c.memory.residuals["w"].numpy()
    assert (e[kept] == 0).all()
    np.testing.assert_array_equal(dec + e, g)
    header, _ = c.read_header(payload)
    assert header.body_len == 8 * k


def test_topk_ties_are_broken_by_lowest_index_and_ef_over_steps():
    g = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.5])
    c = comp("topk", ratio=0.34)  # k = 3 of 6... ceil(2.04) = 3
    dec = c.decompress(*c.compress(g, "w"))
    assert torch.equal(dec, torch.tensor([0.0, -3.0, 3.0, 0.0, -3.0, 0.0]))
    c = comp("topk", ratio=0.3)  # k = 2: ties at 3.0 keep indices 1, 2
    dec = c.decompress(*c.compress(g, "w"))
    assert torch.equal(dec, torch.tensor([0.0, -3.0, 3.0, 0.0, 0.0, 0.0]))
    # over steps, everything sent plus the residual is everything computed
    c = comp("topk", ratio=0.1)
    total_g, total_dec = torch.zeros(300), torch.zeros(300)
    torch.manual_seed(1)
    for _ in range(20):
        x = torch.randn(300)
        total_g += x
        total_dec += c.decompress(*c.compress(x, "w"))
    torch.testing.assert_close(total_dec + c.memory.residuals["w"], total_g)


def test_topk_int64_indices_above_2_pow_31():
    assert sparse.index_dtype(2**31 - 1) == torch.int32
    assert sparse.index_dtype(2**31) == torch.int64


# ---- random-k ---------------------------------------------------------------------------


def test_randomk_receiver_regenerates_the_indices():
    x = torch.randn(5000)
    c = comp("randomk", ratio=0.1, seed=3, rank=2)
    payload, ctx = c.compress(x, "layer.weight")
    header, _ = c.read_header(payload)
    seed, step, tid, rank = prim.RNG_PARAMS.unpack_from(header.params, 0)
    assert (seed, step, rank, tid) == (3, 0, 2, prim.tensor_id("layer.weight"))
    key = prim.rng_key(seed, step, rank, tid)
    mask = prim.uniform_numpy(key, 5000) < sparse.randomk_threshold(0.1) / 2**24
    dec = comp("randomk", ratio=0.1, seed=3).decode(payload).numpy()
    np.testing.assert_array_equal(dec != 0, mask)
    scale = np.float32(sparse.randomk_scale(0.1, True))
    assert abs(scale - 10.0) < 1e-5  # 1 / p for the p = round(0.1 * 2**24) / 2**24 used
    np.testing.assert_array_equal(dec[mask], x.numpy()[mask] * scale)
    assert header.body_len == 4 * mask.sum()
    assert abs(mask.mean() - 0.1) < 5 * math.sqrt(0.09 / 5000)


def test_randomk_unbiased_mean_over_seeds_approaches_x():
    n, steps, p = 200, 2000, 0.25
    x = torch.randn(n)
    c = comp("randomk", ratio=p, seed=5)
    total = torch.zeros(n)
    for _ in range(steps):
        c.decode(c.compress(x, "w")[0], out=total, accumulate=True)
    mean = total / steps
    bound = 5 * x.abs() * math.sqrt((1 - p) / p / steps) + 1e-6
    assert ((mean - x).abs() <= bound).all()


def test_randomk_error_feedback_invariant():
    c = comp("randomk", ratio=0.3, unbiased=False, error_feedback=True, seed=1)
    total_g, total_dec = torch.zeros(400), torch.zeros(400)
    torch.manual_seed(2)
    for _ in range(30):
        x = torch.randn(400)
        total_g += x
        total_dec += c.decompress(*c.compress(x, "w"))
    torch.testing.assert_close(total_dec + c.memory.residuals["w"], total_g)


# ---- QSGD and TernGrad: unbiased --------------------------------------------------------


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


# ---- signSGD and EF-signSGD -------------------------------------------------------------


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


# ---- DQSG -------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [1, 3, 7])
def test_dqsg_error_is_uniform_and_uncorrelated(levels):
    n = 512 * 400
    gen = torch.Generator().manual_seed(levels)
    w = torch.randn(n, generator=gen) * torch.linspace(0.1, 3.0, n)
    c = comp("dqsg", levels=levels, seed=21)
    payload, ctx = c.compress(w, "w")
    w_hat = c.decompress(payload, ctx).double()
    delta = (w.view(-1, 512).abs().amax(1) / levels).double().repeat_interleave(512)
    z = ((w_hat - w.double()) / delta).numpy()
    assert np.abs(z).max() <= 0.5 + 1e-5
    assert abs(z.mean()) < 5 * math.sqrt(1 / 12 / n)
    assert abs(z.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # Var(z^2) = 1/80 - 1/144
    corr = np.corrcoef(z, w.numpy())[0, 1]
    assert abs(corr) < 5 / math.sqrt(n)
    counts, _ = np.histogram(z, bins=10, range=(-0.5, 0.5))
    assert (np.abs(counts - n / 10) < 5 * math.sqrt(n / 10 * 0.9)).all()


def test_dqsg_receiver_regenerates_the_senders_dither():
    w = torch.randn(3000)
    c = comp("dqsg", levels=3, seed=8, rank=5)
    c.compress(w, "a")  # step 0 of "a"; the tested payload is step 1
    payload, ctx = c.compress(w, "a")
    header, _ = c.read_header(payload)
    seed, step, tid, rank = prim.RNG_PARAMS.unpack_from(header.params, 0)
    assert (seed, step, tid, rank) == (8, 1, prim.tensor_id("a"), 5)
    key = prim.rng_key(seed, step, rank, tid)
    u = prim.uniform_numpy(key, 3000) - np.float32(0.5)
    body = payload[header.size :]
    q, deltas = dqsg_codec.decode_q(body, 3000, 3, 512)
    # the sender's q is the quantisation of w with exactly this dither
    sender_q, sender_deltas = dqsg_codec.quantize(w, 3, 512, key)
    assert torch.equal(q, sender_q) and torch.equal(deltas, sender_deltas)
    d = np.repeat(deltas.numpy(), 512)[:3000]
    want = (np.rint(w.numpy() / d + u)).clip(-3, 3)
    np.testing.assert_array_equal(q.numpy(), want)
    dec = comp("dqsg", levels=3, seed=8).decode(payload).numpy()
    np.testing.assert_array_equal(dec, d * (q.numpy().astype(np.float32) - u))


def test_dqsg_bits():
    for levels, bits in [(2, 3), (3, 3), (4, 4), (7, 4), (8, 5), (127, 8)]:
        assert dqsg_codec.dqsg_bits(levels) == bits
    c = comp("dqsg", levels=3)
    payload, _ = c.compress(torch.randn(5120), "w")
    assert c.read_header(payload)[0].body_len == 10 * 4 + 5120 * 3 // 8


@pytest.mark.parametrize("kind", ["gauss", "ties", "sample_heavy", "zeros_on_sample"])
def test_topk_selection_on_large_tensors(kind):
    """The sampled-candidate path (n >= 4 * SAMPLE) and its fallback select exactly what a
    stable sort selects: the k largest |x|, ties by lowest index."""
    n = 300_007
    rng = np.random.default_rng(11)
    x = rng.standard_normal(n).astype(np.float32)
    stride = n // sparse.SAMPLE
    if kind == "ties":
        x = np.rint(x * 3).astype(np.float32)
    elif kind == "sample_heavy":  # every sampled element is large: fewer than k candidates
        x *= 1e-3
        x[::stride] = 100.0 + np.arange(len(x[::stride]), dtype=np.float32)
    elif kind == "zeros_on_sample":
        x[::stride] = 0.0
    for k in (1, 3000, 30000):
        idx = sparse.topk_select(torch.from_numpy(x), k).numpy()
        want = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
        np.testing.assert_array_equal(idx, want)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_input_unchanged_and_out_untouched_on_corrupt_bodies(name, kw):
    from tests.fuzzing import fix_checksum

    x = torch.randn(3001)
    x[::4] = 0.0
    keep = x.clone()
    c = comp(name, **kw)
    payload, ctx = c.compress(x, "w")
    assert torch.equal(x, keep)
    header, _ = c.read_header(payload)
    raw = payload.numpy().tobytes()
    rng = np.random.default_rng(0)
    rejected = 0
    for trial in range(60):
        buf = bytearray(raw)
        body = range(header.size, len(buf))
        if trial % 3 == 0:
            buf[int(rng.choice(body))] = int(rng.integers(0, 256))
        elif trial % 3 == 1:
            buf[-1] ^= 0xFF
        else:
            buf = buf[: int(rng.choice(body))]
            buf[24:32] = (len(buf) - header.size).to_bytes(8, "little")
        forged = torch.frombuffer(fix_checksum(buf), dtype=torch.uint8)
        out = torch.ones(3001)
        try:
            c.decode(forged, out=out, accumulate=bool(trial % 2))
        except PayloadError:
            rejected += 1
            assert torch.equal(out, torch.ones(3001))
    assert rejected > 0


# ---- top-k + sign and magnitude-proportional sparsification (CAT's other compressors) --------


def test_topkq_sends_the_mean_magnitude_with_signs_and_keeps_the_rest():
    x = torch.tensor([0.5, -4.0, 1.0, 3.0, -0.25, 2.0])
    c = comp("topkq", ratio=0.5)  # k = 3: indices 1, 3, 5, magnitude (4 + 3 + 2) / 3
    payload, ctx = c.compress(x, "w")
    dec = c.decompress(payload, ctx)
    assert dec.tolist() == [0.0, -3.0, 0.0, 3.0, 0.0, 3.0]
    np.testing.assert_array_equal(c.memory.residual("w", x).numpy(), (x - dec).numpy())
    # 4-byte magnitude + 3 int32 indices + 1 byte of sign bits
    assert c.read_header(payload)[0].body_len == 4 + 12 + 1


def test_topkq_error_feedback_keeps_a_equal_decode_plus_residual():
    torch.manual_seed(2)
    c = comp("topkq", ratio=0.05)
    e_prev = torch.zeros(4000)
    for _ in range(4):
        g = torch.randn(4000)
        payload, ctx = c.compress(g, "w")
        dec = c.decompress(payload, ctx)
        e = c.memory.residual("w", g)
        torch.testing.assert_close(dec + e, g + e_prev, rtol=0, atol=1e-6)
        e_prev = e.clone()


def test_gspar_scale_solves_the_budget_with_saturation():
    mag = torch.tensor([100.0, 50.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    c, rounds = sparse.gspar_scale(mag, 3.0)  # the two large ones saturate: c = 1 / 5
    assert c == pytest.approx(0.2) and rounds >= 2
    p = torch.clamp(mag * c, max=1.0)
    assert float(p.sum()) == pytest.approx(3.0)
    assert sparse.gspar_scale(mag, 7.0)[0] == math.inf  # every non-zero entry kept


@pytest.mark.parametrize("n", [1, 17, 5000])
def test_gspar_sends_a_over_p_and_keeps_everything_at_full_budget(n):
    torch.manual_seed(n)
    x = torch.randn(n)
    c = comp("gspar", ratio=1.0)
    payload, ctx = c.compress(x, "w")
    np.testing.assert_array_equal(c.decompress(payload, ctx).numpy(), x.numpy())
    c = comp("gspar", ratio=0.1, seed=4)
    payload, ctx = c.compress(x, "w")
    dec = c.decompress(payload, ctx)
    kept = dec != 0
    scale, _ = sparse.gspar_scale(x.abs(), 0.1 * n)
    p = torch.clamp(x.abs() * torch.tensor(scale, dtype=torch.float32), max=1.0)
    np.testing.assert_array_equal(dec[kept].numpy(), (x[kept] / p[kept]).numpy())


def test_gspar_is_unbiased_and_spends_its_budget_on_average():
    torch.manual_seed(0)
    n, ratio, draws = 2000, 0.05, 400
    x = torch.randn(n) * torch.linspace(0.01, 3.0, n)
    c = comp("gspar", ratio=ratio, seed=9)
    total, kept = torch.zeros(n, dtype=torch.float64), 0
    for _ in range(draws):
        payload, ctx = c.compress(x, "w")
        dec = c.decompress(payload, ctx)
        total += dec.double()
        kept += int((dec != 0).sum())
    assert abs(kept / draws - ratio * n) < 5 * math.sqrt(ratio * n / draws)
    scale, _ = sparse.gspar_scale(x.abs(), ratio * n)
    p = torch.clamp(x.abs().double() * scale, max=1.0)
    sd = (x.double().abs() * torch.sqrt((1 - p) / p) / math.sqrt(draws)).clamp(min=1e-12)
    z = ((total / draws - x.double()) / sd).abs()
    assert float(z.max()) < 6.0  # 2000 coordinates, none beyond 6 sigma
