"""Mutation fuzzing of every gather-only compressor's payloads: decoding either raises
PayloadError (a ValueError naming a field) or returns a tensor of exactly the expected
shape and dtype (the checks are in tests/fuzz/harness.py).

Four families of inputs: raw mutations (all caught by the header checks and the
checksum), mutations whose checksum is recomputed afterwards (they reach the body
decoders, as a forged payload would), a valid header with a random body, and random
bytes. Each test runs once per compressor, over that compressor's payloads: every
configuration of CONFIGS at every shape and dtype of SHAPES, plus a tensor with a NaN.
Payloads of compressors that decode with side information (NDQSG) are decoded with side
information of the receiver's tensor size, as the optimizer's gather path does, and
without.
"""

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from hvdcompress import wire
from tests.fuzz.harness import (
    check_decode,
    forged_mutation_case,
    mutations,
    random_body_case,
    raw_mutation_case,
)
from tests.helpers import bound, comp


def fuzz_configs() -> list[tuple[str, dict, int | None]]:
    """Every fuzzed configuration: (compressor name, params, sender rank). A sender rank
    binds the sender to that rank of 2 and the receiver to rank 0 (NDQSG's mode and DGC's
    clipping depend on it); None leaves the compressor unbound, sender and receiver one."""
    return [
        ("3lc", {"sparsity": 1.0}, None),
        ("3lc", {"sparsity": 1.2}, None),
        ("3lc", {"sparsity": 1.75}, None),
        ("3lc", {"sparsity": 1.9}, None),
        ("topk", {"ratio": 0.05}, None),
        ("randomk", {"ratio": 0.1}, None),
        ("randomk", {"ratio": 0.5, "unbiased": False, "error_feedback": True}, None),
        ("topkq", {"ratio": 0.05}, None),
        ("gspar", {"ratio": 0.1}, None),
        ("qsgd", {"levels": 16, "bucket_size": 64}, None),
        ("qsgd", {"levels": 1}, None),
        ("terngrad", {}, None),
        ("signsgd", {}, None),
        ("efsignsgd", {}, None),
        ("dqsg", {"levels": 3, "bucket_size": 64}, None),
        ("dqsg", {"levels": 1, "bucket_size": 64}, None),
        ("dqsg", {"levels": 127}, None),
        ("ndqsg", {"bucket_size": 64}, 0),
        ("ndqsg", {"bucket_size": 64}, 1),
        ("ndqsg", {"fine_levels": 8, "coarse_levels": 2}, 1),
        ("ndqsg", {"fine_levels": 6, "coarse_levels": 1}, 1),
        ("dgc", {"ratio": 0.05}, 0),
        ("dgc", {"ratio": 0.01, "warmup_steps": 5, "warmup_stages": 2}, 0),
    ]


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


def _make(name: str, params: dict, rank: int | None):
    return comp(name, **params) if rank is None else bound(name, rank, 2, **params)


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
            receiver = sender if rank is None else _make(name, params, 0)
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
    if not getattr(c, "uses_side_info", False):
        return {}
    return {"side_info": torch.linspace(-1, 1, math.prod(ctx.shape))}


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
@given(data=st.data(), ops=mutations)
def test_raw_mutations_never_crash_or_misshape(name, data, ops):
    case = _draw(data, name)
    raw_mutation_case(case, ops, **_side_info(case))


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data(), ops=mutations)
def test_forged_mutations_never_crash_or_misshape(name, data, ops):
    case = _draw(data, name)
    forged_mutation_case(case, ops, **_side_info(case))


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data(), body=st.binary(max_size=200))
def test_random_bodies_never_crash(name, data, body):
    case = _draw(data, name)
    random_body_case(case, body, **_side_info(case))


@pytest.mark.parametrize("name", NAMES)
@given(data=st.binary(max_size=200))
def test_random_bytes_are_rejected(name, data):
    case = PAYLOADS[name][0]
    c, _, ctx = case
    assert check_decode(c, data, ctx, **_side_info(case)) is None or data[:4] == wire.MAGIC
