"""The API every compressor shares: get_compressor and the registry, the Compression
namespace, and compress / decode / decompress / state_dict over every configuration of
the gather-only compressors in CONFIGS (shapes and dtypes, a fresh receiver, non-finite
input, corrupt bodies, seeds, checkpoints). Each family's own properties are in its
module (test_threelc.py, test_sparse.py, test_quantizers.py, test_sign.py,
test_dithered.py, test_powersgd.py, test_cast.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.compressors import registry
from hvdcompress.errors import DecodeOverflowError
from hvdcompress.wire import PayloadError
from tests.fuzz.harness import fix_checksum
from tests.helpers import LocalTransport, comp, small_model

# Every example configuration of every gather-only compressor
# (hvdcompress.compressors.registry), and edge cases of the baselines' parameters on top.
EDGE_CASES = [
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
CONFIGS = EDGE_CASES + [
    (name, params)
    for name, params in registry.examples()
    if not registry.REGISTRY[name].summable and (name, params) not in EDGE_CASES
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in CONFIGS]


# ---- registry and get_compressor -----------------------------------------------------------


def test_get_compressor_lists_valid_choices():
    with pytest.raises(ValueError, match=r"3lc\(sparsity=1.0\)"):
        hvdcompress.get_compressor("4lc")
    with pytest.raises(TypeError, match="sparsity"):
        hvdcompress.get_compressor("3lc", ratio=0.1)


def test_registry_lists_the_baselines():
    for name in ("topk", "randomk", "qsgd", "terngrad", "signsgd", "efsignsgd", "dqsg"):
        assert name in hvdcompress.compressors.REGISTRY
        assert not hvdcompress.compressors.REGISTRY[name].summable


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


# ---- the Compression namespace (Horovod-compatible) ----------------------------------------


def test_compat_classes():
    t = torch.randn(4)
    half, ctx = hvdcompress.Compression.fp16.compress(t)
    assert half.dtype == torch.float16
    assert hvdcompress.Compression.fp16.decompress(half, ctx).dtype == torch.float32
    threelc = hvdcompress.Compression.threelc(sparsity=1.5)
    assert repr(threelc.make_compressor()) == "ThreeLC(sparsity=1.5)"
    with pytest.raises(TypeError, match="hvdcompress.DistributedOptimizer"):
        threelc.compress(t)
    with pytest.raises(ValueError):
        hvdcompress.Compression.threelc(sparsity=2.5)
    with pytest.raises(TypeError, match="not a compressor"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD(small_model().parameters(), lr=0.1), compression=3,
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


# ---- compress / decode / decompress --------------------------------------------------------


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
    header, _ = wire.read_header(payload)
    assert c.bits_per_value(payload) == 8 * payload.numel() / max(x.numel(), 1)
    assert header.codec == name
    if x.numel():
        ref = torch.zeros(x.numel())
        c.decode(payload, out=ref)
        assert torch.equal(ref.to(dtype).view(shape), a)
        out = torch.full((x.numel(),), 2.0)
        c.decode(payload, out=out, accumulate=True)
        assert torch.equal(out, ref + 2.0)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="float64"):
        comp("3lc").compress(torch.randn(3, dtype=torch.float64), "d")


def test_decompress_checks_expectations():
    c = comp("3lc")
    payload, ctx = c.compress(torch.randn(4, 5), "x")
    _, other = c.compress(torch.randn(5, 4), "y")
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decompress(payload, other)
    assert err.value.field == "shape" and "'y'" in str(err.value)
    _, half = c.compress(torch.randn(4, 5).half(), "z")
    with pytest.raises(hvdcompress.PayloadError, match="dtype"):
        c.decompress(payload, half)
    with pytest.raises(hvdcompress.PayloadError, match="sparsity") as err:
        comp("3lc", sparsity=1.5).decode(payload, rank=3, name="x")
    assert "rank 3" in str(err.value)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_never_returns_infinities_with_the_flag_clear(name, kw, dtype):
    """Values at the top of a 16-bit dtype's range (fp16's 65504; bf16's 3.39e38) may
    decode to float32 values past it (3LC at s = 1.75 sends 1.75 * 65504): the public
    decode then raises DecodeOverflowError, a PayloadError and an OverflowError naming the
    tensor, instead of returning +-Inf as if they were values."""
    top = torch.finfo(dtype).max
    x = torch.tensor([top, -top, top, 1.0, -0.5, 0.0, top / 2, -top] * 8, dtype=dtype)
    for sparsity in (1.5, 1.75) if name == "3lc" else (None,):
        params = dict(kw, sparsity=sparsity) if sparsity else kw
        c = comp(name, **params)
        payload, ctx = c.compress(x, "w")
        if wire.read_header(payload)[0].nonfinite:
            continue  # the sender flagged the input as non-finite: all NaN is documented
        try:
            out = c.decode(payload, expect=ctx)
        except DecodeOverflowError as err:
            assert isinstance(err, PayloadError) and isinstance(err, OverflowError)
            assert err.field == "overflow" and "'w'" in str(err)
            continue
        except PayloadError as err:  # gspar's x / p past float32: a body the decoder refuses
            assert err.field == "body" and "'w'" in str(err), str(err)
            continue
        assert out.dtype == dtype and bool(torch.isfinite(out).all()), out


def test_decode_overflow_is_reported_for_3lc_at_high_sparsity():
    """The case of the issue: fp16 values near 65504, 3LC at s = 1.75."""
    x = torch.tensor([65504.0, -65000.0, 1.0, 0.5], dtype=torch.float16)
    c = comp("3lc", sparsity=1.75)
    payload, ctx = c.compress(x, "w")
    with pytest.raises(OverflowError, match="float16 holds at most 65504"):
        c.decode(payload, expect=ctx)
    with pytest.raises(hvdcompress.PayloadError, match="tensor 'w'") as err:
        c.decode(payload, name="w")
    assert err.value.field == "overflow"
    acc = torch.zeros(4)  # the gather path's float32 accumulator holds the values
    c.decode(payload, expect=ctx, out=acc)
    assert acc[0] == float(torch.tensor(1.75, dtype=torch.float32) * 65504.0)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_flags_and_keeps_residual(name, kw, bad):
    c = comp(name, **kw)
    x = torch.randn(1000)
    c.compress(x, "w")
    before = {k: v.clone() for k, v in c.memory.residuals.items()} if c.memory is not None else {}
    y = x.clone()
    y[17] = bad
    payload, ctx = c.compress(y, "w")
    header, _ = wire.read_header(payload)
    assert header.nonfinite and header.body_len == 0
    assert c.decompress(payload, ctx).isnan().all()
    out = torch.zeros(1000)
    c.decode(payload, out=out, accumulate=True)
    assert out.isnan().all()
    if c.memory is not None:
        for k, v in before.items():
            assert torch.equal(c.memory.residuals[k], v)


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
def test_input_unchanged_and_out_untouched_on_corrupt_bodies(name, kw):
    x = torch.randn(3001)
    x[::4] = 0.0
    keep = x.clone()
    c = comp(name, **kw)
    payload, ctx = c.compress(x, "w")
    assert torch.equal(x, keep)
    header, _ = wire.read_header(payload)
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


# ---- state: residuals, RNG steps, checkpoints ----------------------------------------------


def test_residuals_are_per_name_and_checked():
    c = comp("3lc")
    c.compress(torch.ones(10), "a")
    c.compress(torch.ones(20), "b")
    assert set(c.memory.residuals) == {"a", "b"}
    with pytest.raises(ValueError, match="name was reused"):
        c.compress(torch.ones(11), "a")


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
