"""3LC compressor: the 3LC codec plus an error-feedback residual per tensor.

Lim et al., SysML 2019. The residual keeps what quantisation dropped and adds it to
the next gradient of the same tensor (docs/codecs.md, "3LC"); a non-finite gradient leaves
it untouched and travels as a flag, so every rank decodes all-NaN and torch.amp's
GradScaler skips the step.
"""

from __future__ import annotations

import numpy as np

from hvdcompress import framing, wire
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import threelc
from hvdcompress.compressors.base import (
    Encoded,
    GatherCompressor,
    check_agreed,
    check_params_len,
    check_scale,
)
from hvdcompress.compressors.levels import PerTensorLevels, TensorLevels
from hvdcompress.compressors.memory import ErrorFeedback, load_residual_state, residual_state
from hvdcompress.compressors.params import Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec


class TernaryLayout(GatherCompressor):
    """What 3LC and TernGrad share: 3LC's body (digits q in {-1, 0, 1}, quartic + zero-run
    coded) decoded to S q (``scales``: each payload's S, from its checked parameters)."""

    cuda_decode_segments = True  # threelc.decode_segments: one launch sequence a frame

    def shard_alignment(self) -> int:
        return 5  # a quartic byte holds 5 values (docs/codecs.md, "Quartic encoding")

    def max_numel(self, body_len, name):
        return body_len * threelc.MAX_VALUES_PER_BYTE

    def decode_into(self, header, body, out, accumulate, side_info):
        scale = float(self.scales([header.params])[0])
        threelc.decode_into(body, header.numel, scale, out, accumulate)

    def decode_new(self, header, body, side_info):
        fill = threelc.fresh_fill(float(self.scales([header.params])[0]))
        return framing.decode_filled(self, header, body, side_info, fill)

    def decoded_bound(self, header, body):
        return float(self.scales([header.params])[0])  # S * q, q in {-1, 0, 1}

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        return threelc.decode_segments(frame, starts, lens, numels, self.scales(params), outs)


@register(
    CompressorSpec(
        name="3lc",
        wire_id=1,
        attribute="threelc",  # Compression.threelc
        params={"sparsity": Param(1.0, 2.0, high_open=True)},
        examples=({"sparsity": 1.0}, {"sparsity": 1.2}, {"sparsity": 1.75}, {"sparsity": 1.9}),
        benchmarks=({"sparsity": 1.0}, {"sparsity": 1.75}),
        level_param="sparsity",
    )
)
class ThreeLC(PerTensorLevels, TernaryLayout):
    """3LC with sparsity multiplication ``sparsity`` in [1, 2) (default 1.0); a policy may
    set it per tensor (``set_level(name, s)``), the header carries it."""

    error_feedback = True

    def __init__(self, sparsity: float = 1.0) -> None:
        self.sparsity = threelc.check_sparsity(sparsity)
        self.levels = TensorLevels(self.sparsity, threelc.check_sparsity)
        self.memory = ErrorFeedback()

    def state_dict(self) -> dict:
        return residual_state(self.memory, {"sparsity": self.sparsity})

    def load_state_dict(self, state: dict) -> None:
        load_residual_state(self.memory, self.name, state, {"sparsity": self.sparsity})

    def owner_level(self, level):
        # The owner's input is the average of N ternary payloads plus its residual: a few
        # spikes. A second error-feedback loop at high sparsity (contraction s (2 - s) / n)
        # delays most of it for long and the training diverged (s = 1.75, 4 ranks,
        # Fashion-MNIST, docs/benchmarks-step-time.md, "Scaling out"); at s = 1 the owner
        # sends every value at or above half the largest.
        return 1.0

    def contraction(self, numel):
        # every |a_i - S q_i| <= |a_i|, and the largest M = max|a| leaves (s - 1) M with
        # S = s M: ||a - decode||^2 <= ||a||^2 - s (2 - s) M^2, M^2 >= ||a||^2 / n. The
        # largest s a policy may set (below 2) is not known here: the default's is declared.
        s = self.sparsity
        return s * (2.0 - s) / numel if numel else 1.0

    def encode_bucket(self, tensors, names):
        gs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({g.device for g in gs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        es = [self.memory.residual(name, g) for g, name in zip(gs, names, strict=True)]
        levels = [self.level(name) for name in names]
        coded = threelc.encode_segments(gs, es, levels)
        return [
            Encoded(wire.FLAG_NONFINITE if bad else 0, threelc.PARAMS.pack(s, scale), body)
            for s, (body, scale, bad) in zip(levels, coded, strict=True)
        ]

    def check_params(self, header, name):
        check_params_len(self, header, threelc.PARAMS.size)
        sparsity, scale = threelc.PARAMS.unpack(header.params)
        check_agreed("sparsity", float(np.float32(self.level(name))), sparsity)  # as sent
        check_scale(header, scale)

    def scales(self, params):
        return np.frombuffer(b"".join(params), dtype="<f4").reshape(-1, 2)[:, 1]  # PARAMS

    def accepts_bucket(self, names, flags, params, body_lens, numels):
        # check_params and max_numel of every payload, as array arithmetic
        if any(len(p) != threelc.PARAMS.size for p in params):
            return False
        sparsity = np.frombuffer(b"".join(params), dtype="<f4").reshape(-1, 2)[:, 0]
        scale = self.scales(params)
        expected = np.array([self.level(name) for name in names], dtype=np.float32)
        nonfinite = (flags & wire.FLAG_NONFINITE) != 0
        with np.errstate(invalid="ignore"):
            ok = (sparsity == expected) & np.where(
                nonfinite, scale == 0.0, np.isfinite(scale) & (scale >= 0.0)
            )
        ok &= nonfinite | (numels <= body_lens * threelc.MAX_VALUES_PER_BYTE)
        return bool(ok.all())
