"""Deep Gradient Compression (Lin et al., ICLR 2018, arXiv 1712.01887; docs/baselines.md,
"DGC": the clipping, the warm-up schedule and the header checks), payload and codec of
top-k (hvdcompress.codecs.sparse). Per tensor (flat float32), with momentum m:

    u = m u + g                        # momentum correction: velocity, accumulated locally
    v = v + u
    send the top-k of |v|, k = ceil(density(step) * n)
    u[sent] = 0 ; v[sent] = 0          # momentum factor masking

So DGC applies the momentum itself: the wrapped optimizer must then use momentum 0
(``check_optimizer`` raises otherwise; DistributedOptimizer calls it). Invariant:
everything sent plus v equals the sum of the velocities u. The density warms up from 0.25
to ``ratio``; the header carries (ratio, step, density) and a receiver recomputes
density(step). Non-finite input travels as the flag and leaves u and v untouched.
"""

from __future__ import annotations

import math
import struct

from hvdcompress import wire
from hvdcompress.buckets import StateKey, state_key, state_text
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import sparse
from hvdcompress.compressors.base import (
    Encoded,
    check_agreed,
    check_params_len,
    empty_body,
    refuse_inner_momentum,
)
from hvdcompress.compressors.memory import ErrorFeedback
from hvdcompress.compressors.params import Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.sparse import TopKLayout
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.errors import PayloadError

PARAMS = struct.Struct("<dQd")  # ratio, step, density of this step
WARMUP_START = 0.25  # density at step 0 of the warm-up (75 % sparsity)


