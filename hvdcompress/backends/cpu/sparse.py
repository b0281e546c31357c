"""The sparsifiers on the CPU (kernels/sparse.c; see hvdcompress.codecs.sparse): top-k,
random-k, DGC, GSpar and top-k + sign, per tensor and per bucket."""

from __future__ import annotations

import math

import numpy as np
import torch

from hvdcompress.backends.cpu._library import (
    LIB,
    _addresses,
    _bodies_buffer,
    _decode,
    _native,
    _numels,
    _ptr,
    _scratch,
)

TOPK_SAMPLE = 65536  # elements of the strided sample that bounds the threshold from below
# Tensors from this size on are sampled (every TOPK_MIN_STRIDE-th element at least): a
# bucket's mid-size tensors then cost one collecting pass instead of five radix passes.
# The kept set is exact either way (kernels/sparse.c, topk_select_into, does the same).
TOPK_MIN_SAMPLED = 16384
TOPK_MIN_STRIDE = 16  # a sparser sample cost a 160-tensor bucket 0.3x one tensor's time
_ABS = 0x7FFFFFFF
_ALL = 0xFFFFFFFF


def topk_select(a, k):
    """t = the k-th largest abs bits by radix select, then one ordered pass. A strided
    sample's bound first narrows the work to about 2 k candidates (one pass over a); the
    candidates hold every element >= t whenever there are at least k of them, so the
    result is the same as the selection over all of a."""
    n = a.numel()
    hist = _scratch(4 * 2048)
    out = torch.empty(k, dtype=torch.int64)
    pa, ph = _ptr(a), _ptr(hist)
    if n >= TOPK_MIN_SAMPLED and 8 * k <= n:
        stride = max(TOPK_MIN_STRIDE, n // TOPK_SAMPLE)
        m = (n - 1) // stride + 1
        j = min(m, math.ceil(m * 2.0 * k / n) + 64)  # aim at about 2 k candidates
        bound = LIB.hvdc_topk_kth_bits(pa, m, stride, _ABS, j, ph)
        cap = 4 * k + 4096
        cand_idx = torch.empty(cap + 1, dtype=torch.int64)
        cand_bits = torch.empty(cap + 1, dtype=torch.int32)
        count = LIB.hvdc_topk_collect(pa, n, bound, _ptr(cand_idx), _ptr(cand_bits), cap)
        if count >= k:
            t = LIB.hvdc_topk_kth_bits(_ptr(cand_bits), count, 1, _ALL, k, ph)
            LIB.hvdc_topk_keep(_ptr(cand_bits), count, _ALL, _ptr(cand_idx), t, k, _ptr(out))
            return out
    t = LIB.hvdc_topk_kth_bits(pa, n, 1, _ABS, k, ph)
    LIB.hvdc_topk_keep(pa, n, _ABS, None, t, k, _ptr(out))
    return out


def _kept_room(n: int, mean: float) -> int:
    """Room for the kept entries of a random draw with this mean count: 8 standard
    deviations (Poisson bound) and 64 above it, at most n. The draw calls again with the
    exact count when it keeps more (far rarer than once in 10^12 draws)."""
    return min(n, math.ceil(mean + 8.0 * math.sqrt(mean) + 64))


def randomk_encode_segments(gs, keys, threshold, es):
    """One pass of hashes in one native call; a tensor that keeps more than its room (mean
    + 8 standard deviations) is encoded again on its own, with exact room."""
    ns = _numels(gs)
    caps = np.array([_kept_room(n, n * threshold / 2**24) for n in ns.tolist()], np.int64)
    buf, starts, ks, bad = _randomk_call(gs, keys, threshold, es, ns, caps)
    flags = [bool(b) for b in bad.tolist()]
    bodies = []
    for i, (a, k, cap, nonfinite) in enumerate(
        zip(starts.tolist(), ks.tolist(), caps.tolist(), flags, strict=True)
    ):
        if nonfinite:
            bodies.append(buf[:0])
        elif k > cap:  # more kept than the room: again, alone, with room
            if es is None:
                g, e = gs[i], None
            else:  # e holds a: again from a copy, e = -0.0 (a + -0.0 is a, bit for bit)
                g, e = es[i].clone(), [es[i].fill_(-0.0)]
            room = ks[i : i + 1].copy()
            again, _, _, _ = _randomk_call([g], keys[i : i + 1], threshold, e, ns[i : i + 1], room)
            bodies.append(again[: 4 * k])
        else:
            bodies.append(buf[a : a + 4 * k])
    return bodies, flags


def _randomk_call(gs, keys, threshold: int, es, ns: np.ndarray, caps: np.ndarray):
    """One native call of the random-k bucket encoder: (the bodies' buffer, each body's
    start in it, the kept counts, the non-finite flags)."""
    count = len(gs)
    buf, starts = _bodies_buffer(4 * (caps + 1))
    ks = np.zeros(count, dtype=np.int64)
    bad = np.zeros(count, dtype=np.int32)
    g_at, key_at = _addresses(gs), np.asarray(keys, dtype=np.uint64).reshape(count)
    tail = (buf, starts, caps, ks, bad)
    if es is None:
        _native(LIB.hvdc_randomk_encode_segments, count, g_at, ns, key_at, threshold, *tail)
    else:
        idx = np.empty(int(caps.max()) + 1 if count else 1, dtype=np.int64)
        fn = LIB.hvdc_randomk_ef_encode_segments
        _native(fn, count, g_at, _addresses(es), ns, key_at, threshold, *tail, idx)
    return buf, starts, ks, bad


def randomk_decode_segments(frame, starts, lens, ns, keys, threshold, scale, outs):
    count = len(outs)
    most = int(np.minimum(lens // 4, ns).max()) if count else 0
    idx = np.empty(max(most, 1), dtype=np.int64)
    key_at = np.asarray(keys, dtype=np.uint64).reshape(count)
    args = key_at, threshold, scale, _addresses(outs), idx
    return _decode(LIB.hvdc_randomk_decode_segments, count, frame, (starts, lens, ns), *args)


def dgc_update(g, u, v, momentum):
    n = g.numel()
    return bool(LIB.hvdc_dgc_update(_ptr(g), _ptr(u), _ptr(v), n, momentum, int(momentum == 0)))


def gspar_encode_segments(gs, keys, budgets, chunk, es=None):
    """One native call; None for a tensor that keeps more than its room or whose scale
    iteration the native sum does not finish."""
    count = len(gs)
    ns = _numels(gs)
    caps = np.array([_kept_room(n, b) for n, b in zip(ns.tolist(), budgets, strict=True)], np.int64)
    wide = (ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT
    buf, starts = _bodies_buffer(caps * np.where(wide == 1, 12, 8))
    most = int(caps.max()) if count else 0
    values = np.empty(max(most, 1), dtype=np.float32)
    idx = np.empty(max(most, 1), dtype=np.int64)
    sums = np.empty(max(int(((ns + chunk - 1) // chunk).max()) if count else 0, 1), np.float64)
    ks = np.zeros(count, dtype=np.int64)
    bad = np.zeros(count, dtype=np.int32)
    e_at = None if es is None else _addresses(es)
    key_at = np.asarray(keys, dtype=np.uint64).reshape(count)
    budget_at = np.asarray(budgets, dtype=np.float64).reshape(count)
    _native(
        LIB.hvdc_gspar_encode_segments, count, _addresses(gs), e_at, int(es is None), ns,
        key_at, budget_at, chunk, caps, wide, buf, starts, ks, bad, values, idx, sums,
    )  # fmt: skip
    flags = [bool(b) for b in bad.tolist()]
    bodies: list[torch.Tensor | None] = []
    for a, k, cap, w, nonfinite in zip(
        starts.tolist(), ks.tolist(), caps.tolist(), wide.tolist(), flags, strict=True
    ):
        if nonfinite:
            bodies.append(buf[:0])
        elif k < 0 or k > cap:
            bodies.append(None)
        else:
            bodies.append(buf[a : a + k * (12 if w else 8)])
    return bodies, flags


def gspar_round(a, c, chunk):
    sums = torch.empty((a.numel() + chunk - 1) // chunk, dtype=torch.float64)
    count = LIB.hvdc_gspar_round(_ptr(a), a.numel(), c, chunk, _ptr(sums))
    return int(count), sums


def gspar_draw(a, c, key, scaled, budget):
    """One pass of hashed counters into room for the budget (again, exact, if it keeps more)."""
    n = a.numel()
    inf = math.isinf(c)
    cap = n if inf else _kept_room(n, budget)
    while True:
        values = torch.empty(cap, dtype=torch.float32)
        idx = torch.empty(cap, dtype=torch.int64)
        args = 0.0 if inf else c, int(inf), key, int(scaled), values, idx, cap
        k = _native(LIB.hvdc_gspar_draw, a, n, *args)
        if k <= cap:
            return values[:k], idx[:k]
        cap = k


_TOPK_ERRORS = {  # kernels/sparse.c (TOPK_ERR_*): the messages of codecs/sparse.py
    -1: "an index is outside [0, {n})",
    -2: "indices are not strictly increasing",
    -3: "a top-k value is not finite",
}


def topk_decode_segments(frame, starts, ks, ns, outs):
    failed = _kept_decode_segments(LIB.hvdc_topk_decode_segments, frame, starts, ks, ns, outs)
    if failed is None:
        return None
    p, code = failed
    return p, _TOPK_ERRORS[code].format(n=int(ns[p]))


def _kept_decode_segments(fn, frame, starts, ks, ns, outs) -> tuple[int, int] | None:
    """Call a kept-set decoder of kernels/sparse.c (top-k, top-k + sign) over a bucket's
    bodies: None, or (p, its error code) for the first body p that does not decode."""
    wide = (ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT
    return _decode(fn, len(outs), frame, (starts, ks, ns), wide, _addresses(outs))


def topk_encode_segments(gs, es, ks, us=None, momentum=0.0):
    count = len(gs)
    ns = _numels(gs)
    k = np.asarray(ks, dtype=np.int64).reshape(count)
    wide = (ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT
    room = k * np.where(wide == 1, 12, 8)
    buf, starts = _bodies_buffer(room)
    most = int(k.max()) if count else 0
    sel = np.empty(max(most, 1), dtype=np.int64)
    cand_idx = np.empty(4 * most + 4097, dtype=np.int64)
    cand_bits = np.empty(4 * most + 4097, dtype=np.uint32)
    hist = np.empty(2048, dtype=np.uint32)
    bad = np.zeros(count, dtype=np.int32)
    g_at, e_at = _addresses(gs), _addresses(es)
    u_at = None if us is None else _addresses(us)
    scratch = (hist, sel, cand_idx, cand_bits)
    fn = LIB.hvdc_topk_encode_segments
    _native(fn, count, g_at, e_at, u_at, momentum, ns, k, wide, buf, starts, bad, *scratch)
    flags = [bool(b) for b in bad.tolist()]
    spans = zip(starts.tolist(), room.tolist(), flags, strict=True)
    return [buf[:0] if nonfinite else buf[a : a + r] for a, r, nonfinite in spans], flags


class TopKSignSelection:
    """The protocol's ``TopKSignSelection``, with the native calls' arrays."""

    def __init__(self, gs, es, ks) -> None:
        count = len(gs)
        self.es, self.ns = es, _numels(gs)
        self.ks = np.asarray(ks, dtype=np.int64).reshape(count)
        self.starts = np.cumsum(self.ks) - self.ks
        chunks = (self.ks + 1023) // 1024  # primitives.abs_sum's chunks
        self.sum_starts = np.cumsum(chunks) - chunks
        self.sum_ends = self.sum_starts + chunks
        total = max(int(self.ks.sum()), 1)
        self.sel = np.empty(total, dtype=np.int64)
        self.kept = np.empty(total, dtype=np.float32)
        self.sums = np.zeros(max(int(chunks.sum()), 1), dtype=np.float64)
        self.nonfinite = np.zeros(count, dtype=np.int32)
        self.wide = (self.ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT

    def chunk_sums(self) -> list[list[float]]:
        bounds = zip(self.sum_starts.tolist(), self.sum_ends.tolist(), strict=True)
        return [self.sums[a:b].tolist() for a, b in bounds]


def topkq_select_segments(gs, es, ks):
    sel = TopKSignSelection(gs, es, ks)
    most = int(sel.ks.max()) if len(gs) else 0
    cand_idx = np.empty(4 * most + 4097, dtype=np.int64)
    cand_bits = np.empty(4 * most + 4097, dtype=np.uint32)
    hist = np.empty(2048, dtype=np.uint32)
    _native(
        LIB.hvdc_topkq_select_segments, len(gs), _addresses(gs), _addresses(es), sel.ns,
        sel.ks, sel.nonfinite, sel.sel, sel.kept, sel.starts, sel.sums, sel.sum_starts, hist,
        cand_idx, cand_bits,
    )  # fmt: skip
    return sel


def topkq_write_segments(sel, magnitudes):
    skip = sel.nonfinite
    room = np.where(skip == 1, 0, 4 + sel.ks * np.where(sel.wide == 1, 8, 4) + (sel.ks + 7) // 8)
    buf, out_starts = _bodies_buffer(room)
    ms = np.asarray(magnitudes, dtype=np.float32).reshape(len(room))
    _native(
        LIB.hvdc_topkq_write_segments, len(room), _addresses(sel.es), sel.ks, skip, ms, sel.sel,
        sel.kept, sel.starts, sel.wide, buf, out_starts,
    )  # fmt: skip
    return [buf[a : a + r] for a, r in zip(out_starts.tolist(), room.tolist(), strict=True)]


def topkq_decode_segments(frame, starts, ks, ns, outs):
    """One native call; the index codes' messages are ``_TOPK_ERRORS``."""
    return _kept_decode_segments(LIB.hvdc_topkq_decode_segments, frame, starts, ks, ns, outs)
