"""signSGD and EF-signSGD compressors (docs/baselines.md), codecs in
hvdcompress.codecs.sign (see there for how the optimizer should treat decoded signs).
Non-finite input travels as the flag; EF-signSGD then leaves its residual untouched.
"""

from __future__ import annotations

import struct

import numpy as np

from hvdcompress import framing, wire
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import sign
from hvdcompress.compressors.base import GatherCompressor, check_params_len, check_scale
from hvdcompress.compressors.memory import ErrorFeedback, load_residual_state, residual_state
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.compressors.stochastic import encoded

EF_PARAMS = struct.Struct("<f")  # scale = mean |g + e|


class SignBits(GatherCompressor):
    """What signSGD and EF-signSGD share: a body of one sign bit per value, decoded to
    +-scale (``scales``: each payload's, from its checked parameters)."""

    cuda_decode_segments = True  # sign.decode_segments: one launch sequence a frame

    def max_numel(self, body_len, name):
        return 8 * body_len

    def decode_into(self, header, body, out, accumulate, side_info):
        scale = float(self.scales([header.params])[0])
        sign.decode_into(body, header.numel, scale, out, accumulate)

    def decode_new(self, header, body, side_info):
        # sign.decode_with writes by adding into -0.0 (-0.0 + v is v)
        return framing.decode_filled(self, header, body, side_info, -0.0)

    def decoded_bound(self, header, body):
        return float(self.scales([header.params])[0])  # +-scale, checked finite

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        return sign.decode_segments(frame, starts, lens, numels, self.scales(params), outs)


@register(
    CompressorSpec(
        name="signsgd",
        wire_id=9,
        # every coordinate moves by the learning rate, not by its gradient: the job's SGD
        # learning rate stalled at chance; 1/500 of it trained (docs/codecs.md, "Defaults
        # that train")
        sgd_lr_factor=0.002,
    )
)
class SignSGD(SignBits):
    """One bit per value; decodes to +1 / -1 (scale-free, no state)."""

    error_feedback = False

    def __init__(self) -> None:
        pass

    def encode_bucket(self, tensors, names):
        xs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({x.device for x in xs}) > 1:
            return super().encode_bucket(tensors, names)
        bodies = sign.encode_segments(xs)
        return [encoded(b"", body, x.device) for x, body in zip(xs, bodies, strict=True)]

    def check_params(self, header, name):
        check_params_len(self, header, 0)

    def scales(self, params):
        return np.ones(len(params), dtype=np.float32)  # +1 or -1

    def accepts_bucket(self, names, flags, params, body_lens, numels):
        nonfinite = (flags & wire.FLAG_NONFINITE) != 0
        return not any(params) and bool((nonfinite | (numels <= 8 * body_lens)).all())


@register(
    CompressorSpec(
        name="efsignsgd",
        wire_id=10,
        # Karimireddy et al. 2019's EF-SGD has no momentum; with the job's 0.9 on top of the
        # residual it reached 56%, without it and at twice the learning rate 83%
        # (docs/codecs.md, "Defaults that train")
        sgd_lr_factor=2.0,
        sgd_momentum=0.0,
    )
)
class EFSignSGD(SignBits):
    """EF-signSGD: mean|g + e| * sign(g + e), one bit per value plus one float32 scale."""

    error_feedback = True

    def __init__(self) -> None:
        self.memory = ErrorFeedback()

    def state_dict(self) -> dict:
        return residual_state(self.memory, {})

    def load_state_dict(self, state: dict) -> None:
        load_residual_state(self.memory, self.name, state, {})

    def contraction(self, numel):
        # ||a - mean|a| sign(a)||^2 = ||a||^2 - ||a||_1^2 / n >= (1 - 1 / n) ||a||^2 at worst
        # (Karimireddy et al. 2019, the scaled sign compressor)
        return 1.0 / numel if numel else 1.0

    def encode_bucket(self, tensors, names):
        gs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({g.device for g in gs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        es = [self.memory.residual(name, g) for g, name in zip(gs, names, strict=True)]
        coded = [c or (None, 0.0) for c in sign.ef_encode_segments(gs, es)]
        return [
            encoded(EF_PARAMS.pack(scale), body, g.device)
            for g, (body, scale) in zip(gs, coded, strict=True)
        ]

    def check_params(self, header, name):
        check_params_len(self, header, EF_PARAMS.size)
        (scale,) = EF_PARAMS.unpack(header.params)
        check_scale(header, scale)

    def scales(self, params):
        return np.frombuffer(b"".join(params), dtype="<f4")  # EF_PARAMS

    def accepts_bucket(self, names, flags, params, body_lens, numels):
        # check_params and max_numel of every payload, as array arithmetic
        if any(len(p) != EF_PARAMS.size for p in params):
            return False
        scale = self.scales(params)
        nonfinite = (flags & wire.FLAG_NONFINITE) != 0
        with np.errstate(invalid="ignore"):
            ok = np.where(nonfinite, scale == 0.0, np.isfinite(scale) & (scale >= 0.0))
        return bool((ok & (nonfinite | (numels <= 8 * body_lens))).all())
