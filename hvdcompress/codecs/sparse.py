"""Sparsifying codecs: top-k, random-k, top-k + sign and GSpar (docs/baselines.md, "Top-k",
"Random-k" and "Top-k + sign and GSpar": the formulas, layouts and receiver checks).

Top-k (Aji & Heafield 2017; Stich et al. 2018) keeps the k = ceil(ratio * n) entries of
largest |x|, ties by lowest index, the same set on every device (torch.topk alone may break
ties differently on the CPU and the GPU). Body: k float32 values, then the k indices in
ascending order (int32 when n < 2**31, else int64), little-endian.

Random-k (its own layout, kept values only: the receiver regenerates the mask) is in
hvdcompress.codecs.randomk; its names are re-exported here.

Top-k + sign (Basu et al., Qsparse-local-SGD, NeurIPS 2019): one float32 magnitude m = (sum
of the kept |x|) / k, top-k's indices, then k sign bits (1 = negative, LSB first); decode
gives -m or +m at the kept indices.

GSpar (Wangni et al., NeurIPS 2018) keeps element i with probability p_i = min(1, c |x_i|),
sum p_i = T, and sends x_i / p_i (unbiased) in top-k's layout; c is a fixed point reached
exactly, in at most T + 1 rounds (``gspar_scale``). Every sum is an ordered chunk sum
(abs_sum) and every uniform counter-based, so all devices send the same bytes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs.randomk import (  # noqa: F401  (re-exported: compressors/sparse.py, tests)
    RANDOMK_ONE,
    randomk_decode_into,
    randomk_decode_segments,
    randomk_decoded_bound,
    randomk_encode,
    randomk_encode_segments,
    randomk_encode_with,
    randomk_scale,
    randomk_threshold,
)
from hvdcompress.errors import PayloadError

INDEX32_LIMIT = 2**31


def check_ratio(ratio: float, name: str) -> float:
    r = float(ratio)
    if not (0.0 < r <= 1.0):
        raise ValueError(f"{name} ratio must be in (0, 1], got {ratio!r}")
    return r


def topk_count(n: int, ratio: float) -> int:
    """k for n elements: ceil(ratio * n), at least 1 when n > 0, at most n."""
    if n == 0:
        return 0
    return min(n, max(1, math.ceil(n * ratio)))


def topk_counts(numels: np.ndarray, ratios) -> np.ndarray:
    """``topk_count`` of each (n, ratio) of a bucket, as an int64 array (ratios: one per
    numel, any iterable)."""
    pairs = zip(numels.tolist(), ratios, strict=True)
    return np.fromiter((topk_count(n, r) for n, r in pairs), dtype=np.int64, count=len(numels))


def index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < INDEX32_LIMIT else torch.int64


def topk_select(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest |a| (ties by lowest index) of the finite
    flat float32 a: the backend's selection (a radix select on the CPU, torch.topk on
    CUDA), the same set on every device (module docstring)."""
    n = a.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=a.device)
    if k == n:
        return torch.arange(n, device=a.device)
    return for_device(a.device).topk_select(a, k)


def topk_encode(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(body uint8, kept indices int64) for the flat float32 a."""
    idx = topk_select(a, k)
    values = a[idx]
    body = torch.cat([values.view(torch.uint8), idx.to(index_dtype(a.numel())).view(torch.uint8)])
    return body, idx


def topk_decode_into(
    body: torch.Tensor, n: int, k: int, out: torch.Tensor, accumulate: bool
) -> None:
    _scatter(out, *topk_kept(body, n, k), accumulate)


def topk_values_bound(body: torch.Tensor, n: int) -> float:
    """The largest |kept value| of a decoded (so checked) body in top-k's layout (top-k,
    DGC, GSpar): a decode into a new tensor writes those values and +0.0."""
    k = body.numel() // (4 + index_dtype(n).itemsize)
    return float(body[: 4 * k].clone().view(torch.float32).abs().max()) if k else 0.0


def topk_kept(body: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values float32) of a top-k body of k of n values, checked: its
    length, the indices ascending in [0, n), the values finite. Raises PayloadError."""
    isz = index_dtype(n).itemsize
    if body.numel() != k * (4 + isz):
        raise PayloadError(
            "body", f"top-k of {k} values needs {k * (4 + isz)} bytes, got {body.numel()}"
        )
    values = body[: 4 * k].clone().view(torch.float32)
    idx = body[4 * k :].clone().view(index_dtype(n)).to(torch.int64)
    _check_indices(idx, n)
    if k and not bool(torch.isfinite(values).all()):
        raise PayloadError("body", "a top-k value is not finite")
    return idx, values


