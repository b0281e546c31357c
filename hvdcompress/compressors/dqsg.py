"""DQSG compressor (docs/codecs.md, "DQSG and NDQSG"), codec in hvdcompress.codecs.dqsg.

No error feedback (the dithered quantiser is unbiased and its error independent of the
input). The dither comes from the counter-based generator keyed by (seed, step, rank,
tensor id); those travel in the header, so a receiver decodes any rank's payload from
the payload alone. Non-finite input travels as the flag.
"""

from __future__ import annotations

import struct

from hvdcompress import wire
from hvdcompress.codecs import dqsg, quant, threelc
from hvdcompress.codecs import primitives as prim
from hvdcompress.compressors.base import Encoded, empty_body
from hvdcompress.compressors.params import RANK, SEED
from hvdcompress.compressors.quant import BUCKET, LEVELS
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.stochastic import Stochastic
from hvdcompress.errors import PayloadError

PARAMS = struct.Struct("<II")  # levels, bucket_size (after the RNG fields)


@register
class DQSG(Stochastic):
    """Dithered quantisation with ``levels`` s in [1, 127] (q in -s..s, default 3, the
    fine lattice of NDQSG) and a delta per ``bucket_size`` (default 512) elements."""

    name = "dqsg"
    wire_id = 2
    params = {"levels": LEVELS, "bucket_size": BUCKET, "seed": SEED, "rank": RANK}
    examples = (
        {"levels": 3, "bucket_size": 64},
        {"levels": 1, "bucket_size": 64},
        {"levels": 127},
    )
    benchmarks = ({},)
    error_feedback = False

    def shard_alignment(self) -> int:
        return self.bucket_size  # one delta per bucket (docs/codecs.md, "Quantisation buckets")

    def __init__(
        self, levels: int = 3, bucket_size: int = 512, seed: int = 0, rank: int = 0
    ) -> None:
        self.levels = quant.check_levels(levels, "dqsg")
        self.bucket_size = quant.check_bucket(bucket_size, "dqsg")
        self._init_rng(seed, rank)

    def __repr__(self) -> str:
        return f"DQSG(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"

    def encode(self, tensor, name):
        w = prim.flat_f32(tensor)
        rng, key = self._rng_params(name)
        params = rng + PARAMS.pack(self.levels, self.bucket_size)
        body = dqsg.encode(w, self.levels, self.bucket_size, key)
        if body is None:
            return wire.FLAG_NONFINITE, params, empty_body(w.device)
        return 0, params, body

    def encode_bucket(self, tensors, names):
        ws = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({w.device for w in ws}) != 1:  # none, or several devices
            return super().encode_bucket(tensors, names)
        rngs = [self._rng_params(name) for name in names]  # steps advance as in encode
        params = [rng + PARAMS.pack(self.levels, self.bucket_size) for rng, _ in rngs]
        bodies = dqsg.encode_segments(ws, self.levels, self.bucket_size, [k for _, k in rngs])
        return [
            Encoded(0, p, body)
            if body is not None
            else Encoded(wire.FLAG_NONFINITE, p, empty_body(w.device))
            for w, p, body in zip(ws, params, bodies, strict=True)
        ]

    cuda_decode_segments = True  # dqsg.decode_segments' launch sequence

    def check_params(self, header, name):
        self._check_params_len(header, prim.RNG_PARAMS.size + PARAMS.size)
        self._rng_check(header.params, name)
        levels, bucket = PARAMS.unpack_from(header.params, prim.RNG_PARAMS.size)
        if (levels, bucket) != (self.levels, self.bucket_size):
            raise PayloadError(
                "levels",
                f"expected levels {self.levels} bucket_size {self.bucket_size}, got {levels} "
                f"{bucket} (ranks disagree on the compressor)",
            )

    def max_numel(self, body_len, name):
        if self.levels == 1:
            return body_len * threelc.MAX_VALUES_PER_BYTE
        return 8 * body_len // dqsg.dqsg_bits(self.levels)

    def decode_into(self, header, body, out, accumulate, side_info):
        key = self._stream_key(header.params)
        dqsg.decode_into(body, header.numel, self.levels, self.bucket_size, key, out, accumulate)

    def decode_segments(
        self, frame, params, body_starts, body_lens, numels, outs, names, rank=None
    ):
        keys = [self._stream_key(p) for p in params]  # accepts_bucket checked the fields
        return dqsg.decode_segments(
            frame, body_starts, body_lens, numels, self.levels, self.bucket_size, keys, outs
        )

    def state_dict(self) -> dict:
        return self._rng_state()

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress.checkpoint import check_count_map, check_keys

        check_keys(f"{self.name} state", state, required=("seed",), optional=("steps",))
        check_count_map(f"{self.name} steps", state.get("steps", {}))
        self._load_rng_state(state)
