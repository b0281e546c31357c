"""The valid-input matrix (issue 31, item 2): every valid gradient survives every path.

Cells: every registered compressor x every example configuration the registry declares
(``registry.examples()``: a new compressor joins from its registration alone) x the
gradient classes of ``tests.codec_inputs.VALID_CLASSES`` (zeros, one non-zero, 0.1 % and
1 % non-zeros, constant, alternating sign, the dtype's subnormals, values near float32's
and float16's maximum, one element, empty, lengths 4/5/6 and 511/512/513, a Gaussian
matrix) x float32 / float16 / bfloat16 (a class the dtype cannot represent is left out by
construction) x the paths

* ``tensor``: ``compress(tensor, name)`` -> ``decode(payload, expect=ctx)`` (gather-only)
  or ``decompress`` after the phases of a world of one (summable);
* ``bucket``: ``compress_bucket`` -> ``decode_frame(..., rank=0)`` (gather-only);
* ``allgather`` / ``twostage`` / ``allreduce``: ``DistributedOptimizer`` on a simulated
  world of 3 ranks (``twostage`` only for recompressible gather-only compressors,
  ``allreduce`` the summable compressors' path);
* ``ddp``: ``hvdcompress.ddp_hook`` with a gloo group of one rank;

x 3 steps. Each cell: the decode raises nothing, the result has the input's shape and
dtype (``decode_frame`` fills float32 outputs), it lies within the codec's bound (``BOUNDS``
for one sender, ``MEAN_BOUNDS`` for averages, keyed by compressor name: ``none`` bit-exact,
fp16 / bf16 the cast, 3LC in {-S, 0, S}, top-k at most k kept values, ...; a name in
neither gets the generic checks: finite, shape, dtype, ranks agree), error feedback keeps
its invariant (sum of the decoded + the residuals == sum of the inputs, up to float32
rounding, also through the two-stage exchange) with finite residuals, and on 3 ranks every
rank holds bit-identical averages.
One test function per (configuration, path) loops over classes x dtypes x steps and lists
every failing cell. ``KNOWN`` holds the cells that fail today (each is its own strict
xfail below, so a fix shows); the main loops leave them out.

Hypothesis: ``test_any_bucket_of_valid_gradients_survives_the_bucket_path`` draws buckets
of classes (``tests.codec_inputs.valid_gradients``) of mixed dtypes for the bucket path.

Matrix size: ``CELLS`` counts the (configuration, class, dtype, path, step) cells run;
``test_matrix_size`` (after the matrix tests, in file order; skipped under ``-k`` / ``-m``)
checks that every cell not in ``KNOWN`` ran and prints the count: 20,916 cells measured,
plus the property's and the known failures' (its docstring). Runtime 20-55 s on 2 cores.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hvdcompress
from hvdcompress import framing
from hvdcompress.compressors import registry
from hvdcompress.training.simulate import run_ranks
from hvdcompress.transports.simulated import sum_in_rank_order
from tests.codec_inputs import DTYPES, FLIPPED, VALID_CLASSES, valid_gradient, valid_gradients
from tests.test_simulated import within

STEPS = 3
RANKS = 3
HANG_S = 120.0
CASES = registry.examples()
CELLS: Counter = Counter()  # path -> cells run
DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def case_id(name: str, params: dict) -> str:
    return name + "".join(f"-{k}={v}" for k, v in params.items())


def gradient(cls: str, dtype: torch.dtype, step: int, rank: int = 0):
    """The class's gradient of ``rank`` at ``step`` (None: not valid in ``dtype``)."""
    if cls in FLIPPED:  # one tensor, its sign alternating over steps and ranks
        return valid_gradient(cls, dtype, 0, (-1.0) ** (step + rank))
    return valid_gradient(cls, dtype, 1000 * step + rank)


def classes_of(dtype: torch.dtype) -> list[str]:
    return [c for c in VALID_CLASSES if gradient(c, dtype, 0) is not None]


