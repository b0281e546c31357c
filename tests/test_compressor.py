"""The 3LC compressor: wire format, dtypes and shapes, error feedback, non-finite input, state."""

import io

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import wire
from tests import reference


def comp(sparsity=1.0):
    return hvdcompress.get_compressor("3lc", sparsity=sparsity)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7, 0, 3), (3, 5), (4, 3, 2, 9), (100003,)])
def test_roundtrip_shape_dtype(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape).to(dtype)
    c = comp()
    payload, ctx = c.compress(x, "t")
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    for out in (c.decompress(payload, ctx), comp().decode(payload)):
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
    c = comp(1.75)
    payload, _ = c.compress(torch.from_numpy(g), "w")
    zre, scale, _ = reference.encode(g.reshape(-1), np.zeros(g.size, np.float32), 1.75)
    header, raw = c.read_header(payload)
    assert header.codec == "3lc" and header.shape == (20, 51) and header.dtype == torch.float32
    assert payload[header.size :].numpy().tobytes() == zre.tobytes()
    assert len(raw) == header.size == 32 + 16 + 8
    assert c.bits_per_value(payload) == 8 * payload.numel() / g.size


def test_non_contiguous_input():
    base = torch.randn(64, 48)
    x = base.t()[::2]
    assert not x.is_contiguous()
    a, ctx = comp().compress(x, "nc")
    b, _ = comp().compress(x.contiguous(), "nc")
    assert torch.equal(a, b)
    assert comp().decompress(a, ctx).shape == x.shape


def test_error_feedback_accumulates_what_was_dropped():
    torch.manual_seed(3)
    c = comp(1.5)
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


def test_residuals_are_per_name_and_checked():
    c = comp()
    c.compress(torch.ones(10), "a")
    c.compress(torch.ones(20), "b")
    assert set(c.memory.residuals) == {"a", "b"}
    with pytest.raises(ValueError, match="name was reused"):
        c.compress(torch.ones(11), "a")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gives_all_nan_and_keeps_residual(bad):
    c = comp()
    c.compress(torch.randn(100), "g")
    before = c.memory.residuals["g"].clone()
    x = torch.randn(100)
    x[17] = bad
    payload, ctx = c.compress(x, "g")
    header, _ = c.read_header(payload)
    assert header.nonfinite and header.body_len == 0
    out = c.decompress(payload, ctx)
    assert out.shape == x.shape and torch.isnan(out).all()
    assert torch.equal(c.memory.residuals["g"], before)
    acc = torch.zeros(100)
    assert torch.isnan(comp().decode(payload, out=acc, accumulate=True)).all()


def test_scale_overflow_is_treated_as_nonfinite():
    x = torch.tensor([3.0e38, 1.0])  # finite, but 1.9 * 3e38 overflows float32
    payload, ctx = comp(1.9).compress(x, "big")
    assert comp(1.9).read_header(payload)[0].nonfinite
    assert torch.isnan(comp(1.9).decompress(payload, ctx)).all()


def test_gradscaler_skips_the_step_on_nonfinite_gradient():
    """A NaN in one gradient travels as the non-finite flag: GradScaler skips the step."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    c = comp()
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
    a = comp(1.25)
    grads = [torch.randn(300) for _ in range(6)]
    for g in grads[:3]:
        a.compress(g, "p")
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = comp(1.25)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    for g in grads[3:]:
        pa, _ = a.compress(g, "p")
        pb, _ = b.compress(g, "p")
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="sparsity"):
        comp(1.5).load_state_dict(a.state_dict())


def test_decompress_checks_expectations():
    c = comp()
    payload, ctx = c.compress(torch.randn(4, 5), "x")
    _, other = c.compress(torch.randn(5, 4), "y")
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decompress(payload, other)
    assert err.value.field == "shape" and "'y'" in str(err.value)
    _, half = c.compress(torch.randn(4, 5).half(), "z")
    with pytest.raises(hvdcompress.PayloadError, match="dtype"):
        c.decompress(payload, half)
    with pytest.raises(hvdcompress.PayloadError, match="sparsity") as err:
        comp(1.5).decode(payload, rank=3, name="x")
    assert "rank 3" in str(err.value)


def test_get_compressor_lists_valid_choices():
    with pytest.raises(ValueError, match=r"3lc\(sparsity=1.0\)"):
        hvdcompress.get_compressor("4lc")
    with pytest.raises(TypeError, match="sparsity"):
        hvdcompress.get_compressor("3lc", ratio=0.1)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="float64"):
        comp().compress(torch.randn(3, dtype=torch.float64), "d")


def test_header_fields_are_validated():
    c = comp()
    payload, _ = c.compress(torch.randn(50), "h")
    cases = {
        "magic": (0, 0x00),
        "version": (4, 9),
        "codec": (5, 77),
        "flags": (6, 0x80),
        "dtype": (7, 9),
        "ndim": (8, 9),
        "reserved": (9, 1),
        "checksum": (12, 0),
    }
    for field, (offset, value) in cases.items():
        bad = payload.clone()
        bad[offset] = value if bad[offset] != value else value + 1
        with pytest.raises(hvdcompress.PayloadError) as err:
            c.decode(bad)
        assert err.value.field == field, (field, str(err.value))
    with pytest.raises(hvdcompress.PayloadError, match="truncated"):
        c.decode(payload[:20])
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decode(payload[:-1])
    assert err.value.field == "body_len"


def test_header_claiming_too_many_elements():
    c = comp()
    payload, _ = c.compress(torch.randn(50), "h")
    header, raw = c.read_header(payload)
    huge = wire.Header("3lc", 0, torch.float32, (2**40,), header.params, header.body_len)
    forged = torch.cat(
        [torch.frombuffer(bytearray(huge.pack()), dtype=torch.uint8), payload[header.size :]]
    )
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decode(forged)
    assert err.value.field == "numel"


@pytest.mark.parametrize(
    "name,wire_dtype", [("none", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_cast_compressors_are_summable(name, wire_dtype):
    c = hvdcompress.get_compressor(name)
    assert c.summable
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    pa, ctx = c.compress(a, "w")
    pb, _ = c.compress(b, "w")
    assert pa.dtype == wire_dtype and pa.dim() == 1
    total = c.decompress(pa + pb, ctx)  # what an allreduce (sum) then decompress gives
    assert total.shape == a.shape and total.dtype == a.dtype
    tol = {torch.float32: 0, torch.float16: 1e-2, torch.bfloat16: 1e-1}[wire_dtype]
    assert torch.allclose(total, a + b, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="expects 30"):
        c.decompress(pa[:-1], ctx)
    assert c.bits_per_value(pa) == 8 * pa.element_size()
