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
from scripts._bench.payloads import FRAME_NAMES as NAMES
from scripts._bench.payloads import FRAME_SIZES as SIZES
from scripts._bench.payloads import bucket_frame, frame_configs, frames_agree
from tests.fuzz.harness import field_mutations, fix_checksum, mutate, mutations

# (compressor, params, the sender's rank of 2): scripts/_bench/payloads.py frame_configs
CASES = frame_configs()
FRAMES = {i: bucket_frame(*case) for i, case in enumerate(CASES)}


def _agree(case: int, frame: torch.Tensor) -> None:
    frames_agree(CASES[case], FRAMES[case][1], frame)


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
