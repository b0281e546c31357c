"""Mutation fuzzing of real 3LC payloads: decoding either raises PayloadError (a
ValueError naming a field) or returns a tensor of exactly the expected shape and dtype.

Two families: raw mutations (caught by the header checks and the checksum), and
mutations whose checksum is recomputed afterwards, which reach the body decoder as a
forged payload would. The checks are shared with the other codecs' fuzz tests
(tests/fuzzing.py).
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import hvdcompress
from hvdcompress import wire
from tests.fuzzing import check_decode, forged_mutation_case, mutations, raw_mutation_case


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


@given(st.integers(0, len(PAYLOADS) - 1), mutations)
def test_raw_mutations_never_crash_or_misshape(which, ops):
    raw_mutation_case(PAYLOADS[which], ops)


@given(st.integers(0, len(PAYLOADS) - 1), mutations)
def test_forged_mutations_never_crash_or_misshape(which, ops):
    forged_mutation_case(PAYLOADS[which], ops)


@given(st.binary(max_size=200))
def test_random_bytes_are_rejected(data):
    c, _, ctx = PAYLOADS[0]
    assert check_decode(c, data, ctx) is None or data[:4] == wire.MAGIC
