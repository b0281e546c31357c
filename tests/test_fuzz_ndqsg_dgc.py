"""Mutation fuzzing of the NDQSG and DGC payloads, like tests/test_fuzz_baselines.py:
decoding either raises PayloadError (a ValueError naming a field) or returns a tensor of
exactly the expected shape and dtype; raw mutations are all caught, forged ones (checksum
recomputed) reach the body decoders. NDQSG payloads are decoded with side information of
the receiver's tensor size, as the optimizer's gather path does, and without.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import hvdcompress
from tests.test_fuzz import _fix_checksum, _mutate, mutation

# (name, params, sender rank of 2)
CONFIGS = [
    ("ndqsg", {"bucket_size": 64}, 0),
    ("ndqsg", {"bucket_size": 64}, 1),
    ("ndqsg", {"fine_levels": 8, "coarse_levels": 2}, 1),
    ("ndqsg", {"fine_levels": 6, "coarse_levels": 1}, 1),
    ("dgc", {"ratio": 0.05}, 0),
    ("dgc", {"ratio": 0.01, "warmup_steps": 5, "warmup_stages": 2}, 0),
]
SHAPES = [
    ((), torch.float32),
    ((7,), torch.float16),
    ((13, 11), torch.bfloat16),
    ((1500,), torch.float32),
]


def _make(name, kw, rank):
    c = hvdcompress.get_compressor(name, **kw)
    c.bind(rank, 2)
    return c


def _payloads():
    torch.manual_seed(0)
    made = []
    for name, kw, rank in CONFIGS:
        for shape, dtype in SHAPES:
            c = _make(name, kw, rank)
            x = torch.randn(shape)
            if x.numel() > 100:
                x[100:1000] = 0  # zero runs: run bytes in quartic bodies
            payload, ctx = c.compress(x.to(dtype), "fuzz")
            made.append((_make(name, kw, 0), payload, ctx))
        c = _make(name, kw, rank)
        payload, ctx = c.compress(torch.tensor([1.0, float("nan")]), "nan")
        made.append((_make(name, kw, 0), payload, ctx))
    return made


PAYLOADS = _payloads()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_decode(c, payload_bytes, ctx):
    payload = (
        torch.frombuffer(bytearray(payload_bytes), dtype=torch.uint8)
        if payload_bytes
        else torch.empty(0, dtype=torch.uint8)
    )
    extra = {}
    if c.name == "ndqsg":
        extra = {"side_info": torch.linspace(-1, 1, _numel(ctx.shape))}
    calls = [
        lambda: c.decode(payload, expect=ctx, **extra),
        lambda: c.decode(payload, **extra),
        lambda: c.decode(payload),
    ]
    for call in calls:
        try:
            out = call()
        except hvdcompress.PayloadError as err:
            assert isinstance(err, ValueError) and err.field
            continue
        assert out.dtype in (torch.float32, torch.float16, torch.bfloat16)
        assert out.numel() <= max(c._max_numel(len(payload_bytes)), 1)
    try:
        out = c.decode(payload, expect=ctx, **extra)
    except hvdcompress.PayloadError:
        return None
    assert out.shape == torch.Size(ctx.shape) and out.dtype == ctx.dtype
    return out


def test_unmutated_payloads_decode():
    for c, payload, ctx in PAYLOADS:
        assert _check_decode(c, payload.numpy().tobytes(), ctx) is not None


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
