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
from tests.fuzzing import (
    check_decode,
    forged_mutation_case,
    mutations,
    random_body_case,
    raw_mutation_case,
)

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


def _side_info(case) -> dict:
    """NDQSG decodes with side information of the receiver's tensor size, as the gather
    path does; the checks also decode without it."""
    c, _, ctx = case
    return {"side_info": torch.linspace(-1, 1, _numel(ctx.shape))} if c.name == "ndqsg" else {}


def test_unmutated_payloads_decode():
    for case in PAYLOADS:
        c, payload, ctx = case
        assert check_decode(c, payload.numpy().tobytes(), ctx, **_side_info(case)) is not None


@given(st.integers(0, len(PAYLOADS) - 1), mutations)
def test_raw_mutations_never_crash_or_misshape(which, ops):
    raw_mutation_case(PAYLOADS[which], ops, **_side_info(PAYLOADS[which]))


@given(st.integers(0, len(PAYLOADS) - 1), mutations)
def test_forged_mutations_never_crash_or_misshape(which, ops):
    forged_mutation_case(PAYLOADS[which], ops, **_side_info(PAYLOADS[which]))


@given(st.integers(0, len(PAYLOADS) - 1), st.binary(max_size=200))
def test_random_bodies_never_crash(which, body):
    random_body_case(PAYLOADS[which], body, **_side_info(PAYLOADS[which]))
