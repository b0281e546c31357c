"""Block-scaled 3LC (``"block3lc"``): 3LC with a scale per block of ``block`` values
(hvdcompress.codecs.blockq), plus 3LC's error-feedback residual per tensor.

One scale per tensor lets a few large values zero the rest of the tensor; a scale per
block bounds that to the block (issue 61). ``levels`` (1: ternary, 3LC's digits) is the
per-tensor level a policy sets: the warm-up policy (hvdcompress.policies.warmup) sends
the first steps at more levels, Accordion switches between two. ``stochastic`` rounds
each value up or down at random (unbiased), with the error feedback kept: the value under
half a step that deterministic rounding zeroes, step after step, until its residual grows
past it, is sent now with probability |a| / delta. ``ef21`` replaces the residual by
EF21-SGDM's estimate (Fatkhullin et al., "Momentum provably improves error feedback!",
NeurIPS 2023). A screening prototype:
torch arithmetic on the CPU, no fused native or CUDA kernel (docs/screening.md).
"""

from __future__ import annotations

import math

import numpy as np

from hvdcompress import wire
from hvdcompress.buckets import state_text
from hvdcompress.codecs import blockq
from hvdcompress.codecs import primitives as prim
from hvdcompress.compressors.base import (
    Encoded,
    GatherCompressor,
    check_agreed,
    check_params_len,
    refuse_inner_momentum,
)
from hvdcompress.compressors.levels import PerTensorLevels, TensorLevels
from hvdcompress.compressors.memory import ErrorFeedback, load_residual_state, residual_state
from hvdcompress.compressors.params import FLAG, SEED, Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.compressors.stochastic import load_steps, next_stream_key
from hvdcompress.errors import PayloadError


def _check_sparsity(sparsity) -> float:
    try:
        from hvdcompress.codecs.threelc import check_sparsity

        return check_sparsity(sparsity)
    except ValueError as err:
        raise ValueError(str(err).replace("3LC", "block3lc")) from None