# ---- cells that fail today: each a strict xfail (test_known_failures) -----------------------
# fnmatch patterns of "configuration|class|dtype|path" -> why the cell fails (path "ranks":
# the 3-rank paths allgather, twostage, allreduce). All are limits of the codecs near the
# dtype's maximum: values past it cannot be written (docs/wire-format.md, "Values past the
# dtype's range"), except that DQSG, NDQSG and unbiased random-k then decode to Inf with
# the non-finite flag clear where 3LC, QSGD and GSpar flag the payload.
_HUGE_F16 = "the codec decodes past float16's 65504 (s max|a|, a bucket norm, a / p): decode() "
_HUGE_F16 += "raises DecodeOverflowError (docs/wire-format.md, 'Values past the dtype's range')"
_SUM = "on 3 ranks the float32 sum of the decoded values passes the dtype's maximum (a rank's "
_SUM += "value up to N times, docs/error-feedback.md 'Overflow'): the average is Inf"
KNOWN: dict[str, str] = {
    # values near float32's maximum (float32 and bfloat16)
    "3lc-sparsity=1.[279]*|huge32|*|*": "3LC: S = s max|a| overflows float32 for s > 1: "
    "flagged non-finite, decodes to NaN (docs/codecs.md, 'Non-finite input')",
    "qsgd-*|huge32|*|*": "QSGD: the bucket norm overflows float32: flagged non-finite, "
    "decodes to NaN (docs/baselines.md, QSGD)",
    "dgc-*|huge32|*|*": "DGC: v sums the velocities, past float32 by step 2: flagged "
    "non-finite, NaN",
    "dqsg-levels=[13]-*|huge32|*|*": "DQSG: decodes to +-Inf with the non-finite flag clear "
    "(delta (q - u) past float32)",
    "ndqsg-bucket_size=64|huge32|*|*": "NDQSG: decodes to +-Inf with the non-finite flag clear",
    "randomk-ratio=0.1-unbiased=True|huge32|*|*": "random-k unbiased: a / p overflows float32: "
    "decodes to +-Inf with the non-finite flag clear",
    "gspar-ratio=0.1|huge32|*|*": "GSpar without error feedback: a_i / p_i overflows "
    "float32: flagged non-finite, decodes to NaN (test_gspar_scaled_values_that_overflow_"
    "travel_as_nonfinite)",
    "gspar-variance=1.0|huge32|*|*": "GSpar without error feedback (variance budget): a_i / "
    "p_i overflows float32: flagged non-finite, decodes to NaN",
    "gspar-ratio=0.2-error_feedback=True|huge32|*|ranks": _SUM,
    "gspar-variance=0.25-error_feedback=True|huge32|*|ranks": _SUM,
    "fp16|huge32|*|*": "fp16: |x| > 65504 casts to Inf",
    "randomk-ratio=0.5-error_feedback=True|huge32|*|ranks": _SUM,
    "terngrad|huge32|*|ranks": _SUM,
    "3lc-sparsity=1.[79]*|huge16|f16|ranks": _SUM,
    "gspar-ratio=0.1|huge16|f16|ranks": _SUM,
    "gspar-variance=1.0|huge16|f16|twostage": _SUM,
    "qsgd-levels=1|huge16|f16|ranks": _SUM,
    "randomk-ratio=0.1-unbiased=True|huge16|f16|ranks": _SUM,
    "block3lc-sparsity=1.5-*|huge16|f16|twostage": _SUM,
    # stochastic rounding sends a value under half a step as +-delta (up to float32's
    # maximum) with probability |a| / delta, where rounding to nearest sends 0: more to sum
    "block3lc-sparsity=1.0-block=256-stochastic=True-seed=7|huge32|*|ranks": _SUM,
    "block3lc-sparsity=1.5-block=256-stochastic=True-error_feedback=False|huge32|*|ranks": _SUM,
}
# block3lc clamps S = s max|a| to float32's maximum (no flag): past bfloat16's maximum
for _path in ("tensor", "allgather", "ddp"):
    KNOWN[f"block3lc-sparsity=1.5-*|huge32|bf16|{_path}"] = (
        "block3lc: S = s max|a| is clamped to float32's maximum, past bfloat16's"
    )
# values near float16's maximum in float16: configurations that decode past 65504
_PAST_F16 = "3lc-sparsity=1.[279]* dgc-* dqsg-levels=[13]-* ndqsg-bucket_size=64 qsgd-*"
_PAST_F16 += " randomk-ratio=0.1-unbiased=True gspar-ratio=0.1 gspar-variance=1.0"
_PAST_F16 += " block3lc-sparsity=1.5-*"
for _case in _PAST_F16.split():
    KNOWN[f"{_case}|huge16|f16|tensor"] = _HUGE_F16
    KNOWN[f"{_case}|huge16|f16|ddp"] = "the decoded gradient passes float16's 65504: written as Inf"
    KNOWN[f"{_case}|huge16|f16|ddp"] += " (docs/error-feedback.md, 'Overflow')"


def known(case: str, cls: str, dtype: torch.dtype, path: str) -> str | None:
    cells = [f"{case}|{cls}|{DT[dtype]}|{path}"]
    if path not in ("tensor", "bucket", "ddp"):
        cells.append(f"{case}|{cls}|{DT[dtype]}|ranks")
    for pattern, why in KNOWN.items():
        if any(fnmatch.fnmatchcase(cell, pattern) for cell in cells):
            return why
    return None


