"""NDQSG compressor (docs/codecs.md, "NDQSG": who sends what, the side information and
the aliasing metrics), codec in hvdcompress.codecs.ndqsg.

Of N ranks, the first ``ceil(N * dqsg_fraction)`` (at least one) send plain DQSG payloads
with the fine levels s1; the others send the nested code m (about log2(rho) bits per value
instead of log2(2 s1 + 1)), decoded with side information y: the mean of the gradients
already decoded in this step, senders in rank order (the optimizer's gather path passes
it). Every rank decodes the same bytes in the same order, so every rank gets the same y
and bit-identical results. Aliasing (a nested value decoded to the wrong point of its
coset) is counted two ways, ``aliasing_rate_estimate`` and ``aliasing_rate_own``, both
reset by ``pop_metrics()``. No error feedback (the dithered quantiser is unbiased).
"""

from __future__ import annotations

import math
import struct

import torch

from hvdcompress.codecs import dqsg, ndqsg, quant
from hvdcompress.codecs import primitives as prim
from hvdcompress.compressors.base import check_agreed
from hvdcompress.compressors.params import RANK, SEED, Param
from hvdcompress.compressors.quant import BUCKET, LEVELS
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.compressors.stochastic import Stochastic, encoded, with_fields
from hvdcompress.errors import PayloadError

# fine levels, coarse levels, bucket size, dqsg_fraction, mode (0 DQSG, 1 nested)
PARAMS = struct.Struct("<IIIdB")
MODE_DQSG, MODE_NESTED = 0, 1


