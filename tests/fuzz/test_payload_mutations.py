"""Mutation fuzzing of every gather-only compressor's payloads: decoding either raises
PayloadError (a ValueError naming a field) or returns a tensor of exactly the expected
shape and dtype, unchanged bytes decode to exactly the original tensor, and no decode
allocates more than the receiver's bound allows (the checks and the allocation meter
are in tests/fuzz/harness.py; docs/wire-format.md, "Validation and errors").

Five families of inputs: raw mutations (all caught by the header checks and the
checksum), mutations whose checksum is recomputed afterwards (they reach the body
decoders, as a forged payload would), overwrites of the header's fields (numel, ndim,
shape, body_len, params_len, codec id, dtype, version, flags; a consistent resize of one
dimension; the non-finite flag with the body dropped), each with and without a
recomputed checksum, a valid header with a random body, and random bytes. Each test runs
once per registered gather-only compressor, over its payloads: every example
configuration it declares (``examples``, hvdcompress.compressors.registry) at every shape and dtype
of harness.SHAPES, plus a tensor with a NaN. A newly registered compressor is fuzzed
without an edit here. Payloads of compressors that decode with side information (NDQSG)
are decoded with side information of the receiver's tensor size, as the optimizer's
gather path does, and without.

The long run of the same checks is scripts/fuzz_payloads.py.
"""

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from hvdcompress import wire
from tests.fuzz.harness import (
    build_cases,
    check_decode,
    field_mutations,
    forged_mutation_case,
    mutations,
    random_body_case,
    raw_mutation_case,
    side_kwargs,
)

PAYLOADS, DESCRIBED = build_cases()
NAMES = list(PAYLOADS)


def _budget(share: int) -> settings:
    """``1 / share`` of the profile's examples per compressor: the shares below add up to
    about one profile's worth per compressor, which keeps the whole fuzz directory near
    a minute in the ci profile (3000 examples per compressor)."""
    return settings(max_examples=max(settings.default.max_examples // share, 10))


def _draw(data, name: str):
    i = data.draw(st.integers(0, len(PAYLOADS[name]) - 1), label="payload")
    note(DESCRIBED[name][i])
    return PAYLOADS[name][i]


@pytest.mark.parametrize("name", NAMES)
def test_unmutated_payloads_decode(name):
    for case in PAYLOADS[name]:
        c, payload, ctx, original = case
        out = check_decode(c, payload.numpy().tobytes(), ctx, original, **side_kwargs(case))
        assert out.kind == "exact"


@pytest.mark.parametrize("name", NAMES)
@_budget(6)
@given(data=st.data(), ops=mutations)
def test_raw_mutations_never_crash_or_misshape(name, data, ops):
    case = _draw(data, name)
    raw_mutation_case(case, ops, **side_kwargs(case))


@pytest.mark.parametrize("name", NAMES)
@_budget(4)
@given(data=st.data(), ops=mutations)
def test_forged_mutations_never_crash_or_misshape(name, data, ops):
    case = _draw(data, name)
    forged_mutation_case(case, ops, **side_kwargs(case))


@pytest.mark.parametrize("name", NAMES)
@_budget(4)
@given(data=st.data(), ops=field_mutations, forge=st.booleans())
def test_field_overwrites_stay_within_the_receivers_bound(name, data, ops, forge):
    """Overwritten numel / ndim / shape / body_len / params_len / codec / dtype / version /
    flags, consistent resizes and non-finite forgeries: a clean PayloadError or a decode
    of the expected shape, never an allocation past the receiver's bound."""
    case = _draw(data, name)
    note(f"ops {ops} forged {forge}")
    if forge:
        forged_mutation_case(case, ops, **side_kwargs(case))
    else:
        raw_mutation_case(case, ops, **side_kwargs(case))


@pytest.mark.parametrize("name", NAMES)
@_budget(10)
@given(data=st.data(), body=st.binary(max_size=200))
def test_random_bodies_never_crash(name, data, body):
    case = _draw(data, name)
    random_body_case(case, body, **side_kwargs(case))


@pytest.mark.parametrize("name", NAMES)
@_budget(20)
@given(data=st.binary(max_size=200))
def test_random_bytes_are_rejected(name, data):
    case = PAYLOADS[name][0]
    c, _, ctx, _ = case
    out = check_decode(c, data, ctx, **side_kwargs(case))
    assert out.kind == "error" or data[:4] == wire.MAGIC
