"""Mutation fuzzing of real 3LC payloads: decoding either raises PayloadError (a
ValueError naming a field) or returns a tensor of exactly the expected shape and dtype.

Two families: raw mutations (caught by the header checks and the checksum), and
mutations whose checksum is recomputed afterwards, which reach the body decoder as a
forged payload would. Runs under a timeout so that a hang fails instead of stalling.
"""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import hvdcompress
from hvdcompress import wire


def _payloads():
    torch.manual_seed(0)
    made = []
    specs = [
        ((), torch.float32, 1.0),
        ((1,), torch.float32, 1.0),
        ((7,), torch.float16, 1.2),
        ((0,), torch.float32, 1.0),
        ((13, 11), torch.bfloat16, 1.9),
        ((4000,), torch.float32, 1.75),
        ((3, 3, 3), torch.float32, 1.0),
    ]
    for shape, dtype, s in specs:
        c = hvdcompress.get_compressor("3lc", sparsity=s)
        x = torch.randn(shape)
        if x.numel() > 100:
            x[100:3000] = 0  # long zero runs -> run bytes in the body
        made.append((c, *c.compress(x.to(dtype), "fuzz")))
    c = hvdcompress.get_compressor("3lc")
    made.append((c, *c.compress(torch.tensor([1.0, float("nan")]), "nan")))
    return made


PAYLOADS = _payloads()


def _fix_checksum(buf: bytearray) -> bytearray:
    """Recompute the checksum of a (possibly mutated) payload, if its header parses."""
    try:
        header = wire.parse_header(bytes(buf[: wire.MAX_HEADER]), len(buf))
    except wire.PayloadError:
        return buf
    del header
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = b"\0\0\0\0"
    csum = wire.checksum_numpy(np.frombuffer(bytes(buf), dtype=np.uint8), 0)
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = csum.to_bytes(4, "little")
    return buf


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=40), st.just(0)),
    st.tuples(st.just("run"), st.integers(0, 10**6), st.integers(243, 255)),
)


def _mutate(buf: bytearray, ops) -> bytearray:
    for kind, a, b in ops:
        if kind == "extend":
            buf += a
        elif not buf:
            continue
        elif kind == "flip":
            buf[a % len(buf)] ^= 1 << b
        elif kind in ("set", "run"):
            buf[a % len(buf)] = b
        elif kind == "truncate":
            del buf[a % len(buf) :]
    return buf


def _check_decode(c, payload_bytes, ctx):
    payload = (
        torch.frombuffer(bytearray(payload_bytes), dtype=torch.uint8)
        if payload_bytes
        else torch.empty(0, dtype=torch.uint8)
    )
    for call in (lambda: c.decompress(payload, ctx), lambda: c.decode(payload)):
        try:
            out = call()
        except hvdcompress.PayloadError as err:
            assert isinstance(err, ValueError) and err.field
            continue
        assert out.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert out.numel() <= 70 * max(len(payload_bytes), 1)
    try:
        out = c.decompress(payload, ctx)
    except hvdcompress.PayloadError:
        return None
    assert out.shape == torch.Size(ctx.shape) and out.dtype == ctx.dtype
    return out


@given(st.integers(0, len(PAYLOADS) - 1), st.lists(mutation, min_size=1, max_size=4))
def test_raw_mutations_never_crash_or_misshape(which, ops):
    c, payload, ctx = PAYLOADS[which]
    original = payload.numpy().tobytes()
    mutated = bytes(_mutate(bytearray(original), ops))
    out = _check_decode(c, mutated, ctx)
    if mutated != original:
        # Without a recomputed checksum every change to the bytes is caught.
        assert out is None


@given(st.integers(0, len(PAYLOADS) - 1), st.lists(mutation, min_size=1, max_size=4))
def test_forged_mutations_never_crash_or_misshape(which, ops):
    c, payload, ctx = PAYLOADS[which]
    mutated = bytes(_fix_checksum(_mutate(bytearray(payload.numpy().tobytes()), ops)))
    _check_decode(c, mutated, ctx)


@given(st.binary(max_size=200))
def test_random_bytes_are_rejected(data):
    c, _, ctx = PAYLOADS[0]
    assert _check_decode(c, data, ctx) is None or data[:4] == wire.MAGIC
