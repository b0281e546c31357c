"""DQSG compressor (docs/codecs.md, "DQSG and NDQSG"), codec in hvdcompress.codecs.dqsg.

No error feedback (the dithered quantiser is unbiased and its error independent of the
input); the dither is the seeded compressors' (hvdcompress.compressors.stochastic).
Non-finite input travels as the flag.
"""

from __future__ import annotations

from hvdcompress.codecs import dqsg, quant
from hvdcompress.compressors.quant import BUCKET_QUANTIZER, BucketQuantizer
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec


@register(
    CompressorSpec(
        name="dqsg",
        wire_id=2,
        params=BUCKET_QUANTIZER,
        examples=(
            {"levels": 3, "bucket_size": 64},
            {"levels": 1, "bucket_size": 64},
            {"levels": 127},
        ),
        benchmarks=({},),
    )
)
class DQSG(BucketQuantizer):
    """Dithered quantisation with ``levels`` s in [1, 127] (q in -s..s, default 3, the
    fine lattice of NDQSG) and a delta per ``bucket_size`` (default 512) elements."""

    def __init__(
        self, levels: int = 3, bucket_size: int = 512, seed: int = 0, rank: int = 0
    ) -> None:
        self.levels = quant.check_levels(levels, "dqsg")
        self.bucket_size = quant.check_bucket(bucket_size, "dqsg")
        self._init_rng(seed, rank)

    def _encode_segments(self, ws, keys):
        return dqsg.encode_segments(ws, self.levels, self.bucket_size, keys)

    def max_numel(self, body_len, name):
        return dqsg.max_numel(body_len, self.levels)

    def decode_into(self, header, body, out, accumulate, side_info):
        key = self._stream_key(header.params)
        dqsg.decode_into(body, header.numel, self.levels, self.bucket_size, key, out, accumulate)

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        keys = [self._stream_key(p) for p in params]  # accepts_bucket checked the fields
        return dqsg.decode_segments(
            frame, starts, lens, numels, self.levels, self.bucket_size, keys, outs
        )
