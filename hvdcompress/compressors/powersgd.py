"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019, arXiv 1905.13727; docs/baselines.md,
"PowerSGD": the seeded Q, Gram-Schmidt, rank changes): rank-r approximation by one
power iteration, warm-started, with error feedback.

A summable compressor in two phases (``phases = 2``; hvdcompress.optimizer runs one
allreduce per phase and bucket, P then Q). Per tensor of two or more dimensions, viewed as
an n x m matrix (first dimension by the rest), r = min(``matrix_rank``, n, m):

    M = g + e                       # e: error-feedback residual (float32)
    phase 1: send P = M Q ;  P_sum = allreduce(P)
    phase 2: P_hat = orthogonalise(P_sum) ;  send Q_i = M^T P_hat ;  Q_sum = allreduce(Q_i)
    decompress: P_hat Q_sum^T  (= P_hat P_hat^T sum_i M_i; the optimizer divides by N)
    e = M - P_hat Q_i^T             # local error feedback (paper, Algorithm 2)
    Q = Q_sum                       # warm start of the next step: the same on every rank

Memory speed: M is formed in a work buffer kept per tensor, the new residual is computed in
place in it (``addmm_``) and swapped with the old one, and the average is written straight
into the gradient with the 1/N folded into P_hat (``decompress_into``): per step, one pass
over M to form it, one to turn it into e, one to write the gradient, and no temporary of
the gradient's size (each fresh one costs page faults on top of its bandwidth).

Tensors of fewer than two dimensions (biases, scalars) and empty ones travel as they are
(float32) in phase 1. Non-finite input decodes to NaN for every rank (the sum carries it),
leaves e untouched and keeps the previous Q. Q and e are in ``state_dict``.
"""

from __future__ import annotations

import math

import torch

from hvdcompress.codecs import primitives as prim
from hvdcompress.compressors.base import Ctx, SummableCompressor
from hvdcompress.compressors.levels import PerTensorLevels, TensorLevels
from hvdcompress.compressors.memory import ErrorFeedback
from hvdcompress.compressors.params import SEED, Param
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec

MAX_RANK = 64
RELATIVE_FLOOR = 1e-4


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Columns of the (n, r) float32 ``p`` made orthonormal by modified Gram-Schmidt, in
    column order; a column whose norm falls below ``RELATIVE_FLOOR`` of its original norm
    once the previous columns are projected out (numerically in their span, as when the
    gradient has rank < r) becomes zero instead of normalised rounding noise."""
    p = p.clone()
    original = torch.linalg.vector_norm(p, dim=0)
    for i in range(p.shape[1]):
        col = p[:, i]
        norm = torch.linalg.vector_norm(col)
        keep = norm > original[i] * RELATIVE_FLOOR
        col.mul_(torch.where(keep, 1.0 / norm, torch.zeros_like(norm)))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest -= col[:, None] * (col @ rest)[None, :]
    return p


def check_matrix_rank(value) -> int:
    if isinstance(value, bool) or int(value) != value or not (1 <= value <= MAX_RANK):
        raise ValueError(f"powersgd matrix_rank must be an int in [1, {MAX_RANK}], got {value!r}")
    return int(value)


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    return (n, m) if n and m else None


