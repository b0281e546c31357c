"""Mutation-fuzzing checks for every decoder (tests/fuzz/test_payload_mutations.py;
fix_checksum also forges payloads in other tests).

The invariant: decoding a payload either raises PayloadError (a ValueError naming a
field) or returns a tensor of exactly the expected shape and dtype, never more elements
than the body can describe. Raw mutations are all caught (header checks + checksum);
forged ones (checksum recomputed) reach the body decoders.
"""

import numpy as np
import torch
from hypothesis import strategies as st

import hvdcompress
from hvdcompress import wire

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=40), st.just(0)),
    st.tuples(st.just("run"), st.integers(0, 10**6), st.integers(243, 255)),
)
mutations = st.lists(mutation, min_size=1, max_size=4)


def mutate(buf: bytearray, ops) -> bytearray:
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


def fix_checksum(buf: bytearray) -> bytearray:
    """Recompute the checksum of a (possibly mutated) payload, if its header parses."""
    try:
        wire.parse_header(bytes(buf[: wire.MAX_HEADER]), len(buf))
    except wire.PayloadError:
        return buf
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = b"\0\0\0\0"
    csum = wire.checksum_numpy(np.frombuffer(bytes(buf), dtype=np.uint8), 0)
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = csum.to_bytes(4, "little")
    return buf


def check_decode(c, payload_bytes: bytes, ctx, **decode_kwargs):
    """Decode with and without the receiver's expectations; the decoded tensor or None."""
    payload = (
        torch.frombuffer(bytearray(payload_bytes), dtype=torch.uint8)
        if payload_bytes
        else torch.empty(0, dtype=torch.uint8)
    )
    calls = [
        lambda: c.decode(payload, expect=ctx, **decode_kwargs),
        lambda: c.decode(payload, **decode_kwargs),
    ]
    if decode_kwargs:
        calls.append(lambda: c.decode(payload))
    for call in calls:
        try:
            out = call()
        except hvdcompress.PayloadError as err:
            assert isinstance(err, ValueError) and err.field
            continue
        assert out.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert out.numel() <= max(c.max_numel(len(payload_bytes), None), 1)
    try:
        out = c.decode(payload, expect=ctx, **decode_kwargs)
    except hvdcompress.PayloadError:
        return None
    assert out.shape == torch.Size(ctx.shape) and out.dtype == ctx.dtype
    return out


def raw_mutation_case(case, ops, **decode_kwargs) -> None:
    """Without a recomputed checksum every change to the bytes is caught."""
    c, payload, ctx = case
    original = payload.numpy().tobytes()
    mutated = bytes(mutate(bytearray(original), ops))
    out = check_decode(c, mutated, ctx, **decode_kwargs)
    if mutated != original:
        assert out is None


def forged_mutation_case(case, ops, **decode_kwargs) -> None:
    c, payload, ctx = case
    mutated = bytes(fix_checksum(mutate(bytearray(payload.numpy().tobytes()), ops)))
    check_decode(c, mutated, ctx, **decode_kwargs)


def random_body_case(case, body: bytes, **decode_kwargs) -> None:
    """A valid header with an arbitrary body (checksum fixed) reaches the body decoder."""
    c, payload, ctx = case
    header, _ = c.read_header(payload)
    raw = bytearray(payload.numpy().tobytes()[: header.size]) + body
    raw[24:32] = len(body).to_bytes(8, "little")  # body_len
    check_decode(c, bytes(fix_checksum(raw)), ctx, **decode_kwargs)
