"""Differential fuzzing of the one-call receive path: ``decode_frame`` (one native scan of
a rank's frame, array checks, a batched body decoder; kernels/frame.c) against the
per-payload path it stands for, ``decode_bucket`` of ``wire.unframe_parsed``, for every
registered gather-only compressor (docs/wire-format.md, "Bucket frame").

For a frame with one payload mutated (the harness's byte and field mutations, with and
without a recomputed checksum), or the frame itself mutated (its length table), both
paths must agree: the same exception (type, field, rank, tensor and message), or none,
and bit for bit the same accumulators either way. So a frame the scan accepts is one the
per-payload checks accept, and one it refuses gets their error."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdcompress import wire
from hvdcompress.compressors import registry
from tests.fuzz.harness import field_mutations, fix_checksum, mutate, mutations
from tests.helpers import bound

# (compressor, params, the sender's rank of 2). Rank 1 decodes with the side information of
# the ranks before it where the compressor has any (NDQSG: the per-payload path only); rank
# 0's frame gets none, so NDQSG's takes the one-call path too.
CASES = [(n, p, 1) for n, p in registry.examples() if not registry.REGISTRY[n].summable] + [
    (n, p, 0)
    for n, p in registry.examples()
    if not registry.REGISTRY[n].summable and registry.REGISTRY[n].uses_side_info
]
SIZES = [(0,), (1,), (7,), (33, 17), (100,), (513,)]
NAMES = [f"layer{i}" for i in range(len(SIZES))]


def _frame(name: str, params: dict, sender: int):
    """A sender's frame of a mixed bucket (one tensor non-finite) and its contexts."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen) for shape in SIZES]
    tensors[4][3] = float("inf")
    return bound(name, sender, 2, **params).compress_bucket(tensors, NAMES)


FRAMES = {i: _frame(*case) for i, case in enumerate(CASES)}


def _run(decode):
    outs = [torch.linspace(-1, 1, torch.Size(s).numel()) for s in SIZES]
    try:
        decode(outs)
    except Exception as err:  # noqa: BLE001 - compared below, whatever it is
        return outs, (type(err), str(err), getattr(err, "field", None))
    return outs, None


def _agree(case: int, frame: torch.Tensor) -> None:
    name, params, sender = CASES[case]
    _, ctxs = FRAMES[case]
    ref, fast = bound(name, 1 - sender, 2, **params), bound(name, 1 - sender, 2, **params)
    want_outs, want = _run(
        lambda outs: ref.decode_bucket(
            wire.unframe_parsed(frame, sender, NAMES, torch.device("cpu")),
            outs,
            ctxs,
            rank=sender,
        )
    )
    got_outs, got = _run(lambda outs: fast.decode_frame(frame, outs, ctxs, rank=sender))
    assert got == want, f"per-payload: {want}; one call: {got}"
    for a, b in zip(got_outs, want_outs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def _remade(case: int, index: int, ops, forge: bool) -> torch.Tensor:
    frame, _ = FRAMES[case]
    payloads = wire.unframe(frame, len(NAMES), CASES[case][2], NAMES)
    buf = mutate(bytearray(payloads[index].numpy().tobytes()), ops)
    if forge:
        buf = fix_checksum(buf)
    payloads[index] = torch.frombuffer(bytearray(buf) or bytearray(1), dtype=torch.uint8)[
        : len(buf)
    ]
    return wire.frame(payloads)


CASE_IDS = [f"{n}{p}-rank{r}" for n, p, r in CASES]
budget = settings(max_examples=max(settings.default.max_examples // 30, 10))


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
def test_unmutated_frames_decode_the_same(case):
    _agree(case, FRAMES[case][0])


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@budget
@given(index=st.integers(0, len(SIZES) - 1), ops=mutations, forge=st.booleans())
def test_byte_mutations_decode_the_same(case, index, ops, forge):
    _agree(case, _remade(case, index, ops, forge))


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@budget
@given(index=st.integers(0, len(SIZES) - 1), ops=field_mutations, forge=st.booleans())
def test_header_field_mutations_decode_the_same(case, index, ops, forge):
    _agree(case, _remade(case, index, ops, forge))


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASE_IDS)
@budget
@given(ops=mutations)
def test_frame_mutations_decode_the_same(case, ops):
    """Mutations anywhere in the frame, its length table included."""
    buf = mutate(bytearray(FRAMES[case][0].numpy().tobytes()), ops)
    _agree(case, torch.frombuffer(bytearray(buf) or bytearray(1), dtype=torch.uint8)[: len(buf)])