# ---- per-codec bounds -----------------------------------------------------------------------
# bound(c, params, a, dec) -> None or what is wrong. ``a``: what the codec encoded this step
# (float64, flat: the gradient plus the residual before the step under error feedback),
# ``dec``: the float32 decode (float64, flat). Single-sender paths only (tensor, bucket); on
# 3 ranks (and the DDP hook) the averages get the generic checks, bit-exact ones for none /
# fp16 / bf16 (MEAN_BOUNDS).
def _rel(x: float, y: float, rtol: float = 2e-6) -> bool:
    return abs(x - y) <= rtol * max(abs(x), abs(y)) + 1e-45


def _values_in(dec, allowed: list[float], what: str):
    bad = [v for v in dec.unique().tolist() if not any(_rel(v, w) for w in allowed)]
    return f"values {bad[:4]} not in {what} {allowed}" if bad else None


def _bound_exact(c, p, a, dec):
    return None if torch.equal(dec, a) else f"not bit-exact (max err {(dec - a).abs().max()})"


def _bound_cast(dtype):
    def bound(c, p, a, dec):
        want = a.float().to(dtype).double()
        return None if torch.equal(dec, want) else f"not the cast to {dtype}"

    return bound


def _bound_3lc(c, p, a, dec):
    if not a.numel():
        return None
    s = as32(p.get("sparsity", c.sparsity) * a.abs().max().item())
    return _values_in(dec, [0.0, s, -s], "{-S, 0, S}, S = s max|a|")


def as32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).float())


def _bound_terngrad(c, p, a, dec):
    m = as32(a.abs().max().item()) if a.numel() else 0.0
    return _values_in(dec, [0.0, m, -m], "{-M, 0, M}, M = max|x|")


def _bound_signsgd(c, p, a, dec):
    return _values_in(dec, [1.0, -1.0], "{-1, +1}")


def _bound_efsign(c, p, a, dec):
    if not a.numel():
        return None
    s = as32(a.abs().sum().item() / a.numel())
    return _values_in(dec, [s, -s], "{-scale, +scale}, scale = mean|a|")


def _topk_count(n: int, density: float) -> int:
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


def _kept(dec, a, k: int, same: bool = True):
    nz = dec.nonzero().flatten()
    if nz.numel() > k:
        return f"{nz.numel()} values kept, k = {k}"
    if same and not torch.equal(dec[nz], a[nz].float().double()):
        return "kept values differ from the input's"
    return None


def _bound_topk(c, p, a, dec):
    return _kept(dec, a, _topk_count(a.numel(), p.get("ratio", c.ratio)))


def _bound_dgc(c, p, a, dec):  # a: v, k at most the warm-up's first density
    return _kept(dec, a, _topk_count(a.numel(), max(0.25, p["ratio"])), same=False)


def _bound_topkq(c, p, a, dec):
    k = _topk_count(a.numel(), p.get("ratio", c.ratio))
    bad = _kept(dec, a, k, same=False)
    mags = dec[dec != 0].abs().unique()
    return bad or (f"{mags.numel()} magnitudes, not one" if mags.numel() > 1 else None)


def _bound_randomk(c, p, a, dec):  # kept entries are a_i (error feedback) or fl32(a_i / p)
    nz = dec.nonzero().flatten()
    kept, src = dec[nz], a[nz].float().double()
    if not c.unbiased:
        return None if torch.equal(kept, src) else "kept values differ from the input's"
    q = p["ratio"]
    ok = all(_rel(d, as32(x / q), 1e-6) for d, x in zip(kept.tolist(), src.tolist(), strict=True))
    return None if ok else "kept values are not a_i / p"


def _bound_support(c, p, a, dec):  # GSpar: no element bound; kept entries only where a != 0
    return "a value where the input is zero" if bool((dec[a == 0] != 0).any()) else None


def _bound_qsgd(c, p, a, dec):  # |x_hat_i| <= its bucket's norm <= ||a||; signs kept
    norm = a.norm().item() if a.numel() else 0.0
    worst = dec.abs().max().item() if dec.numel() else 0.0
    if worst > norm * (1 + 1e-5) + 1e-44:
        return f"|x_hat| {worst:.6g} > ||a|| {norm:.6g}"
    return "a sign flipped" if bool((dec * a < 0).any()) else None


def _bound_dqsg(levels: str):  # |w_hat - w| <= delta_b <= max|w| / s (docs/codecs.md, DQSG)
    def bound(c, p, a, dec):
        if not a.numel():
            return None
        delta = a.abs().max().item() / getattr(c, levels)
        err = (dec - a).abs().max().item()
        return None if err <= delta * (1 + 1e-5) + 1e-44 else f"|w_hat - w| {err:.3g} > {delta:.3g}"

    return bound


BOUNDS = {
    "none": _bound_exact,
    "fp16": _bound_cast(torch.float16),
    "bf16": _bound_cast(torch.bfloat16),
    "3lc": _bound_3lc,
    "terngrad": _bound_terngrad,
    "signsgd": _bound_signsgd,
    "efsignsgd": _bound_efsign,
    "topk": _bound_topk,
    "topkq": _bound_topkq,
    "dgc": _bound_dgc,
    "randomk": _bound_randomk,
    "gspar": _bound_support,
    "qsgd": _bound_qsgd,
    "dqsg": _bound_dqsg("levels"),
    "ndqsg": _bound_dqsg("fine_levels"),  # rank 0 sends DQSG payloads of the fine lattice
}


