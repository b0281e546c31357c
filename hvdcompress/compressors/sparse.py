"""Top-k, random-k, top-k + sign and magnitude-proportional sparsification compressors
(docs/baselines.md), codecs in hvdcompress.codecs.sparse. TopKSign ("topkq") and GSpar
("gspar") are the compressors CAT tunes besides top-k (docs/policies.md, "CAT").

Top-k always uses error feedback: the residual keeps every entry that was not sent
(e = a with the kept entries zeroed, a = g + e). Random-k's and gspar's are optional
(``error_feedback=True``) and then send the kept values unscaled (a contractive
compressor, so the residual stays bounded; the 1/p-scaled values made it diverge):
e = a - decode(payload) = a with the kept entries zeroed. Non-finite input travels as
the flag (decode gives all NaN) and leaves the residual untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct

import torch

from hvdcompress import framing, wire
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import sparse
from hvdcompress.compressors.base import Encoded, GatherCompressor, check_agreed, check_params_len
from hvdcompress.compressors.levels import PerTensorLevels, TensorLevels
from hvdcompress.compressors.memory import ErrorFeedback, load_residual_state, residual_state
from hvdcompress.compressors.params import FLAG, RANK, SEED, Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.compressors.stochastic import Stochastic, encoded

TOPK_PARAMS = struct.Struct("<d")  # ratio
RANDOMK_PARAMS = struct.Struct("<dB")  # ratio, unbiased (after the RNG fields)
RATIO = Param(0.0, 1.0, low_open=True)


def ratio_levels(comp) -> TensorLevels:
    """Per-tensor ``ratio`` (set by a policy), carried in the header and checked on decode."""
    return TensorLevels(comp.ratio, functools.partial(sparse.check_ratio, name=comp.name))


class TopKLayout(GatherCompressor):
    """Decoding bodies in top-k's layout (TopK, DGC; TopKSign sets its own codec functions):
    k = topk_count(n, the payload's ``kept_ratio``), checked by ``check_params``."""

    cuda_decode_segments = True  # the codec's bucket decoder: kernels/sparse.cu
    decode_kept_into = staticmethod(sparse.topk_decode_into)
    decode_kept_segments = staticmethod(sparse.topk_decode_segments)

    def decode_into(self, header, body, out, accumulate, side_info):
        k = sparse.topk_count(header.numel, self.kept_ratio(header.params))
        self.decode_kept_into(body, header.numel, k, out, accumulate)

    def decoded_bound(self, header, body):
        return sparse.topk_values_bound(body, header.numel)

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        ks = sparse.topk_counts(numels, map(self.kept_ratio, params))
        return self.decode_kept_segments(frame, starts, lens, numels, ks, outs)


@register(
    CompressorSpec(
        name="topk",
        wire_id=4,
        params={"ratio": RATIO},
        examples=({"ratio": 0.05},),
        benchmarks=({"ratio": 0.01},),
        cat_kind="topk",
        level_param="ratio",
    )
)
class TopK(PerTensorLevels, TopKLayout):
    """Keep the ``ratio`` fraction (default 0.01) of entries of largest |g + e|; a policy
    may set it per tensor (``set_level(name, ratio)``), the header carries it."""

    error_feedback = True

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = sparse.check_ratio(ratio, "topk")
        self.levels = ratio_levels(self)
        self.memory = ErrorFeedback()

    encode_segments = staticmethod(sparse.topk_encode_segments)  # TopKSign sets its own

    def encode_bucket(self, tensors, names):
        gs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({g.device for g in gs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        es = [self.memory.residual(name, g) for g, name in zip(gs, names, strict=True)]
        ratios = [self.level(name) for name in names]
        ks = [sparse.topk_count(g.numel(), r) for g, r in zip(gs, ratios, strict=True)]
        bodies, nonfinite = self.encode_segments(gs, es, ks)
        return [
            Encoded(wire.FLAG_NONFINITE if bad else 0, TOPK_PARAMS.pack(r), body)
            for body, bad, r in zip(bodies, nonfinite, ratios, strict=True)
        ]

    def state_dict(self) -> dict:
        return residual_state(self.memory, {"ratio": self.ratio})

    def load_state_dict(self, state: dict) -> None:
        load_residual_state(self.memory, self.name, state, {"ratio": self.ratio})

    def contraction(self, numel):
        # keeping the k largest leaves at most (1 - k / n) of ||a||^2 (Stich et al. 2018)
        return sparse.topk_count(numel, self.ratio) / numel if numel else 1.0

    def check_params(self, header, name):
        check_params_len(self, header, TOPK_PARAMS.size)
        check_agreed("ratio", self.level(name), TOPK_PARAMS.unpack(header.params)[0])

    def max_numel(self, body_len, name):
        k = body_len // 8  # each kept value costs at least 4 + 4 bytes
        return math.floor((k + 1) / self.level(name)) + 1

    def kept_ratio(self, params):
        return TOPK_PARAMS.unpack(params)[0]


@register(dataclasses.replace(TopK.spec, name="topkq", wire_id=11, cat_kind="topk+q"))
class TopKSign(TopK):
    """Top-k selection sent as one shared magnitude, indices and sign bits (Basu et al.,
    NeurIPS 2019): ``ratio`` as top-k's. Error feedback: e = a - decode(payload)."""

    decode_kept_into = staticmethod(sparse.topk_sign_decode_into)
    encode_segments = staticmethod(sparse.topk_sign_encode_segments)
    decode_kept_segments = staticmethod(sparse.topk_sign_decode_segments)

    def decoded_bound(self, header, body):
        return sparse.topk_sign_bound(body)

    def contraction(self, numel):
        # ||a_S - m sign(a_S)||^2 = ||a_S||^2 - k m^2 and k m^2 = (sum |a_S|)^2 / k
        # >= ||a_S||^2 / k >= ||a||^2 / n (the top k hold at least k / n of ||a||^2)
        return 1.0 / numel if numel else 1.0

    def max_numel(self, body_len, name):
        k = max(body_len - 4, 0) * 8 // 33  # each kept value costs at least 32 + 1 bits
        return math.floor((k + 1) / self.level(name)) + 1


def bucket_residuals(comp, gs: list[torch.Tensor], names: list) -> list[torch.Tensor] | None:
    """Each tensor's residual (created as zeros on first use) with ``comp``'s error
    feedback, else None: what the seeded sparsifiers' one-call bucket encoders take."""
    if not comp.error_feedback:
        return None
    return [comp.memory.residual(name, g) for g, name in zip(gs, names, strict=True)]


def load_seeded_sparse_state(comp, state: dict) -> None:
    """Load the ``state_dict`` of a seeded sparsifier (RandomK, GSpar: ratio, residuals
    and the RNG state), every part checked before any is loaded."""
    from hvdcompress.checkpoint import check_keys, check_saved_value, check_tensor_map

    check_keys(f"{comp.name} state", state, required=("ratio", "residuals", "seed", "steps"))
    check_saved_value("ratio", state["ratio"], comp.ratio)
    what = f"{comp.name} residuals"
    check_tensor_map(what, state["residuals"])  # checked before the steps are loaded
    comp._load_rng_state(state)
    comp.memory.load_state_dict(state["residuals"], what=what)


@register(
    CompressorSpec(
        name="randomk",
        wire_id=5,
        params={
            "ratio": RATIO,
            "unbiased": Param(kind="bool", optional=True, doc="None: not error_feedback"),
            "error_feedback": Param(kind="bool", optional=True, doc="None: not unbiased"),
            "seed": SEED,
            "rank": RANK,
        },
        examples=({"ratio": 0.1, "unbiased": True}, {"ratio": 0.5, "error_feedback": True}),
        benchmarks=({"ratio": 0.01},),
        # Memory delays a value about 1 / p steps and sends it at once: on this project's job
        # (docs/codecs.md, "Defaults that train") the inner SGD diverged with momentum 0.9 and
        # trained without momentum at a fifth of the learning rate.
        sgd_lr_factor=0.2,
        sgd_momentum=0.0,
    )
)
class RandomK(Stochastic):
    """Keep each entry with probability ``ratio`` (indices regenerated from the seed, not
    sent); ``unbiased`` scales the kept values by 1 / ratio; optional error feedback.

    By default the memory version of Stich et al. 2018: error feedback, the kept values
    unscaled (a contractive compressor, delta = p; Karimireddy et al. 2019). The unbiased
    1 / p scaling has E||a - decode||^2 = (1 / p - 1) ||a||^2: without error feedback it
    needs a learning rate about p times smaller, and with it the residual grows by that
    factor each step when p < 1/2, so ``unbiased=True`` with ``error_feedback=True`` is
    refused. Left None, each of the two is the other's negation (both None: memory)."""

    cuda_decode_segments = True  # sparse.randomk_decode_segments: kernels/quant.cu

    def __init__(
        self,
        ratio: float = 0.01,
        unbiased: bool | None = None,
        error_feedback: bool | None = None,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        self.ratio = sparse.check_ratio(ratio, "randomk")
        if error_feedback is None:
            error_feedback = not unbiased if unbiased is not None else True
        self.error_feedback = bool(FLAG.check("randomk", "error_feedback", error_feedback))
        self.unbiased = not self.error_feedback if unbiased is None else bool(unbiased)
        if self.unbiased and self.error_feedback:
            raise ValueError(
                "randomk: error_feedback=True needs unbiased=False (or None): the 1/p-scaled "
                "values are not a contractive compressor and the residual diverges"
            )
        self.memory = ErrorFeedback()
        self._scale = sparse.randomk_scale(self.ratio, self.unbiased)
        self._init_rng(seed, rank)

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "residuals": self.memory.state_dict(), **super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_seeded_sparse_state(self, state)

    def encode_bucket(self, tensors, names):
        gs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({g.device for g in gs}) != 1:  # none, or several devices
            return super().encode_bucket(tensors, names)
        es = bucket_residuals(self, gs, names)
        rngs = [self._rng_params(name) for name in names]  # steps advance as in encode
        fields = RANDOMK_PARAMS.pack(self.ratio, int(self.unbiased))
        bodies, nonfinite = sparse.randomk_encode_segments(gs, [k for _, k in rngs], self.ratio, es)
        return [
            encoded(rng + fields, None if bad else body, g.device)
            for g, (rng, _), body, bad in zip(gs, rngs, bodies, nonfinite, strict=True)
        ]

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        keys = [self._stream_key(p) for p in params]  # accepts_bucket checked the fields
        return sparse.randomk_decode_segments(
            frame, starts, lens, numels, keys, self.ratio, self._scale, outs
        )

    def contraction(self, numel):
        if not self.error_feedback:
            return None
        return sparse.randomk_threshold(self.ratio) / sparse.RANDOMK_ONE  # p

    def check_params(self, header, name):
        theirs = self._checked_fields(header, name, RANDOMK_PARAMS)
        check_agreed("ratio", (self.ratio, int(self.unbiased)), theirs)  # (ratio, unbiased)

    def max_numel(self, body_len, name):
        # A legitimate payload keeps far more than n p / 16 - 64 values (Chernoff): a
        # header claiming more elements is forged. Bounds the allocation.
        p = sparse.randomk_threshold(self.ratio) / sparse.RANDOMK_ONE
        return math.ceil((body_len // 4 + 64) * 16 / p)

    def decode_into(self, header, body, out, accumulate, side_info):
        key, n = self._stream_key(header.params), header.numel
        sparse.randomk_decode_into(body, key, n, self.ratio, self._scale, out, accumulate)

    def decode_new(self, header, body, side_info):
        key, n = self._stream_key(header.params), header.numel
        flat = framing.new_float32(n, body.device, 0.0)
        sparse.randomk_decode_into(body, key, n, self.ratio, self._scale, flat, False, fresh=True)
        return flat

    def decoded_bound(self, header, body):
        return sparse.randomk_decoded_bound(body, self._scale)


@register(
    CompressorSpec(
        name="gspar",
        wire_id=12,
        params={
            "ratio": RATIO,
            "error_feedback": FLAG,
            "variance": Param(
                0.0, None, low_open=True, optional=True, doc="None: the ratio budget"
            ),
            "seed": SEED,
            "rank": RANK,
        },
        examples=(
            {"ratio": 0.1},
            {"ratio": 0.2, "error_feedback": True},
            {"variance": 1.0},
            {"variance": 0.25, "error_feedback": True},
        ),
        benchmarks=({"ratio": 0.01},),
        cat_kind="randomk",
        level_param="ratio",
        # a_i / p_i has variance sum (1 / p_i - 1) a_i^2, about ||a||_1 / c: at ratio 0.01 the
        # job's SGD diverged, and trained at a tenth of its learning rate (docs/codecs.md,
        # "Defaults that train")
        sgd_lr_factor=0.1,
        sgd_own_rate_with="variance",  # a bounded variance trains at SGD's own rate
    )
)
class GSpar(PerTensorLevels, Stochastic, TopKLayout):
    """Keep entry i with probability p_i = min(1, c |a_i|), sum p_i = ``ratio`` * n in
    expectation, send a_i / p_i with its index (Wangni et al., NeurIPS 2018): unbiased,
    E[decode] = a. Optional error feedback: then a_i travels unscaled (contractive, so the
    residual e = a - decode stays bounded; biased like top-k). A policy may set ``ratio``
    per tensor (``set_level``); the header carries it. Top-k's layout, k from the body's
    length (``decode_into``, ``decode_segments``).

    ``variance`` (epsilon) is the paper's own budget instead: each tensor keeps the fewest
    expected entries whose estimate has E||decode - a||^2 <= epsilon ||a||^2
    (``sparse.gspar_variance_budget``), so the kept count follows the gradient's shape and
    SGD runs at its usual learning rate (docs/codecs.md, "Defaults that train"). The
    payload is the ratio budget's with that T (the header still carries ``ratio``, which
    a variance budget leaves unused: decoding does not depend on the budget); no policy
    may set levels then."""

    def __init__(
        self,
        ratio: float = 0.01,
        error_feedback: bool = False,
        variance: float | None = None,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        self.ratio = sparse.check_ratio(ratio, "gspar")
        self.levels = ratio_levels(self)
        self.error_feedback = bool(error_feedback)
        self.variance = variance
        if variance is not None:  # bounded variance: SGD's own rate (docs/codecs.md)
            self.variance = float(self.spec.params["variance"].check("gspar", "variance", variance))
        self.memory = ErrorFeedback()
        self._init_rng(seed, rank)

    def set_level(self, name: str, value) -> None:
        if self.variance is not None and value != self.ratio:  # the exchange sets shards'
            raise ValueError(
                f"gspar: variance={self.variance} sets every tensor's budget; a policy "
                "cannot set its ratio (build it without variance for CAT)"
            )
        super().set_level(name, value)

    def state_dict(self) -> dict:
        return {"ratio": self.ratio, "residuals": self.memory.state_dict(), **super().state_dict()}

    def load_state_dict(self, state: dict) -> None:
        load_seeded_sparse_state(self, state)

    def encode_bucket(self, tensors, names):
        gs = [prim.f32_data(t) for t in tensors]  # addresses and sizes only
        if len({g.device for g in gs}) != 1:  # none, or on several devices
            return super().encode_bucket(tensors, names)
        es = bucket_residuals(self, gs, names)
        rngs = [self._rng_params(name) for name in names]  # steps advance as in encode
        ratios = [self.level(name) for name in names]
        if self.variance is None:
            budgets = [r * g.numel() for r, g in zip(ratios, gs, strict=True)]
        else:  # of what is encoded: a = g + e with error feedback
            sources = gs if es is None else [g.reshape(-1) + e for g, e in zip(gs, es, strict=True)]
            budgets = [sparse.gspar_variance_budget(a, self.variance) for a in sources]
        bodies, nonfinite = sparse.gspar_encode_segments(gs, [k for _, k in rngs], budgets, es)
        return [
            Encoded(wire.FLAG_NONFINITE if bad else 0, rng + TOPK_PARAMS.pack(r), body)
            for (rng, _), r, body, bad in zip(rngs, ratios, bodies, nonfinite, strict=True)
        ]

    def contraction(self, numel):
        if not self.error_feedback:
            return None
        # E||a - C(a)||^2 = sum (1 - p_i) a_i^2 and p_i grows with |a_i|, so by Chebyshev's
        # sum inequality sum p_i a_i^2 >= (sum p_i / n) ||a||^2 = ratio ||a||^2 (the smallest
        # level a policy may set is not known here: the default ratio is declared). With a
        # variance budget, 1 - p_i <= 1 / p_i - 1 bounds it by the budget: delta >= 1 - eps
        if self.variance is not None:
            return 1.0 - self.variance if self.variance < 1.0 else None
        return min(1.0, self.ratio)

    def check_params(self, header, name):
        (ratio,) = self._checked_fields(header, name, TOPK_PARAMS)
        check_agreed("ratio", self.level(name), ratio)

    def max_numel(self, body_len, name):
        # No bound from the body: a gradient with no more non-zeros than the budget keeps
        # all of them (c = inf), so an all-zero tensor of any size sends an empty body.
        # What limits a decode is the receiver's bound (its expected tensor, its output,
        # or max_numel), checked before anything is allocated (docs/baselines.md).
        return wire.MAX_SHAPE_PRODUCT

    def decode_into(self, header, body, out, accumulate, side_info):
        sparse.gspar_decode_into(body, header.numel, out, accumulate)

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        return sparse.gspar_decode_segments(frame, starts, lens, numels, outs)