@register(
    CompressorSpec(
        name="powersgd",
        params={"matrix_rank": Param(1, MAX_RANK, kind="int"), "seed": SEED},
        examples=({"matrix_rank": 1}, {"matrix_rank": 2}),
        benchmarks=({"matrix_rank": 2},),
        level_param="matrix_rank",
    )
)
class PowerSGD(PerTensorLevels, SummableCompressor):
    """Rank-``matrix_rank`` PowerSGD (an int in [1, 64], default 1; the paper uses 1, 2, 4)
    with one warm-started power iteration and error feedback; ``seed`` picks the initial Q.
    A policy may set the rank per tensor (``set_level(name, r)``, the same on every rank):
    the warm-started Q keeps its first columns and gains seeded ones, the residual stays."""

    error_feedback = True
    phases = 2

    def __init__(self, matrix_rank: int = 1, seed: int = 0) -> None:
        self.matrix_rank = check_matrix_rank(matrix_rank)
        self.levels = TensorLevels(self.matrix_rank, check_matrix_rank)
        self.seed = prim.check_seed(seed)
        self.memory = ErrorFeedback()
        self.qs: dict[str, torch.Tensor] = {}
        self._pending: dict[str, tuple] = {}
        self._work: dict[str, torch.Tensor] = {}  # per matrix: where M = g + e is formed

    def _seeded_q(self, name: str, cols: int, r: int) -> torch.Tensor:
        """A tensor's initial Q: standard normal on the CPU, seeded by (seed, its name)."""
        gen = torch.Generator().manual_seed((self.seed ^ prim.tensor_id(name)) & (2**63 - 1))
        return torch.randn(cols, r, generator=gen, dtype=torch.float32)

    # ---- the two phases ---------------------------------------------------------------------
    def _q(self, name: str, cols: int, r: int, device) -> torch.Tensor:
        q = self.qs.get(name)
        if q is not None and name in self.levels and q.dim() == 2 and q.shape[0] == cols:
            if q.shape[1] != r:  # the policy switched this tensor's rank: same on every rank
                fresh = self._seeded_q(name, cols, r).to(q.device)
                keep = min(r, q.shape[1])
                fresh[:, :keep] = q[:, :keep]
                q = self.qs[name] = fresh
        if q is None:
            q = self.qs[name] = self._seeded_q(name, cols, r).to(device)
        elif q.shape != (cols, r):
            raise ValueError(
                f"tensor {name!r}: saved Q has shape {tuple(q.shape)}, expected {(cols, r)}"
            )
        elif q.device != device:
            q = self.qs[name] = q.to(device)
        return q

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Ctx]:
        """Phase 1: P = (g + e) Q, or the tensor itself when it is not a matrix."""
        ctx = Ctx(name, tuple(tensor.shape), tensor.dtype, tensor.device)
        g = prim.flat_f32(tensor)
        shape = _matrix_shape(ctx.shape)
        if shape is None:
            self._pending[name] = None
            return g.clone(), ctx
        n, cols = shape
        r = min(self.level(name), n, cols)
        e = self.memory.residual(name, g)
        work = self._work.get(name)
        if work is None or work.shape != e.shape or work.device != e.device:
            work = self._work[name] = torch.empty_like(e)
        m = torch.add(g, e, out=work).view(n, cols)
        p = m @ self._q(name, cols, r, m.device)
        self._pending[name] = (m, r)
        return p.reshape(-1), ctx

    def next_phase(self, summed: torch.Tensor, ctx: Ctx, phase: int = 1) -> torch.Tensor:
        """Phase 2 from the allreduced phase-1 payload: Q_i = M^T orthogonalise(P_sum)."""
        pending = self._pending.get(ctx.name, "missing")
        if isinstance(pending, str):
            raise RuntimeError(f"powersgd: next_phase({ctx.name!r}) before compress")
        if pending is None:  # not a matrix: the sum is the result
            self._pending[ctx.name] = ("done", summed)
            return summed.new_empty(0)
        m, r = pending
        p_hat = orthogonalize(summed.view(m.shape[0], r).to(torch.float32))
        q_local = m.t() @ p_hat
        self._pending[ctx.name] = (m, r, p_hat, q_local)
        return q_local.reshape(-1)

    def decompress(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """The sum over ranks (P_hat Q_sum^T) from the allreduced phase-2 payload."""
        return self.decompress_exact(payload, ctx).to(ctx.dtype)

    def decompress_exact(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return self._finish(payload, ctx, None, 1.0).view(ctx.shape)

    def decompress_into(
        self, payload: torch.Tensor, ctx: Ctx, out: torch.Tensor, scale: float
    ) -> bool:
        """``scale`` x P_hat Q_sum^T written into the contiguous float32 ``out``: one pass."""
        if (
            out.dtype != torch.float32
            or not out.is_contiguous()
            or out.numel() != math.prod(ctx.shape)
        ):
            return False
        self._finish(payload, ctx, out, scale)
        return True

    def _finish(self, payload, ctx: Ctx, out: torch.Tensor | None, scale: float):
        """The average (``out`` given: written there, times ``scale``) or the sum (a new
        tensor), the residual and the next warm start from the phase-2 sum ``payload``."""
        pending = self._pending.pop(ctx.name, None)
        if pending is None or (len(pending) == 2 and pending[0] != "done"):  # no next_phase yet
            raise RuntimeError(f"powersgd: decompress({ctx.name!r}) before next_phase")
        if len(pending) == 2:  # not a matrix: the sum is the result
            if out is None:
                return pending[1]
            return torch.mul(pending[1], scale, out=out.view(-1))
        m, r, p_hat, q_local = pending
        q_sum = payload.view(m.shape[1], r).to(torch.float32)
        if out is None:
            approx = p_hat @ q_sum.t()
        else:
            approx = torch.mm(
                p_hat * scale if scale != 1.0 else p_hat, q_sum.t(), out=out.view(m.shape)
            )
        if prim.all_finite(m):
            # e = M - P_hat Q_i^T, in M's own buffer, which becomes the residual; the
            # old residual's buffer is where the next step forms M
            m.addmm_(p_hat, q_local.t(), alpha=-1.0)
            self._work[ctx.name] = self.memory.swap(ctx.name, m.view(-1))
        if prim.all_finite(q_sum):
            # A zero column of Q_sum (a zero gradient, e.g. a parameter unused in a step,
            # or a column Gram-Schmidt dropped) would stay zero for ever (P = M Q = 0):
            # it keeps its previous value instead, the same on every rank.
            old = self.qs.get(ctx.name)
            if old is not None and old.shape == q_sum.shape:
                zero = (q_sum == 0).all(dim=0)
                q_sum = torch.where(zero[None, :], old, q_sum)
            self.qs[ctx.name] = q_sum.clone()
        return approx

    def contraction(self, numel):
        # One warm-started power iteration has no contraction bound of its own (Vogels
        # et al. 2019 argue empirically): None, the residual is still kept bounded.
        return None

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "matrix_rank": self.matrix_rank,
            "seed": self.seed,
            "qs": {k: q.clone() for k, q in self.qs.items()},
            "residuals": self.memory.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress import checkpoint

        required = ("matrix_rank", "seed", "residuals")
        checkpoint.check_keys("powersgd state", state, required=required, optional=("qs",))
        checkpoint.check_saved_value("matrix_rank", state["matrix_rank"], self.matrix_rank)
        checkpoint.check_saved_value("seed", state["seed"], self.seed)
        qs = checkpoint.check_tensor_map("powersgd qs", state.get("qs", {}), dim=2)  # cols x rank
        for k, q in qs.items():
            if not 1 <= q.shape[1] <= MAX_RANK:
                raise checkpoint.CheckpointError(
                    f"powersgd qs[{k!r}]: shape {tuple(q.shape)}, rank not in [1, {MAX_RANK}]"
                )
        self.memory.load_state_dict(state["residuals"], what="powersgd residuals")
        self.qs = {k: q.detach().clone() for k, q in qs.items()}
        self._pending = {}
        self._work = {}
