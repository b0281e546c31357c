"""QSGD and TernGrad compressors (docs/baselines.md), codecs in hvdcompress.codecs.quant,
and BucketQuantizer, what QSGD and DQSG share. Both are unbiased and keep no error
feedback; their rounding is stochastic with counter-based random numbers
(hvdcompress.compressors.stochastic). Non-finite input (or a QSGD norm that overflows
float32) travels as the flag.
"""

from __future__ import annotations

import struct

import numpy as np

from hvdcompress import framing
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import quant
from hvdcompress.compressors.base import Encoded, check_agreed, check_scale
from hvdcompress.compressors.params import RANK, SEED, Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.compressors.stochastic import Stochastic, encoded, with_fields
from hvdcompress.compressors.threelc import TernaryLayout

QSGD_PARAMS = struct.Struct("<II")  # levels, bucket_size (after the RNG fields; DQSG too)
TERNGRAD_PARAMS = struct.Struct("<f")  # scale M (after the RNG fields)
LEVELS = Param(1, quant.MAX_LEVELS, kind="int")
BUCKET = Param(1, 2**31 - 1, kind="int", doc="elements per norm")
# the constructor parameters of a BucketQuantizer (QSGD, DQSG)
BUCKET_QUANTIZER = {"levels": LEVELS, "bucket_size": BUCKET, "seed": SEED, "rank": RANK}


class BucketQuantizer(Stochastic):
    """A seeded quantiser with ``levels`` and one scale per ``bucket_size`` elements (QSGD,
    DQSG): both travel after the RNG fields and must match the receiver's. A subclass
    gives its codec's bucket encoder (``_encode_segments``)."""

    error_feedback = False
    cuda_decode_segments = True  # the codec's decode_segments: one launch sequence a frame

    def shard_alignment(self) -> int:
        return self.bucket_size  # one scale per bucket (docs/codecs.md, "Quantisation buckets")

    def encode_bucket(self, tensors, names):
        fields = QSGD_PARAMS.pack(self.levels, self.bucket_size)
        return self._encode_bucket_with(tensors, names, self._encode_segments, with_fields(fields))

    def check_params(self, header, name):
        theirs = self._checked_fields(header, name, QSGD_PARAMS)
        check_agreed("levels", (self.levels, self.bucket_size), theirs)  # (levels, bucket_size)


@register(
    CompressorSpec(
        name="qsgd",
        wire_id=7,
        params=BUCKET_QUANTIZER,
        examples=({"levels": 16, "bucket_size": 64}, {"levels": 1}),
        benchmarks=({"levels": 16},),
    )
)
class QSGD(BucketQuantizer):
    """QSGD with ``levels`` in [1, 127] (default 16) and a norm per ``bucket_size``."""

    def __init__(
        self, levels: int = 16, bucket_size: int = 512, seed: int = 0, rank: int = 0
    ) -> None:
        self.levels = quant.check_levels(levels, "qsgd")
        self.bucket_size = quant.check_bucket(bucket_size, "qsgd")
        self._init_rng(seed, rank)

    def _encode_segments(self, xs, keys):
        return quant.qsgd_encode_segments(xs, self.levels, self.bucket_size, keys)

    def max_numel(self, body_len, name):
        return 8 * body_len // quant.qsgd_bits(self.levels)

    def decode_into(self, header, body, out, accumulate, side_info):
        quant.qsgd_decode_into(body, header.numel, self.levels, self.bucket_size, out, accumulate)

    def decode_new(self, header, body, side_info):
        # quant.qsgd_decode_with writes by adding into -0.0
        return framing.decode_filled(self, header, body, side_info, -0.0)

    def decoded_bound(self, header, body):
        return quant.qsgd_decoded_bound(body, header.numel, self.bucket_size)

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        # accepts_bucket checked every payload's levels and bucket size against these
        return quant.qsgd_decode_segments(
            frame, starts, lens, numels, self.levels, self.bucket_size, outs
        )


@register(
    CompressorSpec(
        name="terngrad",
        wire_id=8,
        params={"seed": SEED, "rank": RANK},
    )
)
class TernGrad(TernaryLayout, Stochastic):
    """TernGrad: stochastic {-1, 0, 1} * max|x| per tensor, quartic + zero-run coded."""

    error_feedback = False

    def __init__(self, seed: int = 0, rank: int = 0) -> None:
        self._init_rng(seed, rank)

    def encode_bucket(self, tensors, names):
        return self._encode_bucket_with(
            tensors, names, quant.terngrad_encode_segments, _terngrad_payload
        )

    def check_params(self, header, name):
        (scale,) = self._checked_fields(header, name, TERNGRAD_PARAMS)
        check_scale(header, scale)

    def scales(self, params):
        at = prim.RNG_PARAMS.size  # the scale M: +-M or 0 decoded
        return np.array([TERNGRAD_PARAMS.unpack_from(p, at)[0] for p in params], np.float32)


def _terngrad_payload(rng: bytes, coded, device) -> Encoded:
    """TernGrad's payload of the codec's (body, scale), or of None (non-finite: scale 0)."""
    body, scale = (None, 0.0) if coded is None else coded
    return encoded(rng + TERNGRAD_PARAMS.pack(scale), body, device)