def generic(dec: torch.Tensor, g: torch.Tensor) -> str | None:
    """Shape, dtype and finiteness of a decoded tensor against its input."""
    if tuple(dec.shape) != tuple(g.shape):
        return f"shape {tuple(dec.shape)} != {tuple(g.shape)}"
    if dec.dtype != g.dtype:
        return f"dtype {dec.dtype} != {g.dtype}"
    if not bool(dec.isfinite().all()):
        return "not finite"
    return None


# ---- error feedback -------------------------------------------------------------------------
def residual(c, name: str, n: int) -> torch.Tensor:
    memory = c.memory
    e = None if memory is None else memory.residuals.get(name)
    return torch.zeros(n, dtype=torch.float64) if e is None else e.double().clone()


class Feedback:
    """Tracks one tensor's sums over the steps: sum(decoded) + e == sum(inputs) (DGC: sum of
    the velocities u = m u + g, docs/baselines.md "DGC")."""

    def __init__(self, c, name: str, n: int) -> None:
        self.c, self.name, self.n = c, name, n
        self.sent = torch.zeros(n, dtype=torch.float64)
        self.want = torch.zeros(n, dtype=torch.float64)
        self.scale = 0.0

    def before(self, g: torch.Tensor) -> torch.Tensor:
        """What the codec encodes this step (float64, flat): a = g + e (DGC: v + u)."""
        g = g.reshape(-1).double()
        e = residual(self.c, self.name, self.n)
        velocity = getattr(self.c, "velocity", None)
        if velocity is not None:
            u = velocity.residuals.get(self.name)
            u = torch.zeros(self.n, dtype=torch.float64) if u is None else u.double()
            g = self.c.momentum * u + g
        self.want += g
        a = g + e
        self.scale = max(self.scale, a.abs().max().item() if self.n else 0.0)
        return a

    def after(self, dec: torch.Tensor) -> str | None:
        self.sent += dec
        if not self.c.error_feedback:
            return None
        e = residual(self.c, self.name, self.n)
        if not bool(e.isfinite().all()):
            return "residual not finite"
        err = (self.sent + e - self.want).abs().max().item() if self.n else 0.0
        if err > 2e-6 * STEPS * self.scale + 1e-44:
            return f"error feedback: sum(decoded) + e - sum(g) = {err:.3g} (scale {self.scale:.3g})"
        return None