# ---- top-k + sign (one shared magnitude) ---------------------------------------------------
def topk_sign_encode(a: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(body uint8, kept indices int64, magnitude m) for the flat float32 a."""
    idx = topk_select(a, k)
    kept = a[idx]
    m = float(torch.tensor(prim.abs_sum(kept) / k if k else 0.0, dtype=torch.float32))
    signs = prim.bitpack((kept < 0).to(torch.uint8), 1)
    head = torch.tensor([m], dtype=torch.float32, device=a.device).view(torch.uint8)
    index = idx.to(index_dtype(a.numel())).view(torch.uint8)
    return torch.cat([head, index, signs]), idx, m


def topk_sign_values(m: float, negative: torch.Tensor) -> torch.Tensor:
    """The decoded values: -m where ``negative`` else +m (float32)."""
    plus = torch.full(negative.shape, m, dtype=torch.float32, device=negative.device)
    return torch.where(negative.bool(), -plus, plus)


def topk_sign_decode_into(
    body: torch.Tensor, n: int, k: int, out: torch.Tensor, accumulate: bool
) -> None:
    _scatter(out, *topk_sign_kept(body, n, k), accumulate)


def topk_sign_bound(body: torch.Tensor) -> float:
    """The magnitude m of a decoded (so checked) top-k + sign body: its values are +-m."""
    return float(body[:4].clone().view(torch.float32))


def topk_sign_kept(body: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int64, values float32) of a top-k + sign body of k of n values, checked:
    its length, m finite and >= 0, the indices ascending in [0, n), the padding bits
    zero. Raises PayloadError."""
    isz = index_dtype(n).itemsize
    need = 4 + k * isz + prim.packed_len(k, 1)
    if body.numel() != need:
        raise PayloadError(
            "body", f"top-k + sign of {k} values needs {need} bytes, got {body.numel()}"
        )
    m = float(body[:4].clone().view(torch.float32))
    if not (math.isfinite(m) and m >= 0.0):
        raise PayloadError("body", f"top-k + sign magnitude {m} is not finite and >= 0")
    idx = body[4 : 4 + k * isz].clone().view(index_dtype(n)).to(torch.int64)
    _check_indices(idx, n)
    return idx, topk_sign_values(m, prim.bitunpack(body[4 + k * isz :], k, 1))


def _check_indices(idx: torch.Tensor, n: int) -> None:
    k = idx.numel()
    if k:
        if int(idx[0]) < 0 or int(idx[-1]) >= n:
            raise PayloadError("body", f"an index is outside [0, {n})")
        if k > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise PayloadError("body", "indices are not strictly increasing")


def _scatter(out: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, accumulate: bool):
    if accumulate:
        out[idx] += values
    else:
        out.zero_()
        out[idx] = values


# ---- DGC's momentum correction (hvdcompress/compressors/dgc.py) -------------------------------
def momentum_update(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float) -> bool:
    """DGC's momentum correction: the backend's ``dgc_update``, each step one float32
    operation."""
    return for_device(g.device).dgc_update(g, u, v, momentum)


# ---- magnitude-proportional random sparsification --------------------------------------------
GSPAR_CHUNK = 1024  # the chunks of abs_sum's ordered sum
GSPAR_MAX_SCALE = float(np.finfo(np.float32).max)  # c is multiplied as a float32


def gspar_scale(mag: torch.Tensor, budget: float) -> tuple[float, int]:
    """(c, rounds): p_i = min(1, c |mag_i|) has sum p_i == budget T. c is the fixed point of
    c = (T - |S|) / sum_{i not in S} |mag_i|, S = {i : c |mag_i| >= 1}, reached exactly from
    c = T / sum |mag| (c only grows, S only gains elements); c = inf when T >= the number
    of non-zero entries (every one of them is kept). Each round is one pass (the backend's
    gspar_round): the entries saturated at the current c (mag_i * float32(c) >= 1) and the
    ordered chunk sums of the others, whose correctly rounded total gives the next c."""
    nonzero = int(torch.count_nonzero(mag))
    if budget >= nonzero:
        return math.inf, 0
    backend = for_device(mag.device)
    count, sums = backend.gspar_round(mag, 0.0, GSPAR_CHUNK)  # c = 0: nothing saturated
    c = 0.0
    for rounds in range(1, nonzero + 2):
        rest = math.fsum(sums.cpu().tolist())
        if not rest > 0.0:  # nothing left to scale: the previous c stands
            return c, rounds
        # at most the largest float32: fl32(c) is what multiplies |a_i| (subnormal
        # gradients would need more; they then keep fewer than the budget, unbiased)
        c = min((budget - count) / rest, GSPAR_MAX_SCALE)
        new, sums = backend.gspar_round(mag, c, GSPAR_CHUNK)
        if new == count:
            return c, rounds
        count = new
    raise AssertionError("gspar_scale did not converge")  # c grows monotonically: unreachable


def gspar_variance_budget(a: torch.Tensor, variance: float) -> float:
    """The expected budget T of Wangni et al.'s variance-constrained GSpar (their problem
    (5): fewest expected kept entries subject to E||decode - a||^2 <= variance ||a||^2):
    with p_i = min(1, c |a_i|), the estimate a_i / p_i has E||decode - a||^2 =
    sum_{i not in S} (|a_i| / c - a_i^2), S = {i : c |a_i| >= 1} saturated, so the least c is

        c = sum_{i not in S} |a_i| / (variance ||a||^2 + sum_{i not in S} a_i^2)

    and T = |S| + c sum_{i not in S} |a_i|. c is the fixed point reached from S = {} (c only
    grows, S only gains entries: an entry joins S only when |a_i| >= 1 / c, and removing
    such entries from the sums never lowers c). The magnitudes are sorted on a's device
    and summed in float64 on the host (NaN / Inf show in the total); the encoder then
    solves its own c for T (``gspar_scale``), so the bytes follow from T by the ratio
    budget's rules. 0.0 for a tensor without finite non-zeros (nothing to keep, or a
    non-finite tensor, which the encoder flags)."""
    mag = a.detach().reshape(-1).abs().double()
    ascending = mag[mag != 0].sort().values.cpu()  # NaN sorts last and stays in the sums
    s1 = ascending.cumsum(0)  # s1[r - 1]: sum of |a_i| over the r smallest
    s2 = (ascending * ascending).cumsum(0)
    if ascending.numel() == 0 or not math.isfinite(float(s2[-1])):
        return 0.0
    floor = variance * float(s2[-1])
    r = ascending.numel()  # entries not saturated
    while r > 0:
        c = float(s1[r - 1]) / (floor + float(s2[r - 1]))
        below = int(torch.searchsorted(ascending, torch.tensor([1.0 / c], dtype=torch.float64)))
        if below >= r:  # no new entry reaches |a_i| >= 1 / c: c is the fixed point
            return ascending.numel() - r + c * float(s1[r - 1])
        r = below
    return float(ascending.numel())  # every non-zero entry kept: variance 0


def gspar_encode(
    a: torch.Tensor, budget: float, key: int, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(body uint8 in top-k's layout, kept indices int64): element i kept iff u_i < p_i,
    sent as a_i / p_i (unbiased), or as a_i when not ``scaled`` (the contractive form
    that error feedback needs: docs/baselines.md, "Top-k + sign and GSpar")."""
    c, _ = gspar_scale(a, budget)
    values, idx = for_device(a.device).gspar_draw(a, c, key, scaled, budget)
    body = torch.cat([values.view(torch.uint8), idx.to(index_dtype(a.numel())).view(torch.uint8)])
    return body, idx


def gspar_values_finite(body: torch.Tensor, n: int) -> torch.Tensor:
    """Whether a scaled GSpar body's kept values are finite (a 0-dim bool tensor): a_i / p_i
    of a finite a_i near float32's largest can overflow; such a payload travels flagged."""
    k = body.numel() // (4 + index_dtype(n).itemsize)
    return torch.isfinite(body[: 4 * k].view(torch.float32)).all()


def gspar_encode_segments(
    gs: list[torch.Tensor],
    keys: list[int],
    budgets: list[float],
    es: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[bool]]:
    """``gspar_encode`` of a bucket's tensors (flat float32 on one device): the backend's
    ``gspar_encode_segments``, scaled, or unscaled with the residuals ``es``. A tensor the
    call leaves to its caller (more kept than its room) is encoded alone; a scaled body
    that overflowed is flagged (``gspar_values_finite``)."""
    if not gs:
        return [], []
    backend = for_device(gs[0].device)
    bodies, nonfinite = backend.gspar_encode_segments(gs, keys, budgets, GSPAR_CHUNK, es)
    out = []
    for i, (g, key, budget, body) in enumerate(zip(gs, keys, budgets, bodies, strict=True)):
        if body is None and es is None:
            body = gspar_encode(g, budget, key)[0]
        elif body is None:  # e holds a: encoded from a copy, e zeroed at the kept entries
            body, idx = gspar_encode(es[i].clone(), budget, key, scaled=False)
            es[i][idx] = 0.0
        out.append(body)
    if es is None:  # one read for the bucket
        checks = [gspar_values_finite(b, g.numel()) for b, g in zip(out, gs, strict=True)]
        finite = torch.stack(checks)
        for i, ok in enumerate(finite.tolist()):
            if not ok and not nonfinite[i]:
                nonfinite[i], out[i] = True, out[i][:0]
    return out, nonfinite


def gspar_decode_into(body: torch.Tensor, n: int, out: torch.Tensor, accumulate: bool) -> None:
    isz = index_dtype(n).itemsize
    if body.numel() % (4 + isz):
        raise PayloadError("body", f"{body.numel()} bytes are not whole (value, index) pairs")
    k = body.numel() // (4 + isz)
    if k > n:
        raise PayloadError("body", f"{k} kept values for {n} elements")
    topk_decode_into(body, n, k, out, accumulate)


def topk_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    ks: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``topk_decode_into`` (accumulating) of each body ``frame[starts[i]:][:lens[i]]``, ``ks[i]``
    of ``ns[i]`` values, into ``outs[i]`` (``GatherCompressor.decode_segments``)."""
    need = ks * np.where(ns >= INDEX32_LIMIT, 12, 8)
    return _kept_decode_segments(
        frame, starts, lens, ns, ks, outs, need, "topk_decode_segments", topk_kept
    )


def _kept_decode_segments(frame, starts, lens, ns, ks, outs, need, native, kept):
    """The bucket decoder of top-k's or top-k + sign's bodies (``need[i]`` bytes each, of
    ``ks[i]`` values): the backend's ``native`` decoder; the error of a bad body, or of one
    of the wrong length, is what the per-payload ``kept`` raises for it."""
    from hvdcompress.backends import cpu

    backend = for_device(outs[0].device) if outs else cpu

    def error(i: int) -> PayloadError:
        body = frame[int(starts[i]) : int(starts[i]) + int(lens[i])]
        return prim.refusal(lambda: kept(body, int(ns[i]), int(ks[i])))

    def decode(upto: int):
        args = (frame, starts[:upto].copy(), ks[:upto].copy(), ns[:upto].copy(), outs[:upto])
        failed = getattr(backend, native)(*args)
        return None if failed is None else (failed[0], error(failed[0]))

    return prim.decode_to_wrong_length(lens, need, decode, error)


def gspar_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``gspar_decode_into`` (accumulating) of each body of a host frame: top-k's batched
    decoder for the bodies before the first whose length is not a whole number of (value,
    index) pairs for at most n of them, then that body's error (None when all decode)."""
    pair = 4 + np.where(ns >= INDEX32_LIMIT, 8, 4)
    ks = lens // pair
    wrong = np.flatnonzero((lens % pair != 0) | (ks > ns))
    upto = int(wrong[0]) if wrong.size else len(lens)
    failed = topk_decode_segments(
        frame, starts[:upto], lens[:upto], ns[:upto], ks[:upto], outs[:upto]
    )
    if failed is not None or not wrong.size:
        return failed
    body = frame[int(starts[upto]) : int(starts[upto]) + int(lens[upto])]  # refused by its length
    return upto, prim.refusal(lambda: gspar_decode_into(body, int(ns[upto]), outs[upto], True))


def topk_encode_segments(
    gs: list[torch.Tensor],
    es: list[torch.Tensor],
    ks: list[int],
    us: list[torch.Tensor] | None = None,
    momentum: float = 0.0,
) -> tuple[list[torch.Tensor], list[bool]]:
    """Top-k with error feedback of a bucket's tensors (flat float32 on one device): the
    backend's ``topk_encode_segments``, each body ``topk_encode``'s of g + e, byte for byte
    (with the velocities ``us``, DGC's, after ``momentum_update``)."""
    if not gs:
        return [], []
    return for_device(gs[0].device).topk_encode_segments(gs, es, ks, us, momentum)


def topk_sign_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor], ks: list[int]
) -> tuple[list[torch.Tensor], list[bool]]:
    """Top-k + sign with error feedback of a bucket's tensors (contiguous float32 on one
    device): the backend's selection, m = float32(correctly rounded sum of |kept| / k) per
    tensor here, then the backend's bodies (``topk_sign_encode``'s of g + e, byte for
    byte); (bodies, non-finite flags)."""
    if not gs:
        return [], []
    backend = for_device(gs[0].device)
    sel = backend.topkq_select_segments(gs, es, ks)
    magnitudes = [
        float(np.float32(math.fsum(sums) / k)) if k else 0.0
        for sums, k in zip(sel.chunk_sums(), sel.ks.tolist(), strict=True)
    ]
    bodies = backend.topkq_write_segments(sel, magnitudes)
    return bodies, [bool(b) for b in sel.nonfinite.tolist()]


def topk_sign_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    ks: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``topk_decode_segments`` for top-k + sign's bodies (``topk_sign_decode_into``)."""
    need = 4 + ks * np.where(ns >= INDEX32_LIMIT, 8, 4) + (ks + 7) // 8
    return _kept_decode_segments(
        frame, starts, lens, ns, ks, outs, need, "topkq_decode_segments", topk_sign_kept
    )