@register(
    CompressorSpec(
        name="block3lc",
        wire_id=13,
        params={
            "sparsity": Param(1.0, 2.0, high_open=True),
            "block": Param(1, blockq.MAX_BLOCK, kind="int", doc="values per scale"),
            "levels": Param(1, blockq.MAX_LEVELS, kind="int", doc="q in -levels..levels"),
            "momentum": Param(0.0, 1.0, high_open=True, doc="> 0: momentum correction"),
            "stochastic": FLAG,
            "error_feedback": FLAG,
            "ef21": FLAG,
            "seed": SEED,
        },
        # momentum correction and ef21 are not among the examples: their state does not sum
        # to the inputs with what was sent; tests/test_blockq*.py cover them
        examples=(
            {"sparsity": 1.0, "block": 256},
            {"sparsity": 1.5, "block": 5},
            {"sparsity": 1.0, "block": 64, "levels": 3},
            {"sparsity": 1.0, "block": 256, "stochastic": True, "seed": 7},
            {"sparsity": 1.5, "block": 256, "stochastic": True, "error_feedback": False},
        ),
        benchmarks=({"sparsity": 1.0, "block": 1024},),
        level_param="levels",
    )
)
class BlockThreeLC(PerTensorLevels, GatherCompressor):
    """3LC with a scale per ``block`` values (default 1024), ``sparsity`` in [1, 2)
    (default 1.0) and ``levels`` (default 1: ternary); a policy may set ``levels`` per
    tensor (``set_level``), the header carries it. ``momentum`` m > 0: DGC's momentum
    correction (Lin et al., ICLR 2018): the velocity u = m u + g is what is compressed
    (with the residual), u is zeroed where a digit was sent (momentum factor masking),
    and the wrapped optimizer must run without momentum (``check_optimizer``).
    ``stochastic``: stochastic rounding (``hvdcompress.codecs.blockq``) from the
    counter-based stream of (``seed``, this tensor's step, this rank, the tensor's id),
    the same numbers on every backend; the steps are in the checkpoint.
    ``error_feedback`` (default True) keeps the residual; False sends the unbiased
    stochastic code alone (``stochastic`` required: rounding to nearest without the
    residual would drop every value under half a step for good).
    ``ef21``: EF21-SGDM (Richtarik et al., NeurIPS 2021; Fatkhullin et al., NeurIPS 2023)
    in place of the residual. Each rank keeps an estimate h of its momentum
    v = ``momentum`` v + g and sends c = C(v - h), h += c; the average of the c's is the
    optimizer's gradient, and the wrapped SGD's momentum 1 (dampening 0) adds it into its
    buffer, which so holds the average of the h's: the direction applied is a compressed
    estimate of the average momentum that follows it, where the residual of error
    feedback adds the past's dropped values to later gradients. Invariant: h equals the
    sum of this rank's decoded payloads, and the wrapped optimizer's buffer the average
    over the ranks of theirs (every bucket on a compressed exchange). The DDP hook
    refuses it (``needs_wrapped_optimizer``): it never sees the optimizer."""

    def __init__(
        self,
        sparsity: float = 1.0,
        block: int = 1024,
        levels: int = 1,
        momentum: float = 0.0,
        stochastic: bool = False,
        seed: int = 0,
        error_feedback: bool = True,
        ef21: bool = False,
    ) -> None:
        self.sparsity = _check_sparsity(sparsity)
        self.block = blockq.check_block(block)
        self.levels_default = blockq.check_levels(levels)
        self.levels = TensorLevels(self.levels_default, blockq.check_levels)
        self.momentum = float(momentum)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"block3lc momentum must be in [0, 1), got {momentum!r}")
        self.ef21 = bool(FLAG.check("block3lc", "ef21", ef21))
        self.needs_wrapped_optimizer = self.ef21
        # compress applies momentum (and ef21 the estimate): a two-stage owner would apply
        # them twice
        self.recompressible = self.momentum == 0.0 and not self.ef21
        self.memory = ErrorFeedback()
        self.velocity = ErrorFeedback()  # u, with momentum correction
        self.stochastic = bool(FLAG.check("block3lc", "stochastic", stochastic))
        self.error_feedback = bool(FLAG.check("block3lc", "error_feedback", error_feedback))
        if not (self.error_feedback or self.stochastic):
            raise ValueError("block3lc error_feedback=False needs stochastic=True")
        if self.stochastic and self.error_feedback and self.sparsity != 1.0:
            # a stochastic residual is up to delta = s max|a|: for s > 1 the next step's
            # max, and with it delta, can grow s-fold a step (a ViT diverged in 18 steps)
            raise ValueError(
                "block3lc stochastic=True with error feedback needs sparsity 1.0, got "
                f"{self.sparsity!r} (its residual would grow without bound)"
            )
        if self.ef21 and (self.stochastic or not self.error_feedback):
            raise ValueError(
                "block3lc ef21=True rounds to nearest and keeps its estimate: it takes "
                "neither stochastic=True nor error_feedback=False"
            )
        self.seed = prim.check_seed(seed)
        self.rank = 0
        self.steps: dict = {}  # stochastic rounding: compress calls per tensor

    def bind(self, rank: int, size: int) -> None:
        self.rank = prim.check_rank(rank)

    def __repr__(self) -> str:
        # the options added later only where set: a checkpoint names its compressor by
        # this text, and one saved before they existed still loads
        later = "".join(
            f", {key}={value}"
            for key, value, default in (
                ("stochastic", self.stochastic, False),
                ("error_feedback", self.error_feedback, True),
                ("ef21", self.ef21, False),
            )
            if value != default
        )
        return (
            f"BlockThreeLC(sparsity={self.sparsity}, block={self.block}, "
            f"levels={self.levels_default}, momentum={self.momentum}{later})"
        )

    def check_optimizer(self, optimizer) -> None:
        """Raise when the wrapped optimizer applies momentum too (momentum correction
        applies it here); with ``ef21`` unless it is SGD integrating the averaged
        differences: momentum 1, dampening 0, no Nesterov, no weight decay."""
        if not self.ef21:
            refuse_inner_momentum(self, optimizer)
            return
        need = {"momentum": 1.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}
        for group in optimizer.param_groups:
            got = {key: group.get(key) for key in need}
            if got != need:
                raise ValueError(
                    "block3lc ef21=True sends differences of the momentum estimate: the "
                    f"wrapped optimizer must be SGD with {need} (it adds them up), got {got}"
                )

    def absorb(self, name, delta) -> bool:
        """False with ``ef21``: its state is the estimate, not a residual to add to."""
        return False if self.ef21 else super().absorb(name, delta)

    def state_dict(self) -> dict:
        state = residual_state(self.memory, self._settings())
        if self.momentum:
            state["velocity"] = self.velocity.state_dict()
        if self.stochastic:
            state["steps"] = state_text(self.steps)
        return state

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress.checkpoint import CheckpointError

        state = dict(state)
        velocity = state.pop("velocity", None) if self.momentum else None
        if self.momentum and velocity is None:
            raise CheckpointError("block3lc state: missing 'velocity' (momentum correction)")
        steps = state.pop("steps", None) if self.stochastic else None
        if self.stochastic and steps is None:
            raise CheckpointError("block3lc state: missing 'steps' (stochastic rounding)")
        if steps is not None:
            steps = load_steps("block3lc steps", steps)
        load_residual_state(self.memory, self.name, state, self._settings())
        if velocity is not None:
            self.velocity.load_state_dict(velocity, what="block3lc velocity")
        if steps is not None:
            self.steps = steps

    def _settings(self) -> dict:
        settings = {"sparsity": self.sparsity, "block": self.block, "momentum": self.momentum}
        # the later options only where set, as in the repr: older checkpoints load
        if self.stochastic:
            settings.update(stochastic=True, seed=self.seed)
        if not self.error_feedback:
            settings["error_feedback"] = False
        if self.ef21:
            settings["ef21"] = True
        return settings

    def shard_alignment(self) -> int:
        return math.lcm(5, self.block)  # whole blocks, whole quartic bytes

    def max_numel(self, body_len, name):
        return blockq.max_numel(body_len, 1)  # the bound of every level (ternary's is largest)

    def contraction(self, numel):
        # none: a stochastic value far under delta leaves a residual near delta; ef21's
        # state is an estimate, not a residual
        if self.stochastic or self.ef21:
            return None
        # per block, the largest |a| = M leaves |M - delta q| = r M with q = rint(L / s):
        # ||a - decode||^2 <= ||a||^2 - (1 - r^2) M^2, M^2 >= ||a_b||^2 / block
        s, worst = self.sparsity, 1.0
        for levels in range(1, blockq.MAX_LEVELS + 1):
            q = min(levels, round(levels / s))
            worst = min(worst, 1.0 - (1.0 - s * q / levels) ** 2)
        n = min(numel, self.block)
        return worst / n if n else 1.0

    def encode(self, tensor, name):
        g = prim.f32_data(tensor).reshape(-1)
        # with ef21 the "residual" is -h: encode sends C(v - h) and leaves v - h - c in it
        e = self.memory.residual(name, g) if self.error_feedback else None
        levels = self.level(name)
        u = None
        if self.momentum and prim.all_finite(g):  # a non-finite g leaves u untouched
            u = self.velocity.residual(name, g)
            u.mul_(self.momentum).add_(g)
            g = u
        body, bad, q = blockq.encode(g, e, self.sparsity, levels, self.block, self._noise(name, g))
        if self.ef21:
            if not bad:
                e.sub_(g)  # -h - c: the estimate moved by what was sent
        elif u is not None and q is not None:
            u.masked_fill_(q.to(u.device) != 0, 0.0)  # momentum factor masking
        params = blockq.PARAMS.pack(self.sparsity, levels, self.block)
        return Encoded(wire.FLAG_NONFINITE if bad else 0, params, body)

    def _noise(self, name, g):
        """Stochastic rounding's uniforms for this tensor's next payload (None without):
        the next step of its stream, the step counted whether or not g is finite."""
        if not self.stochastic:
            return None
        _, _, key = next_stream_key(self.steps, self.seed, self.rank, name)
        return prim.uniform(key, g.numel(), g.device)

    def check_params(self, header, name):
        check_params_len(self, header, blockq.PARAMS.size)
        sparsity, levels, block = blockq.PARAMS.unpack(header.params)
        check_agreed("sparsity", float(np.float32(self.sparsity)), sparsity)
        check_agreed("levels", self.level(name), levels)
        check_agreed("block", self.block, block)

    def decode_into(self, header, body, out, accumulate, side_info):
        _, levels, block = blockq.PARAMS.unpack(header.params)
        if not 1 <= levels <= blockq.MAX_LEVELS:
            raise PayloadError("levels", f"expected levels in [1, {blockq.MAX_LEVELS}]")
        blockq.decode_into(body, header.numel, levels, block, out, accumulate)