# ---- the single-sender paths ----------------------------------------------------------------
def tensor_step(c, g: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoded in g's dtype, decoded float32) through the per-tensor API."""
    payload, ctx = c.compress(g, name)
    if c.summable:
        for phase in range(1, c.phases):
            payload = c.next_phase(payload, ctx, phase)
        if c.phases == 1:
            dec = c.decompress(payload, ctx)
            return dec, dec.float()
        # decompress is decompress_exact cast (it consumes the pending phases: call it once)
        exact = c.decompress_exact(payload, ctx).float()
        return exact.to(g.dtype), exact
    dec = c.decode(payload, expect=ctx)
    flat = c.decode(payload, expect=ctx, out=torch.empty(g.numel()))
    return dec, flat


def select(name: str, params: dict, path: str, dtype: torch.dtype, only) -> list[str]:
    """The classes of a run: those not in KNOWN, or (``only``) the given ones."""
    if only is not None:
        return [c for c in classes_of(dtype) if c in only]
    return [c for c in classes_of(dtype) if not known(case_id(name, params), c, dtype, path)]


def run_single(name: str, params: dict, path: str, dtypes=DTYPES, only=None) -> list[str]:
    failures = []
    for dtype in dtypes:
        failures += single_cells(name, params, path, dtype, select(name, params, path, dtype, only))
    return failures


def single_cells(name: str, params: dict, path: str, dtype: torch.dtype, classes: list[str]):
    """Failures of the cells (class, ``dtype``, ``path``, step) of one compressor's run."""
    where = f"{path} {case_id(name, params)}"
    failures = []
    bound = BOUNDS.get(name)
    comp = hvdcompress.get_compressor(name, **params)
    feedback = {c: Feedback(comp, c, math.prod(VALID_CLASSES[c][0])) for c in classes}
    broken: set[str] = set()
    for step in range(STEPS):
        gs = {c: gradient(c, dtype, step) for c in classes}
        live = [c for c in classes if c not in broken]
        encoded = {c: feedback[c].before(gs[c]) for c in live}
        decs = {}
        if path == "tensor":
            for c in live:
                try:
                    decs[c] = tensor_step(comp, gs[c], c)
                except Exception as err:  # noqa: BLE001 - listed with its cell
                    broken.add(c)
                    failures.append(f"{where} {c} {DT[dtype]} step {step}: {err!r}")
        else:
            try:
                frame, ctxs = framing.compress_bucket(comp, [gs[c] for c in live], live)
                outs = [torch.zeros(gs[c].numel()) for c in live]
                framing.decode_frame(comp, frame, outs, ctxs, rank=0)
            except Exception as err:  # noqa: BLE001 - pinned to a class: each alone
                if len(classes) > 1:
                    return [
                        f for c in classes for f in single_cells(name, params, path, dtype, [c])
                    ]
                return [f"{where} {classes[0]} {DT[dtype]} step {step}: {err!r}"]
            # decode_frame adds into float32 outputs: shape and values (dtype float32)
            decs = {c: (o.view(gs[c].shape), o) for c, o in zip(live, outs, strict=True)}
        for c, (dec, flat) in decs.items():
            CELLS[path] += 1
            flat = flat.reshape(-1).double()
            problems = [generic(dec, gs[c] if path == "tensor" else gs[c].float())]
            problems.append(bound(comp, params, encoded[c], flat) if bound else None)
            problems.append(feedback[c].after(flat))
            if path == "tensor" and not comp.summable and not problems[0]:
                if not torch.equal(dec, flat.float().view(gs[c].shape).to(dtype)):
                    problems.append("decode() is not the float32 decode, cast")
            bad = [p for p in problems if p]
            if bad:
                broken.add(c)
                failures.append(f"{where} {c} {DT[dtype]} step {step}: {bad}")
    return failures


SINGLE = [(n, p, path) for n, p in CASES for path in ("tensor", "bucket")]
SINGLE = [
    (n, p, path) for n, p, path in SINGLE if path == "tensor" or not registry.REGISTRY[n].summable
]


@pytest.mark.parametrize(
    "name,params,path", SINGLE, ids=[f"{path}-{case_id(n, p)}" for n, p, path in SINGLE]
)
def test_single_sender_paths(name, params, path):
    failures = run_single(name, params, path)
    assert not failures, "\n".join(failures)


# ---- 3 ranks through DistributedOptimizer (simulated world) ---------------------------------
def _mean_exact(wire_dtype):
    """none / fp16 / bf16: bit-exact the Average of the summed casts: the rank-order sum of
    the payloads (the transports' numerics, ``sum_in_rank_order``), cast back to the
    gradient's dtype (``decompress``), times 1/N in float32, cast (the exchange's write)."""

    def bound(c, xs, got, path):
        dtype = xs[0].dtype
        sent = [x if wire_dtype is None else x.to(wire_dtype) for x in xs]
        want = sum_in_rank_order(sent).to(dtype).float().mul(1.0 / len(xs)).to(dtype)
        if same_bits(got, want):
            return None
        err = (got.double() - want.double()).abs().max().item()
        return f"not the rank-order average of the casts (off by {err:.3g})"

    return bound


def _mean_sign(c, xs, got, path):  # the mean of +-1 per rank
    return None if bool((got.abs() <= 1).all()) else "|average| > 1"


def _top(xs) -> float:
    return max((x.abs().max().item() for x in xs if x.numel()), default=0.0)


def _mean_terngrad(c, xs, got, path):  # each decode in {-M_r, 0, M_r} (also the owner's)
    top = _top(xs)
    return None if _top([got]) <= top * (1 + 1e-5) else f"|average| > max_r M_r = {top:.3g}"


def _mean_qsgd(c, xs, got, path):  # each decode within its rank's norm (allgather)
    norm = max((x.double().norm().item() for x in xs), default=0.0)
    if path != "allgather" or _top([got]) <= norm * (1 + 1e-5):
        return None
    return f"|average| > max_r ||g_r|| = {norm:.3g}"


def _mean_dqsg(c, xs, got, path):  # |w_hat_r - w_r| <= max|w_r| / s each (allgather)
    if path != "allgather" or not got.numel():
        return None
    mean = torch.stack([x.double() for x in xs]).mean(0)
    err = (got.double() - mean).abs().max().item()
    info = torch.finfo(got.dtype)  # and the rounding of the write into p.grad
    delta = _top(xs) / c.levels * (1 + 1e-5) + info.eps * (_top([got]) + info.smallest_normal)
    return None if err <= delta else f"|average - mean| {err:.3g} > max_r delta_r {delta:.3g}"


def _mean_support(c, xs, got, path):  # GSpar: kept entries only where some g_r != 0
    if c.error_feedback:  # the residuals hold values where this step's gradients are zero
        return None
    zero = torch.stack([x == 0 for x in xs]).all(0)
    return "a value where every rank's input is zero" if bool((got[zero] != 0).any()) else None


# bounds of an average (of the RANKS decodes, or the DDP hook's of one), keyed by compressor
# name: bound(c, inputs of the ranks, the average, path) -> None or what is wrong; a name not
# here gets the generic checks (shape, dtype, finite, ranks bit-identical)
MEAN_BOUNDS = {
    "none": _mean_exact(None),
    "fp16": _mean_exact(torch.float16),
    "bf16": _mean_exact(torch.bfloat16),
    "signsgd": _mean_sign,
    "terngrad": _mean_terngrad,
    "qsgd": _mean_qsgd,
    "dqsg": _mean_dqsg,
    "gspar": _mean_support,
}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def world_paths(name: str) -> list[str]:
    cls = registry.REGISTRY[name]
    if cls.summable:
        return ["allreduce"]
    return ["allgather", "twostage"] if cls.recompressible else ["allgather"]


def run_world(name: str, params: dict, path: str, dtype: torch.dtype, classes: list[str]):
    """Every rank's averaged gradients per step ({class: tensor}) and final residuals."""
    exchange = "auto" if path == "allreduce" else path
    pnames = {c: f"layer{i}.weight" for i, c in enumerate(classes)}

    def rank(t):
        comp = hvdcompress.get_compressor(name, **params)
        ps = {c: torch.nn.Parameter(torch.zeros(VALID_CLASSES[c][0], dtype=dtype)) for c in classes}
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(list(ps.values()), lr=0.0),
            [(pnames[c], p) for c, p in ps.items()],
            compression=comp,
            backend=t,
            exchange=exchange,
        )
        steps = []
        for step in range(STEPS):
            for c, p in ps.items():
                p.grad = gradient(c, dtype, step, t.rank).clone()
            opt.step()
            steps.append({c: p.grad.clone() for c, p in ps.items()})
        memory = comp.memory
        residuals = {} if memory is None else dict(memory.residuals)
        return steps, {c: residuals.get(pnames[c]) for c in classes}, residuals

    return within(HANG_S, lambda: run_ranks(RANKS, rank))


