"""QSGD and TernGrad compressors (docs/baselines.md), codecs in
hvdcompress.codecs.quant. Both are unbiased and keep no error feedback; their rounding
is stochastic with counter-based random numbers (hvdcompress.compressors.stochastic).
Non-finite input (or a QSGD norm that overflows float32) travels as the flag.
"""

from __future__ import annotations

import struct

import numpy as np

from hvdcompress import wire
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import quant, threelc
from hvdcompress.compressors.base import Encoded, check_scale, empty_body
from hvdcompress.compressors.params import RANK, SEED, Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.stochastic import Stochastic
from hvdcompress.errors import PayloadError

QSGD_PARAMS = struct.Struct("<II")  # levels, bucket_size (after the RNG fields)
TERNGRAD_PARAMS = struct.Struct("<f")  # scale M (after the RNG fields)
LEVELS = Param(1, quant.MAX_LEVELS, kind="int")
BUCKET = Param(1, 2**31 - 1, kind="int", doc="elements per norm")


@register
class QSGD(Stochastic):
    """QSGD with ``levels`` in [1, 127] (default 16) and a norm per ``bucket_size``."""

    name = "qsgd"
    wire_id = 7
    params = {"levels": LEVELS, "bucket_size": BUCKET, "seed": SEED, "rank": RANK}
    examples = ({"levels": 16, "bucket_size": 64}, {"levels": 1})
    benchmarks = ({"levels": 16},)
    error_feedback = False
    cuda_decode_segments = True  # quant.qsgd_decode_segments: one launch sequence a frame

    def shard_alignment(self) -> int:
        return self.bucket_size  # one norm per bucket (docs/codecs.md, "Quantisation buckets")

    def __init__(
        self, levels: int = 16, bucket_size: int = 512, seed: int = 0, rank: int = 0
    ) -> None:
        self.levels = quant.check_levels(levels, "qsgd")
        self.bucket_size = quant.check_bucket(bucket_size, "qsgd")
        self._init_rng(seed, rank)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"

    def encode(self, tensor, name):
        x = prim.flat_f32(tensor)
        rng, key = self._rng_params(name)
        params = rng + QSGD_PARAMS.pack(self.levels, self.bucket_size)
        body = quant.qsgd_encode(x, self.levels, self.bucket_size, key)
        if body is None:
            return wire.FLAG_NONFINITE, params, empty_body(x.device)
        return 0, params, body

    def encode_bucket(self, tensors, names):
        xs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({x.device for x in xs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        rngs = [self._rng_params(name) for name in names]  # steps advance as in encode
        bodies = quant.qsgd_encode_segments(
            xs, self.levels, self.bucket_size, [key for _, key in rngs]
        )
        params = [rng + QSGD_PARAMS.pack(self.levels, self.bucket_size) for rng, _ in rngs]
        return [
            Encoded(0, param, body)
            if body is not None
            else Encoded(wire.FLAG_NONFINITE, param, empty_body(x.device))
            for x, param, body in zip(xs, params, bodies, strict=True)
        ]

    def check_params(self, header, name):
        self._check_params_len(header, prim.RNG_PARAMS.size + QSGD_PARAMS.size)
        self._rng_check(header.params, name)
        levels, bucket = QSGD_PARAMS.unpack_from(header.params, prim.RNG_PARAMS.size)
        if (levels, bucket) != (self.levels, self.bucket_size):
            raise PayloadError(
                "levels",
                f"expected levels {self.levels} bucket_size {self.bucket_size}, got {levels} "
                f"{bucket} (ranks disagree on the compressor)",
            )

    def max_numel(self, body_len, name):
        return 8 * body_len // quant.qsgd_bits(self.levels)

    def decode_into(self, header, body, out, accumulate, side_info):
        quant.qsgd_decode_into(body, header.numel, self.levels, self.bucket_size, out, accumulate)

    def decode_segments(
        self, frame, params, body_starts, body_lens, numels, outs, names, rank=None
    ):
        # accepts_bucket checked every payload's levels and bucket size against these
        return quant.qsgd_decode_segments(
            frame, body_starts, body_lens, numels, self.levels, self.bucket_size, outs
        )

    def state_dict(self) -> dict:
        return self._rng_state()

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress.checkpoint import check_count_map, check_keys

        check_keys(f"{self.name} state", state, required=("seed",), optional=("steps",))
        check_count_map(f"{self.name} steps", state.get("steps", {}))
        self._load_rng_state(state)


@register
class TernGrad(Stochastic):
    """TernGrad: stochastic {-1, 0, 1} * max|x| per tensor, quartic + zero-run coded."""

    name = "terngrad"
    wire_id = 8
    params = {"seed": SEED, "rank": RANK}
    error_feedback = False
    cuda_decode_segments = True  # 3LC's body layout: threelc.decode_segments

    def __init__(self, seed: int = 0, rank: int = 0) -> None:
        self._init_rng(seed, rank)

    def shard_alignment(self) -> int:
        return 5  # a quartic byte holds 5 values (docs/codecs.md, "Quartic encoding")

    def __repr__(self) -> str:
        return f"TernGrad(seed={self.seed})"

    def encode(self, tensor, name):
        x = prim.flat_f32(tensor)
        rng, key = self._rng_params(name)
        encoded = quant.terngrad_encode(x, key)
        if encoded is None:
            return wire.FLAG_NONFINITE, rng + TERNGRAD_PARAMS.pack(0.0), empty_body(x.device)
        body, scale = encoded
        return 0, rng + TERNGRAD_PARAMS.pack(scale), body

    def encode_bucket(self, tensors, names):
        xs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({x.device for x in xs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        rngs = [self._rng_params(name) for name in names]  # steps advance as in encode
        encoded = quant.terngrad_encode_segments(xs, [key for _, key in rngs])
        return [
            Encoded(wire.FLAG_NONFINITE, rng + TERNGRAD_PARAMS.pack(0.0), empty_body(x.device))
            if enc is None
            else Encoded(0, rng + TERNGRAD_PARAMS.pack(enc[1]), enc[0])
            for x, (rng, _), enc in zip(xs, rngs, encoded, strict=True)
        ]

    def check_params(self, header, name):
        self._check_params_len(header, prim.RNG_PARAMS.size + TERNGRAD_PARAMS.size)
        self._rng_check(header.params, name)
        (scale,) = TERNGRAD_PARAMS.unpack_from(header.params, prim.RNG_PARAMS.size)
        check_scale(header, scale)

    def max_numel(self, body_len, name):
        return body_len * threelc.MAX_VALUES_PER_BYTE

    def decode_into(self, header, body, out, accumulate, side_info):
        (scale,) = TERNGRAD_PARAMS.unpack_from(header.params, prim.RNG_PARAMS.size)
        quant.terngrad_decode_into(body, header.numel, scale, out, accumulate)

    def decode_segments(
        self, frame, params, body_starts, body_lens, numels, outs, names, rank=None
    ):
        # the 3LC body layout (quartic digits, zero-run coded) with the scale M
        at = prim.RNG_PARAMS.size
        scales = np.array([TERNGRAD_PARAMS.unpack_from(p, at)[0] for p in params], np.float32)
        return threelc.decode_segments(frame, body_starts, body_lens, numels, scales, outs)

    def state_dict(self) -> dict:
        return self._rng_state()

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress.checkpoint import check_count_map, check_keys

        check_keys(f"{self.name} state", state, required=("seed",), optional=("steps",))
        check_count_map(f"{self.name} steps", state.get("steps", {}))
        self._load_rng_state(state)
