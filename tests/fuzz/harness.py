"""Mutation-fuzzing checks for every decoder (tests/fuzz/test_payload_mutations.py,
test_frame_mutations.py; fix_checksum also forges payloads in other tests): the hypothesis
strategies of the mutations, and the payloads, mutations, allocation meter and checks of
scripts/_bench/payloads.py, which the long run scripts/fuzz_payloads.py shares (its module
docstring describes them).
"""

from hypothesis import strategies as st

from scripts._bench.payloads import (  # the checks the tests use, from here
    EDGES,
    FIELDS,
    SHAPES,
    build_cases,
    check_decode,
    fix_checksum,
    forged_mutation_case,
    mutate,
    random_body_case,
    raw_mutation_case,
    side_kwargs,
)

__all__ = [
    "FIELDS", "SHAPES", "build_cases", "check_decode", "field_mutations", "fix_checksum",
    "forged_mutation_case", "mutate", "mutations", "random_body_case", "raw_mutation_case",
    "side_kwargs",
]  # fmt: skip

value = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**64 - 1), st.integers(0, 600))
mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=40), st.just(0)),
    st.tuples(st.just("run"), st.integers(0, 10**6), st.integers(243, 255)),
)
field_mutation = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(sorted(FIELDS)), value),
    st.tuples(st.just("resize"), value, st.integers(0, 7)),
    st.tuples(st.just("nonfinite"), st.just(0), st.just(0)),
)
mutations = st.lists(mutation, min_size=1, max_size=4)
field_mutations = st.lists(st.one_of(field_mutation, mutation), min_size=1, max_size=3)