def world_cells(name: str, params: dict, path: str, dtype: torch.dtype, classes: list[str]):
    """Failures of the cells (class, dtype, path, step) of one 3-rank run."""
    where = f"{path} {case_id(name, params)}"
    try:
        results = run_world(name, params, path, dtype, classes)
    except Exception as err:  # noqa: BLE001 - pinned to a class below
        if len(classes) > 1:  # which class: each alone
            return [f for c in classes for f in world_cells(name, params, path, dtype, [c])]
        return [f"{where} {classes[0]} {DT[dtype]}: {type(err).__name__}: {err}"]
    failures = []
    bound = MEAN_BOUNDS.get(name)
    comp = hvdcompress.get_compressor(name, **params)  # as the ranks' (for its parameters)
    ef = comp.error_feedback
    for c in classes:
        sent = torch.zeros(math.prod(VALID_CLASSES[c][0]), dtype=torch.float64)
        want = sent.clone()
        scale = 0.0
        for step in range(STEPS):
            CELLS[path] += 1
            xs = [gradient(c, dtype, step, r) for r in range(RANKS)]
            got = [res[0][step][c] for res in results]
            problems = [generic(got[0], xs[0])]
            if not all(same_bits(g, got[0]) for g in got[1:]):
                problems.append("ranks hold different averages")
            problems.append(bound(comp, xs, got[0], path) if bound else None)
            sent += got[0].reshape(-1).double() * RANKS
            want += sum(x.reshape(-1).double() for x in xs)
            scale = max([scale] + [x.abs().max().item() for x in xs if x.numel()])
            bad = [p for p in problems if p]
            if bad:
                failures.append(f"{where} {c} {DT[dtype]} step {step}: {bad}")
                break
        else:
            es = [res[2] for res in results]
            if any(not bool(e.isfinite().all()) for r in es for e in r.values()):
                failures.append(f"{where} {c} {DT[dtype]}: a residual is not finite")
            elif ef and name != "dgc" and (path == "twostage" or has_residual(results, c)):
                # sum over steps of N x average + every rank's residual == sum of gradients,
                # up to float32 rounding also for float16 / bfloat16 gradients: the rounding
                # of the write into p.grad goes back into the residuals (error-feedback.md)
                if path == "twostage":
                    e = piece_residuals(results, f"layer{classes.index(c)}.weight", sent.numel())
                else:
                    e = sum(res[1][c].double() for res in results if res[1][c] is not None)
                err = (sent + e - want).abs().max().item() if sent.numel() else 0.0
                tol = 4e-6 * STEPS * RANKS * scale + 1e-43
                if err > tol:
                    failures.append(f"{where} {c} {DT[dtype]}: error feedback off by {err:.3g}")
    return failures