@register(
    CompressorSpec(
        name="ndqsg",
        wire_id=3,
        params={
            "fine_levels": LEVELS,
            "coarse_levels": LEVELS,
            "bucket_size": BUCKET,
            "dqsg_fraction": Param(0.0, 1.0, low_open=True),
            "seed": SEED,
            "rank": RANK,
        },
        examples=(
            {"bucket_size": 64},
            {"fine_levels": 8, "coarse_levels": 2},
            {"fine_levels": 6, "coarse_levels": 1},
        ),
        benchmarks=({},),
    )
)
class NDQSG(Stochastic):
    """Nested dithered quantisation: fine levels s1 = ``fine_levels`` (default 3), coarse
    s2 = ``coarse_levels`` (default 1; rho = s1 / s2 an integer >= 2), a delta per
    ``bucket_size`` (default 512) elements, the first ``ceil(N * dqsg_fraction)`` ranks
    (``dqsg_fraction`` in (0, 1], default 0.5) sending plain DQSG."""

    error_feedback = False
    uses_side_info = True  # the gather path passes side_info (see module doc)
    recompressible = False  # decoding needs the lower ranks' decoded tensors

    def __init__(
        self,
        fine_levels: int = 3,
        coarse_levels: int = 1,
        bucket_size: int = 512,
        dqsg_fraction: float = 0.5,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        self.rho = ndqsg.check_levels(fine_levels, coarse_levels)
        self.fine_levels = int(fine_levels)
        self.coarse_levels = int(coarse_levels)
        self.bucket_size = quant.check_bucket(bucket_size, "ndqsg")
        self.dqsg_fraction = float(dqsg_fraction)
        if not 0.0 < self.dqsg_fraction <= 1.0:
            raise ValueError(f"ndqsg dqsg_fraction must be in (0, 1], got {dqsg_fraction!r}")
        self.size = 1
        self._init_rng(seed, rank)
        self._sent: dict[int, tuple[int, torch.Tensor]] = {}  # tensor id -> (step, k)
        self._counts = {"estimate": [0, 0], "own": [0, 0]}
        self.last_aliasing_rate: float | None = None

    def bind(self, rank: int, size: int) -> None:
        super().bind(rank, size)
        if isinstance(size, bool) or int(size) != size or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.size = int(size)

    @property
    def dqsg_ranks(self) -> int:
        """D: ranks 0 .. D-1 send plain DQSG."""
        return max(1, math.ceil(self.size * self.dqsg_fraction))

    def mode_of(self, rank: int) -> int:
        return MODE_NESTED if rank >= self.dqsg_ranks else MODE_DQSG

    def _config(self) -> tuple:
        """What every rank's header must carry: fine, coarse levels, bucket_size, fraction."""
        return (self.fine_levels, self.coarse_levels, self.bucket_size, self.dqsg_fraction)

    # ---- encode ---------------------------------------------------------------------------
    def encode_bucket(self, tensors, names):
        s1, bucket, mode = self.fine_levels, self.bucket_size, self.mode_of(self.rank)
        fields = PARAMS.pack(*self._config(), mode)
        if mode == MODE_DQSG:  # DQSG's one-call encoder: these ranks send DQSG's bodies
            return self._encode_bucket_with(
                tensors, names, lambda ws, keys: dqsg.encode_segments(ws, s1, bucket, keys),
                with_fields(fields),
            )  # fmt: skip

        def payload(rng: bytes, coded, device):
            if coded is not None:  # keep k, for this rank's own aliasing rate (_own_k)
                _, step, tid, _ = prim.RNG_PARAMS.unpack_from(rng, 0)
                self._sent[tid] = (step, coded[1])
            return encoded(rng + fields, None if coded is None else coded[0], device)

        return self._encode_bucket_with(
            tensors, names,
            lambda ws, keys: ndqsg.encode_nested_segments(ws, s1, self.rho, bucket, keys),
            payload,
        )  # fmt: skip

    # ---- decode ---------------------------------------------------------------------------
    def check_params(self, header, name):
        *theirs, mode = self._checked_fields(header, name, PARAMS)
        check_agreed("levels", self._config(), tuple(theirs))
        sender = prim.RNG_PARAMS.unpack_from(header.params, 0)[3]
        if mode != self.mode_of(sender):
            raise PayloadError(
                "mode",
                f"rank {sender} of {self.size} sends mode {self.mode_of(sender)}, payload has "
                f"{mode} (ranks disagree on the world size or dqsg_fraction)",
            )

    def max_numel(self, body_len, name):
        # the larger of the two codes' bounds (the mode is not known here)
        return max(dqsg.max_numel(body_len, self.fine_levels), ndqsg.max_numel(body_len, self.rho))

    @staticmethod
    def _side_info(y, n: int, device) -> torch.Tensor | None:
        if y is None:
            return None
        if not isinstance(y, torch.Tensor):
            raise TypeError(f"side_info must be a tensor, got {type(y).__name__}")
        if y.numel() != n:
            raise PayloadError("numel", f"the payload has {n} elements, its side_info {y.numel()}")
        return y.reshape(-1).to(device=device, dtype=torch.float32)

    def decode_into(self, header, body, out, accumulate, side_info):
        key = self._stream_key(header.params)
        sender = prim.RNG_PARAMS.unpack_from(header.params, 0)[3]
        mode = PARAMS.unpack_from(header.params, prim.RNG_PARAMS.size)[4]
        n, s1, bucket = header.numel, self.fine_levels, self.bucket_size
        y = self._side_info(side_info, n, out.device)
        if mode == MODE_DQSG:
            # DQSG's own decoder: its checks, then delta * (q - u) written or added
            q, deltas = dqsg.decode_q(body, n, s1, bucket)
            if y is not None and sender > 0 and n:  # estimate: would the nested code alias?
                m = ndqsg.coset(q, self.rho)
                bad = ndqsg.side_decode_into(m, deltas, y, self.rho, bucket, key, None, False, q)
                self._count("estimate", bad, n)
            dqsg.dequantize_into(q, deltas, bucket, key, out, accumulate)
            return
        m, deltas = ndqsg.decode_m(body, n, self.rho, bucket)
        if y is None:
            raise PayloadError(
                "side_info",
                f"a nested payload (rank {sender}) decodes only with side information: "
                "the mean of the lower ranks' decoded tensors (the optimizer passes it)",
            )
        if n == 0:
            return
        k_true = self._own_k(header.params, n)  # its own payload: how many indices alias
        bad = ndqsg.side_decode_into(m, deltas, y, self.rho, bucket, key, out, accumulate, k_true)
        if k_true is not None:
            self._count("own", bad, n)

    # On a GPU: DQSG's launch sequence for DQSG-mode frames without side information, the
    # nested bucket decoder's for nested ones with it, the per-payload decoders (on the
    # device) for the rest.
    cuda_decode_segments = True

    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank=None):
        modes = {p[-1] for p in params}  # the mode byte ends the params (checked)
        keys = [self._stream_key(p) for p in params]
        if not rank and modes == {MODE_DQSG}:  # no side information: DQSG's decode
            return dqsg.decode_segments(
                frame, starts, lens, numels, self.fine_levels, self.bucket_size, keys, outs
            )
        if not rank or modes != {MODE_NESTED}:
            # DQSG-mode payloads of ranks 1 .. D-1 (each re-decoded for the aliasing
            # estimate), and nested ones without side information ("side_info")
            return super().decode_segments(frame, params, starts, lens, numels, outs, names, rank)
        owns = [self._own_k(p, int(n)) for p, n in zip(params, numels.tolist(), strict=True)]
        aliased, failed = ndqsg.decode_segments(
            frame, starts, lens, numels, self.rho, self.bucket_size, keys, rank, outs, owns
        )
        done = len(outs) if failed is None else failed[0]
        for k, bad, n in zip(owns[:done], aliased.tolist(), numels.tolist(), strict=False):
            if k is not None and n:
                self._count("own", bad, n)
        return failed

    def _own_k(self, params: bytes, n: int) -> torch.Tensor | None:
        """The fine indices k this rank sent in the payload with these RNG fields (its own
        nested payload of this step), else None."""
        _, step, tid, sender = prim.RNG_PARAMS.unpack_from(params, 0)
        sent = self._sent.get(tid) if sender == self.rank else None
        return sent[1] if sent is not None and sent[0] == step and sent[1].numel() == n else None

    # ---- metrics ---------------------------------------------------------------------------
    def _count(self, which: str, bad: int, total: int) -> None:
        c = self._counts[which]
        c[0] += bad
        c[1] += total

    def pop_metrics(self) -> dict:
        """Aliasing rates since the last call (docs/codecs.md, "NDQSG"), then reset them."""
        rates = {
            f"aliasing_rate_{k}": (c[0] / c[1] if c[1] else None) for k, c in self._counts.items()
        }
        self._counts = {"estimate": [0, 0], "own": [0, 0]}
        est, own = rates["aliasing_rate_estimate"], rates["aliasing_rate_own"]
        self.last_aliasing_rate = est if est is not None else own
        self._sent.clear()
        return rates
