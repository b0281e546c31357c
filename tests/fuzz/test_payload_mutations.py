"""Mutation fuzzing of every gather-only compressor's payloads: decoding either raises
PayloadError (a ValueError naming a field) or returns a tensor of exactly the expected
shape and dtype (the checks are in tests/fuzz/harness.py).

Four families of inputs: raw mutations (all caught by the header checks and the
checksum), mutations whose checksum is recomputed afterwards (they reach the body
decoders, as a forged payload would), a valid header with a random body, and random
bytes. Each test runs once per registered gather-only compressor, over its payloads:
every example configuration it declares (``examples``, hvdcompress.registry) at every
shape and dtype of SHAPES, plus a tensor with a NaN. A newly registered compressor is
fuzzed without an edit here.
Payloads of compressors that decode with side information (NDQSG) are decoded with side
information of the receiver's tensor size, as the optimizer's gather path does, and
without.
"""

import math

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from hvdcompress import registry, wire
from tests.fuzz.harness import (
    check_decode,
    forged_mutation_case,
    mutations,
    random_body_case,
    raw_mutation_case,
)
from tests.helpers import bound


def fuzz_configs() -> list[tuple[str, dict, int]]:
    """Every fuzzed configuration, from the registry: (compressor name, params, sender
    rank) for every example of every gather-only compressor. The sender is bound to that
    rank of 2 and a fresh receiver to rank 0, as the optimizer binds them; compressors
    that decode with side information (NDQSG) send from both ranks (rank 0 sends DQSG,
    rank 1 the nested code)."""
    configs = []
    for name, params in registry.examples():
        cls = registry.REGISTRY[name]
        if not cls.summable:
            configs += [(name, params, r) for r in ((0, 1) if cls.uses_side_info else (0,))]
    return configs


CONFIGS = fuzz_configs()
SHAPES = [
    ((), torch.float32),
    ((0,), torch.float32),
    ((1,), torch.float32),
    ((7,), torch.float16),
    ((13, 11), torch.bfloat16),
    ((3, 3, 3), torch.float32),
    ((1500,), torch.float32),
    ((4000,), torch.float32),
]
NAMES = list(dict.fromkeys(name for name, _, _ in CONFIGS))


def _make(name: str, params: dict, rank: int):
    return bound(name, rank, 2, **params)


def _input(shape, dtype) -> torch.Tensor:
    x = torch.randn(shape)
    if x.numel() > 100:  # a long zero run: run bytes in quartic and zero-run bodies
        x[100 : min(x.numel() - 500, 3000)] = 0
    return x.to(dtype)


def _payloads() -> tuple[dict[str, list], dict[str, list[str]]]:
    """name -> [(receiver, payload, ctx)], and name -> a description of each."""
    torch.manual_seed(0)
    cases: dict[str, list] = {name: [] for name in NAMES}
    described: dict[str, list[str]] = {name: [] for name in NAMES}
    for name, params, rank in CONFIGS:
        inputs = [(_input(shape, dtype), "fuzz") for shape, dtype in SHAPES]
        inputs.append((torch.tensor([1.0, float("nan")]), "nan"))
        for x, tensor_name in inputs:
            sender = _make(name, params, rank)
            payload, ctx = sender.compress(x, tensor_name)
            receiver = _make(name, params, 0)
            cases[name].append((receiver, payload, ctx))
            described[name].append(
                f"{name} {params} rank {rank}: {tuple(x.shape)} {x.dtype} {tensor_name}"
            )
    return cases, described


PAYLOADS, DESCRIBED = _payloads()


def _side_info(case) -> dict:
    """Side information of the receiver's tensor size for decoders that take it (NDQSG),
    as the gather path passes it; the checks also decode without it."""
    c, _, ctx = case
    if not c.uses_side_info:
        return {}
    return {"side_info": torch.linspace(-1, 1, math.prod(ctx.shape))}


# Each test runs once per compressor: a quarter of the profile's examples each keeps the
# whole fuzz run near the CI budget (3000 examples per test in the ci profile).
PER_CODEC = settings(max_examples=max(settings.default.max_examples // 4, 10))


def _draw(data, name: str):
    i = data.draw(st.integers(0, len(PAYLOADS[name]) - 1), label="payload")
    note(DESCRIBED[name][i])
    return PAYLOADS[name][i]


@pytest.mark.parametrize("name", NAMES)
def test_unmutated_payloads_decode(name):
    for case in PAYLOADS[name]:
        c, payload, ctx = case
        assert check_decode(c, payload.numpy().tobytes(), ctx, **_side_info(case)) is not None


@pytest.mark.parametrize("name", NAMES)
@PER_CODEC
@given(data=st.data(), ops=mutations)
def test_raw_mutations_never_crash_or_misshape(name, data, ops):
    case = _draw(data, name)
    raw_mutation_case(case, ops, **_side_info(case))


@pytest.mark.parametrize("name", NAMES)
@PER_CODEC
@given(data=st.data(), ops=mutations)
def test_forged_mutations_never_crash_or_misshape(name, data, ops):
    case = _draw(data, name)
    forged_mutation_case(case, ops, **_side_info(case))


@pytest.mark.parametrize("name", NAMES)
@PER_CODEC
@given(data=st.data(), body=st.binary(max_size=200))
def test_random_bodies_never_crash(name, data, body):
    case = _draw(data, name)
    random_body_case(case, body, **_side_info(case))


@pytest.mark.parametrize("name", NAMES)
@PER_CODEC
@given(data=st.binary(max_size=200))
def test_random_bytes_are_rejected(name, data):
    case = PAYLOADS[name][0]
    c, _, ctx = case
    assert check_decode(c, data, ctx, **_side_info(case)) is None or data[:4] == wire.MAGIC
