"""Mutation fuzzing of the baselines' payloads (topk, randomk, qsgd, terngrad, signsgd,
efsignsgd, dqsg), like tests/test_fuzz.py for 3LC: decoding either raises PayloadError (a
ValueError naming a field) or returns a tensor of exactly the expected shape and dtype;
raw mutations are all caught, forged ones (checksum recomputed) reach the body decoders.
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import hvdcompress
from tests.fuzzing import forged_mutation_case, mutations, random_body_case, raw_mutation_case

CONFIGS = [
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.1}),
    ("randomk", {"ratio": 0.5, "unbiased": False, "error_feedback": True}),
    ("topkq", {"ratio": 0.05}),
    ("gspar", {"ratio": 0.1}),
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


@given(st.integers(0, len(PAYLOADS) - 1), mutations)
def test_raw_mutations_never_crash_or_misshape(which, ops):
    raw_mutation_case(PAYLOADS[which], ops)


@given(st.integers(0, len(PAYLOADS) - 1), mutations)
def test_forged_mutations_never_crash_or_misshape(which, ops):
    forged_mutation_case(PAYLOADS[which], ops)


@given(st.integers(0, len(PAYLOADS) - 1), st.binary(max_size=200))
def test_random_bodies_never_crash(which, body):
    random_body_case(PAYLOADS[which], body)
