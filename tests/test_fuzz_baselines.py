"""Mutation fuzzing of the baselines' payloads (topk, randomk, qsgd, terngrad, signsgd,
efsignsgd, dqsg), like tests/test_fuzz.py for 3LC: decoding either raises PayloadError (a
ValueError naming a field) or returns a tensor of exactly the expected shape and dtype;
raw mutations are all caught, forged ones (checksum recomputed) reach the body decoders.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import hvdcompress
from tests.test_fuzz import _fix_checksum, _mutate, mutation

CONFIGS = [
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.1}),
    ("randomk", {"ratio": 0.5, "unbiased": False, "error_feedback": True}),
    ("qsgd", {"levels": 16, "bucket_size": 64}),
    ("qsgd", {"levels": 1}),
    ("terngrad", {}),
    ("signsgd", {}),
    ("efsignsgd", {}),
    ("dqsg", {"levels": 3, "bucket_size": 64}),
    ("dqsg", {"levels": 1, "bucket_size": 64}),
    ("dqsg", {"levels": 127}),
]
SHAPES = [
    ((), torch.float32),
    ((7,), torch.float16),
    ((13, 11), torch.bfloat16),
    ((1500,), torch.float32),
]


def _payloads():
    torch.manual_seed(0)
    made = []
    for name, kw in CONFIGS:
        for shape, dtype in SHAPES:
            c = hvdcompress.get_compressor(name, **kw)
            x = torch.randn(shape)
            if x.numel() > 100:
                x[100:1000] = 0  # zero runs: run bytes in quartic bodies
            made.append((c, *c.compress(x.to(dtype), "fuzz")))
        c = hvdcompress.get_compressor(name, **kw)
        made.append((c, *c.compress(torch.tensor([1.0, float("nan")]), "nan")))
    return made


PAYLOADS = _payloads()


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
        assert out.numel() <= max(c._max_numel(len(payload_bytes)), 1)
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
        assert out is None


@given(st.integers(0, len(PAYLOADS) - 1), st.lists(mutation, min_size=1, max_size=4))
def test_forged_mutations_never_crash_or_misshape(which, ops):
    c, payload, ctx = PAYLOADS[which]
    mutated = bytes(_fix_checksum(_mutate(bytearray(payload.numpy().tobytes()), ops)))
    _check_decode(c, mutated, ctx)


@given(st.integers(0, len(PAYLOADS) - 1), st.binary(max_size=200))
def test_random_bodies_never_crash(which, body):
    """A valid header with an arbitrary body (checksum fixed) reaches the body decoder."""
    c, payload, ctx = PAYLOADS[which]
    header, _ = c.read_header(payload)
    raw = bytearray(payload.numpy().tobytes()[: header.size]) + body
    raw[24:32] = len(body).to_bytes(8, "little")  # body_len
    _check_decode(c, bytes(_fix_checksum(raw)), ctx)