def piece_residuals(results, pname: str, n: int) -> torch.Tensor:
    """The two-stage exchange's residuals of tensor ``pname`` as one sum over the ranks: each
    rank's stage-1 residual per piece (``name[a:b]``) plus N times the owner's residual of
    its re-compressed average (``name[a:b]@owner``: the owner compressed the scaled sum)."""
    total = torch.zeros(n, dtype=torch.float64)
    for res in results:
        for key, e in res[2].items():
            m = re.fullmatch(re.escape(pname) + r"\[(\d+):(\d+)\](@owner)?", str(key))
            if m:
                start, stop = int(m[1]), int(m[2])
                total[start:stop] += e.double() * (RANKS if m[3] else 1)
    return total


def has_residual(results, c: str) -> bool:
    """Some rank keeps a residual for ``c`` (PowerSGD sends a vector as it is, without)."""
    return any(res[1][c] is not None and res[1][c].numel() for res in results)


def run_world_matrix(name: str, params: dict, path: str, dtypes=DTYPES, only=None) -> list[str]:
    failures = []
    for dtype in dtypes:
        classes = select(name, params, path, dtype, only)
        if classes:
            failures += world_cells(name, params, path, dtype, classes)
    return failures


WORLD = [(n, p, path) for n, p in CASES for path in world_paths(n)]


@pytest.mark.parametrize(
    "name,params,path", WORLD, ids=[f"{path}-{case_id(n, p)}" for n, p, path in WORLD]
)
def test_three_ranks_through_the_optimizer(name, params, path):
    failures = run_world_matrix(name, params, path)
    assert not failures, "\n".join(failures)


# ---- a property over the classes: any bucket of valid gradients, the bucket path ------------
GATHER = [(n, p) for n, p in CASES if not registry.REGISTRY[n].summable]


@st.composite
def valid_buckets(draw):
    """A gather-only configuration and a bucket of 1..5 valid gradients (mixed classes and
    dtypes) whose cells are not in KNOWN."""
    name, params = draw(st.sampled_from(GATHER))
    case = case_id(name, params)
    cell = valid_gradients().filter(lambda x: not known(case, x[0], x[1], "bucket"))
    return name, params, draw(st.lists(cell, min_size=1, max_size=5))


@settings(max_examples=60, deadline=None)
@given(valid_buckets(), st.integers(1, STEPS))
def test_any_bucket_of_valid_gradients_survives_the_bucket_path(bucket, steps):
    name, params, cells = bucket
    comp = hvdcompress.get_compressor(name, **params)
    names = [f"t{i}.{cls}" for i, (cls, _, _) in enumerate(cells)]
    feedback = [Feedback(comp, n, x.numel()) for n, (_, _, x) in zip(names, cells, strict=True)]
    bound = BOUNDS.get(name)
    for step in range(steps):
        tensors = [x if step % 2 == 0 else -x for _, _, x in cells]  # near-max sums stay finite
        encoded = [f.before(x) for f, x in zip(feedback, tensors, strict=True)]
        frame, ctxs = framing.compress_bucket(comp, tensors, names)
        outs = [torch.zeros(x.numel()) for x in tensors]
        framing.decode_frame(comp, frame, outs, ctxs, rank=0)
        for (cls, dtype, x), out, a, f in zip(cells, outs, encoded, feedback, strict=True):
            CELLS["bucket-property"] += 1
            flat = out.double()
            problems = [generic(out.view(x.shape), x.float())]
            problems += [bound(comp, params, a, flat) if bound else None, f.after(flat)]
            bad = [p for p in problems if p]
            assert not bad, f"bucket {case_id(name, params)} {cls} {DT[dtype]} step {step}: {bad}"


# ---- the DDP hook: gloo, a world of one rank ------------------------------------------------
class _Layers(torch.nn.Module):
    def __init__(self, classes: list[str], dtype: torch.dtype) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(VALID_CLASSES[c][0], dtype=dtype)) for c in classes
        )

    def forward(self, gs: list[torch.Tensor]) -> torch.Tensor:  # d/dp = g, exactly
        return sum((p * g).sum().float() for p, g in zip(self.ps, gs, strict=True))