@register(
    CompressorSpec(
        name="dgc",
        wire_id=6,
        params={
            "ratio": Param(0.0, 1.0, low_open=True),
            "momentum": Param(0.0, 1.0, high_open=True),
            "clip_norm": Param(0.0, None, doc="0: off"),
            "warmup_steps": Param(0, 2**63, kind="int", high_open=True),
            "warmup_stages": Param(0, 2**63, kind="int", high_open=True, doc="<= warmup_steps"),
        },
        examples=({"ratio": 0.05}, {"ratio": 0.01, "warmup_steps": 5, "warmup_stages": 2}),
        benchmarks=({},),
        # The velocity sends a tensor's 0.1% largest only once they have grown: with the job's
        # SGD learning rate 2 ranks of batch 32 diverged at step 186 (docs/codecs.md, "Defaults
        # that train"); at half of it they trained.
        sgd_lr_factor=0.5,
    )
)
class DGC(TopKLayout):
    """Top-k (``ratio``, default 0.001) with momentum correction (``momentum`` in [0, 1),
    default 0.9), momentum factor masking, optional local clipping (``clip_norm`` > 0 per
    tensor, scaled by N^-1/2; 0 disables) and sparsity warm-up (``warmup_steps``,
    ``warmup_stages``)."""

    error_feedback = True
    recompressible = False  # compress adds momentum: the owner would apply it twice

    def __init__(
        self,
        ratio: float = 0.001,
        momentum: float = 0.9,
        clip_norm: float = 0.0,
        warmup_steps: int = 0,
        warmup_stages: int = 0,
    ) -> None:
        self.ratio = sparse.check_ratio(ratio, "dgc")
        self.momentum = float(momentum)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"dgc momentum must be in [0, 1), got {momentum!r}")
        self.clip_norm = float(clip_norm)
        if not (self.clip_norm >= 0.0 and math.isfinite(self.clip_norm)):
            raise ValueError(
                f"dgc clip_norm must be a finite float >= 0 (0: off), got {clip_norm!r}"
            )
        for what, v in (("warmup_steps", warmup_steps), ("warmup_stages", warmup_stages)):
            if isinstance(v, bool) or int(v) != v or not 0 <= v < 2**63:
                raise ValueError(f"dgc {what} must be an int in [0, 2**63), got {v!r}")
        self.warmup_steps = int(warmup_steps)
        self.warmup_stages = int(warmup_stages)
        if self.warmup_steps and self.warmup_stages > self.warmup_steps:
            raise ValueError(
                f"dgc warmup_stages must be in [0, warmup_steps={self.warmup_steps}], "
                f"got {warmup_stages!r}"
            )
        self.size = 1
        self.velocity = ErrorFeedback()  # u
        self.memory = ErrorFeedback()  # v (the error-feedback residual)
        self.steps: dict[StateKey, int] = {}

    def bind(self, rank: int, size: int) -> None:
        self.size = max(1, int(size))

    def check_optimizer(self, optimizer) -> None:
        """Raise when the wrapped optimizer applies momentum too (DGC applies it locally)."""
        refuse_inner_momentum(
            self, optimizer, "; or use get_compressor('dgc', momentum=0) to keep the "
            "optimizer's momentum",
        )  # fmt: skip

    def contraction(self, numel):
        # top-k of v, density >= ratio at every step (the warm-up only keeps more)
        return sparse.topk_count(numel, self.ratio) / numel if numel else 1.0

    def residual_bound(self, numel):
        # what v accumulates is the velocity u, ||u|| <= G / (1 - momentum) (masking only
        # zeroes entries); local clipping only shrinks g
        return super().residual_bound(numel) / (1.0 - self.momentum)

    def density(self, step: int) -> float:
        """The kept fraction at ``step`` (docs/baselines.md, "DGC": sparsity warm-up)."""
        T = self.warmup_steps
        if step >= T or self.ratio >= WARMUP_START:
            return self.ratio
        if self.warmup_stages:
            stage, stages = step * self.warmup_stages // T, self.warmup_stages
        else:
            stage, stages = step, T
        return WARMUP_START * (self.ratio / WARMUP_START) ** (stage / stages)

    def _clipped(self, g):
        """The finite g scaled to a norm of at most clip_norm / sqrt(N) (local clipping)."""
        limit = self.clip_norm / math.sqrt(self.size)
        norm = math.sqrt(math.fsum(prim.chunk_sums(g.view(-1), 1024, True).cpu().tolist()))
        return g * float(limit / (norm + 1e-6)) if norm > limit else g

    def encode_bucket(self, tensors, names):
        gs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({g.device for g in gs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        if self.clip_norm > 0.0:
            gs = [self._clipped(g) if prim.all_finite(g) else g for g in gs]
        us = [self.velocity.residual(name, g) for g, name in zip(gs, names, strict=True)]
        vs = [self.memory.residual(name, g) for g, name in zip(gs, names, strict=True)]
        params, ks = [], []
        for g, name in zip(gs, names, strict=True):
            step = self.steps.get(name, 0)
            self.steps[name] = step + 1
            density = self.density(step)
            params.append(PARAMS.pack(self.ratio, step, density))
            ks.append(sparse.topk_count(g.numel(), density))
        bodies, nonfinite = sparse.topk_encode_segments(gs, vs, ks, us, self.momentum)
        return [
            Encoded(wire.FLAG_NONFINITE if bad else 0, p, empty_body(g.device) if bad else body)
            for g, p, body, bad in zip(gs, params, bodies, nonfinite, strict=True)
        ]

    def check_params(self, header, name):
        check_params_len(self, header, PARAMS.size)
        ratio, step, density = PARAMS.unpack(header.params)
        check_agreed("ratio", self.ratio, ratio)
        if density != self.density(step):
            raise PayloadError(
                "density",
                f"step {step} has density {self.density(step)}, got {density} (ranks disagree "
                "on the warm-up)",
            )

    def max_numel(self, body_len, name):
        k = body_len // 8  # each kept value costs at least 4 + 4 bytes; density >= ratio
        return math.floor((k + 1) / self.ratio) + 1

    def kept_ratio(self, params):
        return PARAMS.unpack(params)[2]  # this step's density

    def state_dict(self) -> dict:
        return {
            "ratio": self.ratio,
            "steps": state_text(self.steps),
            "velocity": self.velocity.state_dict(),
            "residuals": self.memory.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress import checkpoint

        required = ("ratio", "velocity", "residuals")
        checkpoint.check_keys("dgc state", state, required=required, optional=("steps",))
        checkpoint.check_saved_value("ratio", state["ratio"], self.ratio)
        steps = checkpoint.check_count_map("dgc steps", state.get("steps", {}))
        checkpoint.check_tensor_map("dgc velocity", state["velocity"])  # all checked before loading
        checkpoint.check_tensor_map("dgc residuals", state["residuals"])
        velocity, memory = self.velocity.residuals, self.memory.residuals
        try:
            self.velocity.load_state_dict(state["velocity"], what="dgc velocity")
            self.memory.load_state_dict(state["residuals"], what="dgc residuals")
        except BaseException:
            self.velocity.residuals, self.memory.residuals = velocity, memory
            raise
        self.steps = {state_key(text): step for text, step in steps.items()}
