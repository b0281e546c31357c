"""DQSG compressor (shared/SPEC.md section 3), codec in hvdcompress.codecs.dqsg.

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
from hvdcompress.compressors.base import empty_body
from hvdcompress.compressors.stochastic import Stochastic
from hvdcompress.wire import PayloadError

PARAMS = struct.Struct("<II")  # levels, bucket_size (after the RNG fields)


class DQSG(Stochastic):
    """Dithered quantisation with ``levels`` s in [1, 127] (q in -s..s, default 3, the
    fine lattice of NDQSG) and a delta per ``bucket_size`` (default 512) elements."""

    name = "dqsg"
    summable = False
    error_feedback = False

    def __init__(
        self, levels: int = 3, bucket_size: int = 512, seed: int = 0, rank: int = 0
    ) -> None:
        self.levels = quant.check_levels(levels, "dqsg")
        self.bucket_size = quant.check_bucket(bucket_size, "dqsg")
        self._init_rng(seed, rank)

    def __repr__(self) -> str:
        return f"DQSG(levels={self.levels}, bucket_size={self.bucket_size}, seed={self.seed})"

    def _encode(self, tensor, name):
        w = prim.flat_f32(tensor)
        rng, key = self._rng_params(name)
        params = rng + PARAMS.pack(self.levels, self.bucket_size)
        if not prim.all_finite(w):
            return wire.FLAG_NONFINITE, params, empty_body(w.device)
        return 0, params, dqsg.encode(w, self.levels, self.bucket_size, key)

    def _check_params(self, header):
        self._check_params_len(header, prim.RNG_PARAMS.size + PARAMS.size)
        self._rng_check(header.params)
        levels, bucket = PARAMS.unpack_from(header.params, prim.RNG_PARAMS.size)
        if (levels, bucket) != (self.levels, self.bucket_size):
            raise PayloadError(
                "levels",
                f"expected levels {self.levels} bucket_size {self.bucket_size}, got {levels} "
                f"{bucket} (ranks disagree on the compressor)",
            )

    def _max_numel(self, body_len):
        if self.levels == 1:
            return body_len * threelc.MAX_VALUES_PER_BYTE
        return 8 * body_len // dqsg.dqsg_bits(self.levels)

    def _decode_body(self, header, body, out, accumulate):
        key = self._rng_check(header.params)
        dqsg.decode_into(body, header.numel, self.levels, self.bucket_size, key, out, accumulate)

    def state_dict(self) -> dict:
        return self._rng_state()

    def load_state_dict(self, state: dict) -> None:
        self._load_rng_state(state)