def run_ddp(name: str, params: dict, dtypes=DTYPES, only=None) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    failures = []
    where = f"ddp {case_id(name, params)}"
    for dtype in dtypes:
        classes = select(name, params, "ddp", dtype, only)
        if not classes:
            continue
        model = _Layers(classes, dtype)
        ddp = DDP(model)
        comp = hvdcompress.get_compressor(name, **params)
        state = hvdcompress.DDPHookState(comp, named_parameters=model.named_parameters())
        ddp.register_comm_hook(state, hvdcompress.ddp_hook)
        opt = hvdcompress.hooked_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.0), state)
        pnames = dict(zip(classes, (n for n, _ in model.named_parameters()), strict=True))
        sums = {c: torch.zeros(max(1, math.prod(VALID_CLASSES[c][0])), dtype=torch.float64)
                for c in classes}  # fmt: skip
        wants = {c: s.clone() for c, s in sums.items()}
        broken: set[str] = set()
        bound = MEAN_BOUNDS.get(name)
        for step in range(STEPS):
            gs = [gradient(c, dtype, step) for c in classes]
            opt.zero_grad()
            try:
                ddp(gs).backward()
                opt.step()
            except Exception as err:  # noqa: BLE001 - listed with its cell
                failures.append(f"{where} {DT[dtype]} step {step} {classes}: "
                                f"{type(err).__name__}: {err}")  # fmt: skip
                break
            for c, g, p in zip(classes, gs, model.ps, strict=True):
                if c in broken:
                    continue
                CELLS["ddp"] += 1
                got = p.grad
                problems = [generic(got, g), bound(comp, [g], got, "ddp") if bound else None]
                if got is not None and got.numel():
                    sums[c][: got.numel()] += got.reshape(-1).double()
                    wants[c][: g.numel()] += g.reshape(-1).double()
                bad = [x for x in problems if x]
                if bad:
                    broken.add(c)
                    failures.append(f"{where} {c} {DT[dtype]} step {step}: {bad}")
        if failures or not comp.error_feedback or name == "dgc":
            continue
        for c in classes:
            e = residual(comp, pnames[c], math.prod(VALID_CLASSES[c][0]))
            n = e.numel()
            if n and c not in broken:
                scale = max(abs(x) for x in wants[c].tolist()) or 1e-45
                err = (sums[c][:n] + e - wants[c][:n]).abs().max().item()
                if not bool(e.isfinite().all()) or err > 1e-5 * STEPS * scale + 1e-43:
                    failures.append(f"{where} {c} {DT[dtype]}: error feedback off by {err:.3g}")
    return failures


@pytest.mark.parametrize("name,params", CASES, ids=[case_id(n, p) for n, p in CASES])
def test_ddp_hook_on_one_rank(one_rank_group, name, params):
    failures = run_ddp(name, params)
    assert not failures, "\n".join(failures)


# ---- the matrix size ------------------------------------------------------------------------
def matrix_cells() -> Counter:
    """(configuration, class, dtype, path, step) cells of the matrix not in KNOWN, per path."""
    cells: Counter = Counter()
    for name, params, path, dtype, cls in all_cells():
        if not known(case_id(name, params), cls, dtype, path):
            cells[path] += STEPS
    return cells


def test_matrix_size(request):
    """Every cell of the matrix ran (the tests above, in file order); prints the size.
    Measured: 20,916 matrix cells (tensor 4,647, bucket 3,897, allgather 3,858, twostage
    3,078, allreduce 789, ddp 4,647), plus about 300 cells of the bucket property and the
    183 known-failure cells (strict xfails, up to 3 steps each)."""
    want = matrix_cells()
    ran = {path: CELLS[path] for path in want}
    selected = request.config.getoption("keyword") or request.config.getoption("markexpr")
    if selected or not any(ran.values()):
        pytest.skip("a selection of the tests ran, not the whole matrix")
    print(f"valid-input matrix: {sum(ran.values())} cells {dict(ran)}; "
          f"bucket property: {CELLS['bucket-property']} cells; "
          f"known failures: {len(KNOWN_CELLS)} cells x up to {STEPS} steps")  # fmt: skip
    assert ran == dict(want), "the matrix did not run in full (see the failures above)"


# ---- the known failures, one strict xfail each ----------------------------------------------
def all_cells():
    for name, params in CASES:
        paths = ["tensor"] + ([] if registry.REGISTRY[name].summable else ["bucket"])
        for path in paths + world_paths(name) + ["ddp"]:
            for dtype in DTYPES:
                for cls in classes_of(dtype):
                    yield name, params, path, dtype, cls


KNOWN_CELLS = [
    pytest.param(
        name, params, path, dtype, cls,
        id=f"{path}-{case_id(name, params)}-{cls}-{DT[dtype]}",
        marks=pytest.mark.xfail(
            strict=True,
            raises=AssertionError,  # the listed cell failures, not a crash of the harness
            reason=known(case_id(name, params), cls, dtype, path),
        ),
    )
    for name, params, path, dtype, cls in all_cells()
    if known(case_id(name, params), cls, dtype, path)
]  # fmt: skip


@pytest.mark.parametrize("name,params,path,dtype,cls", KNOWN_CELLS)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the exchange's overflow warning
def test_known_failures(request, name, params, path, dtype, cls):
    if path == "ddp":
        request.getfixturevalue("one_rank_group")
        failures = run_ddp(name, params, [dtype], [cls])
    elif path in ("tensor", "bucket"):
        failures = run_single(name, params, path, [dtype], [cls])
    else:
        failures = run_world_matrix(name, params, path, [dtype], [cls])
    assert not failures, "\n".join(failures)
