"""The public decode into a new tensor (``decode`` / ``decompress`` without ``out``) at the
bucket path's cost (issue 31, item 4): it gives the bits of the written decode into an
output and the values of the bucket path's ``decode_frame``, for every configuration of
every gather-only compressor; its non-finite check (``checked_cast``) answers exactly as
``torch.isfinite`` did and raises the same ``DecodeOverflowError``: known from the
codec's bound on the decoded values (``decoded_bound``) where that fits the dtype, else
one read of the decoded tensor by the backend's ``nonfinite``."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hvdcompress import framing, wire
from hvdcompress.backends import cpu
from hvdcompress.errors import DecodeOverflowError, PayloadError
from tests.helpers import comp
from tests.test_compressor_api import CONFIGS, IDS


def _gradient(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N(0, 1) values with exact zeros and negative zeros among them."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).reshape(-1)
    x[::11] = 0.0
    x[5::13] = -0.0
    return x.reshape(shape).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name,kw", CONFIGS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(0,), (1,), (1001,), (37, 29)])
def test_public_decode_is_the_written_decode_and_the_bucket_decode(name, kw, dtype, shape):
    # two compressors of one configuration: their states move alike, step by step
    public, bucket = comp(name, **kw), comp(name, **kw)
    n = int(np.prod(shape))
    for step in range(3):  # error feedback, step counters and levels move
        x = _gradient(shape, dtype, seed=step)
        payload, ctx = public.compress(x, "w")
        frame, ctxs = framing.compress_bucket(bucket, [x], ["w"])
        assert _bits(wire.frame([payload])) == _bits(frame)
        new = public.decode(payload, expect=ctx)
        assert new.shape == x.shape and new.dtype == dtype
        written = torch.full((n,), 7.0)  # the written decode into an output
        public.decode(payload, expect=ctx, out=written)
        assert _bits(new) == _bits(written.to(dtype).reshape(shape))
        header = wire.parse(payload)  # the bound that lets checked_cast skip its read
        bound = public.decoded_bound(header, payload[header.size :])
        if bound is not None and n and not header.nonfinite:
            assert float(written.abs().max()) <= bound
        acc = torch.zeros(n)  # the gather path's accumulator of this rank's frame
        framing.decode_frame(bucket, frame, [acc], ctxs, rank=0)
        # value for value (+0.0 == -0.0), in the payload's dtype as the exchange casts
        assert torch.equal(new.reshape(-1), acc.to(dtype))


def _specials32() -> torch.Tensor:
    bits = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF]
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


@pytest.mark.parametrize("n", [1, 7, 4095, 4096, 4097, 10_000])
def test_nonfinite_check_answers_as_isfinite_for_float32(n):
    x = _gradient((n,), torch.float32, seed=n)
    x[0] = torch.finfo(torch.float32).max
    x[-1] = -torch.finfo(torch.float32).tiny / 4  # a subnormal
    assert cpu.nonfinite(x) is False
    for at in sorted({0, n // 2, 4095 % n, 4096 % n, n - 1}):
        for bad in _specials32():
            y = x.clone()
            y[at] = bad
            assert cpu.nonfinite(y) is True == (not bool(torch.isfinite(y).all()))
    assert cpu.nonfinite(x[:0]) is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nonfinite_check_answers_as_isfinite_for_every_16_bit_pattern(dtype):
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    want = ~torch.isfinite(patterns)
    got = torch.tensor([cpu.nonfinite(patterns[i : i + 1]) for i in range(patterns.numel())])
    assert torch.equal(got, want)
    finite = patterns[~want]
    assert cpu.nonfinite(finite) is False
    assert cpu.nonfinite(torch.cat([finite, patterns[want][:1]])) is True


def test_public_decode_reports_a_float32_overflow_as_before():
    # unbiased random-k scales each kept value by 1/p at the receiver: 3e38 * 5 overflows
    # float32 although the payload (finite values, flag clear) is valid
    c = comp("randomk", ratio=0.2, unbiased=True, error_feedback=False)
    payload, ctx = c.compress(torch.full((1000,), 3e38), "w")
    assert not wire.read_header(payload)[0].nonfinite
    with pytest.raises(DecodeOverflowError, match="the float32 decode gives non-finite") as err:
        c.decode(payload, expect=ctx)
    assert isinstance(err.value, PayloadError) and err.value.field == "overflow"
    assert "'w'" in str(err.value)
    acc = torch.zeros(1000)  # an accumulator holds what the float32 decode gives
    c.decode(payload, expect=ctx, out=acc)
    assert bool(torch.isinf(acc).any())


@pytest.mark.parametrize("name", ["efsignsgd", "qsgd", "3lc", "topk"])
def test_public_decode_reports_a_cast_overflow_as_before(name):
    # (signSGD sends +-1 and TernGrad's scale is max |x|: neither passes float16's range)
    top = torch.finfo(torch.float16).max
    x = torch.tensor([top, -top, top, 1.0, -0.5, 0.0, top / 2, -top] * 8, dtype=torch.float16)
    c = comp(name, sparsity=1.75) if name == "3lc" else comp(name)
    for _ in range(4):  # until a payload's float32 values pass float16's range
        payload, ctx = c.compress(x, "w")
        flat = torch.empty(x.numel())
        c.decode(payload, expect=ctx, out=flat)
        if not bool(torch.isfinite(flat.half()).all()):
            break
    else:
        pytest.fail(f"{name} sent no value past float16's range")
    with pytest.raises(DecodeOverflowError, match="the cast to torch.float16 gives non-finite"):
        c.decode(payload, expect=ctx)


HUGE = 2 << 20


def _advice(monkeypatch):
    calls = []
    monkeypatch.setattr(
        framing, "_MADVISE", lambda addr, length, advice: calls.append((addr, length, advice))
    )
    return calls


@pytest.mark.parametrize("fill", [None, 0.0, -1.5])
def test_a_large_new_output_is_advised_as_huge_pages_on_whole_pages_inside_it(monkeypatch, fill):
    calls = _advice(monkeypatch)
    n = 3 * HUGE // 4 + 17  # 3 MiB and a bit: at least one whole 2 MiB page inside
    flat = framing.new_float32(n, torch.device("cpu"), fill)
    assert flat.dtype == torch.float32 and flat.shape == (n,) and flat.is_contiguous()
    if fill is not None:
        assert torch.equal(flat, torch.full((n,), fill))
    begin, end = flat.data_ptr(), flat.data_ptr() + 4 * n
    ((addr, length, advice),) = calls
    assert advice == framing._MADV_HUGEPAGE
    assert addr % HUGE == 0 and length % HUGE == 0 and length > 0
    assert begin <= addr and addr + length <= end  # never advice on memory it does not own


def test_a_small_new_output_gets_no_advice(monkeypatch):
    calls = _advice(monkeypatch)
    framing.new_float32(HUGE // 4, torch.device("cpu"), 0.0)  # 2 MiB: below two pages
    assert calls == []


def test_the_public_decode_of_a_large_tensor_goes_through_the_advised_output(monkeypatch):
    calls = _advice(monkeypatch)
    for name, kw in [("signsgd", {}), ("randomk", {"ratio": 0.01})]:
        sender, receiver = comp(name, **kw), comp(name, **kw)
        x = _gradient((HUGE // 2,), torch.float32, 3)  # 4 MiB of float32
        payload, ctx = sender.compress(x, "w")
        got = receiver.decode(payload, expect=ctx)
        out = torch.zeros_like(x)
        receiver.decode(payload, expect=ctx, out=out)  # the written decode: no new tensor
        assert torch.equal(got, out)
    assert len(calls) == 2


def test_huge_page_advice_can_be_turned_off():
    code = "from hvdcompress import framing; print(framing._MADVISE is None)"
    env = {**os.environ, "HVDCOMPRESS_HUGE_PAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
