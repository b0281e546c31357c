"""Top-k, top-k + sign and DGC (kernels/sparse.cu; the CPU backend's twin is
kernels/sparse.c): the bucket's radix select, its bodies' decode and DGC's momentum
correction."""

from __future__ import annotations

import math

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.cuda._bucket import (
    _bodies_on,
    _bucket_device,
    _check_residuals,
    _first_rows,
    _rows,
)

TOPK_SAMPLE = 65536  # elements of the strided sample that bounds the threshold from below


def _topk_candidates(mag: torch.Tensor, k: int) -> torch.Tensor | None:
    """Ascending indices of a superset of the k largest |a| (all |a| >= a lower bound from
    a strided sample), or None when the sample's bound is not low enough (then the caller
    scans everything). Deterministic: the sample and the bound are exact."""
    n = mag.numel()
    if n < 4 * TOPK_SAMPLE or 8 * k > n:
        return None
    stride = n // TOPK_SAMPLE
    sample = mag[::stride]
    m = sample.numel()
    j = min(m, math.ceil(m * 2.0 * k / n) + 64)  # aim at about 2k candidates
    bound = torch.topk(sample, j, sorted=False).values.min()
    cand = torch.nonzero(mag >= bound).reshape(-1)
    return cand if cand.numel() >= k else None


def topk_select(a, k):
    """t = the k-th largest |a| (torch.topk, exact), every |a| > t, then the |a| == t in
    index order (torch.topk alone may break ties differently on the CPU and the GPU)."""
    mag = a.abs()
    cand = _topk_candidates(mag, k)
    if cand is not None:  # every one of the k largest is a candidate: select among them
        mag = mag[cand]
    thr = torch.topk(mag, k, sorted=False).values.min()  # the k-th largest |a|, exact
    above = mag > thr
    need = k - int(above.sum())
    equal = mag == thr
    keep = above | (equal & (torch.cumsum(equal, 0, dtype=torch.int64) <= need))
    idx = torch.nonzero(keep).reshape(-1)
    return cand[idx] if cand is not None else idx


_TOPK_SEG_U, _TOPK_SEG_K, _TOPK_SEG_FLAGS, _TOPK_SEG_BODY = 3, 4, 5, 7  # HVD_TOPK_SEG_*
_TOPKQ_SEG_A, _TOPKQ_SEG_BODY = 0, 1  # HVD_TOPKQ_SEG_*: sparse_topkq_write_segments' rows
_TOPK_BINS = 2048  # HVD_TOPK_BINS: one histogram of 11-bit digits a segment
TOPKQ_CHUNK = 1024  # primitives.abs_sum's chunk: top-k + sign's magnitude sums


def _topk_table(gs, es, ks, us, empty_rows=False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(numels, the indices of the tensors that get a row: the non-empty ones, or with
    ``empty_rows`` all, their rows for the top-k select: g, e, n, u, k and the flag offset
    filled in; column 7 the caller's), checked."""
    count = len(gs)
    _check_residuals(gs, es)
    if us is not None:
        _check_residuals(gs, us)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=count)
    kept = np.asarray(ks, dtype=np.int64).reshape(count)
    if np.any((kept < 0) | (kept > ns)):
        raise ValueError(f"top-k needs 0 <= k <= n for every tensor, got k {ks} for n {ns}")
    live = np.arange(count) if empty_rows else np.flatnonzero(ns > 0)
    table = _rows(gs, live, es)
    if us is not None:
        table[:, _TOPK_SEG_U] = [us[i].data_ptr() for i in live.tolist()]
    table[:, _TOPK_SEG_K] = kept[live]
    table[:, _TOPK_SEG_FLAGS] = np.cumsum(ns[live]) - ns[live]
    return ns, live, table


def _topk_select(k: rt._Launcher, elements: rt._Segments, total: int, momentum, states, slots=None):
    """The launch sequence of a bucket's top-k select (kernels/sparse.cu, "Top-k's bucket
    encode") over ``elements`` (``total`` elements in all), through the gather: into the
    bodies, or with ``slots`` (values, indices) into those. No read."""
    m = np.float32(momentum)
    hist = torch.zeros(elements.count * _TOPK_BINS, dtype=torch.int32, device=k.device)
    k.tiles("sparse_topk_finite_segments", elements, m, states)
    k.tiles("sparse_topk_update_segments", elements, m, states, hist)
    for digit in range(3):
        if digit:
            args = (np.int32(digit), states, hist)
            k.tiles("sparse_topk_histogram_segments", elements, *args)
        k.rows("sparse_topk_pick_segments", elements, np.int32(digit), hist, states)
    flags = k.empty(total, torch.uint8)
    k.tiles("sparse_topk_ties_segments", elements, states, flags)
    ties = torch.cumsum(flags, 0, dtype=torch.int64)
    k.tiles("sparse_topk_keep_segments", elements, states, ties, flags)
    incl = torch.cumsum(flags, 0, dtype=torch.int64)
    values, indices = (None, None) if slots is None else slots
    args = (np.int64(rt.TOPK_INDEX32_LIMIT), flags, incl, values, indices)
    k.tiles("sparse_topk_gather_segments", elements, *args)


def topk_encode_segments(gs, es, ks, us=None, momentum=0.0):
    """One launch sequence (kernels/sparse.cu, "Top-k's bucket encode"), one read."""
    count = len(gs)
    if not count:
        return [], []
    device = _bucket_device(gs, "g")
    ns, live, table = _topk_table(gs, es, ks, us)
    bodies = [torch.empty(0, dtype=torch.uint8, device=device)] * count
    nonfinite = [False] * count
    if not len(live):
        return bodies, nonfinite
    lns, lks = ns[live], table[:, _TOPK_SEG_K]
    sizes = lks * np.where(lns >= rt.TOPK_INDEX32_LIMIT, 12, 8)
    rooms = -(-sizes // 8) * 8  # every body 8-byte aligned
    firsts = np.cumsum(rooms) - rooms
    with rt._Launcher(device) as k:
        buf = k.empty(max(int(rooms.sum()), 8), torch.uint8)
        table[:, _TOPK_SEG_BODY] = buf.data_ptr() + firsts
        elements = rt._segments(table, lns, device)
        states = k.states(elements.count)
        _topk_select(k, elements, int(lns.sum()), momentum, states)
        bad = rt._read_state(states)[:, rt._ST_NONFINITE] != 0
    for row, i in enumerate(live.tolist()):
        nonfinite[i] = bool(bad[row])
        if not bad[row]:
            bodies[i] = buf[int(firsts[row]) :][: int(sizes[row])]
    return bodies, nonfinite


class TopKSignSelection:
    """The protocol's ``TopKSignSelection``; on the device the kept values and indices
    in slots (a tensor's first slot a multiple of TOPKQ_CHUNK, the padding zero), the write
    kernel's rows, the bodies' buffer."""

    def __init__(self, gs, es, ks, device) -> None:
        count = len(gs)
        # every tensor gets a row: an empty one's body is m = 0 (no element tiles)
        self.ns, self.live, table = _topk_table(gs, es, ks, None, empty_rows=True)
        self.ks = np.asarray(ks, dtype=np.int64).reshape(count)
        self.nonfinite = np.zeros(count, dtype=np.int32)
        self.device = device
        lns, lks = self.ns[self.live], table[:, _TOPK_SEG_K]
        self.total = int(lns.sum())
        chunks = -(-lks // TOPKQ_CHUNK)
        self.first_chunk = np.cumsum(chunks) - chunks
        self.chunks = chunks
        slots = max(int(chunks.sum()), 1) * TOPKQ_CHUNK
        self.values = torch.zeros(slots, dtype=torch.float32, device=device)
        self.indices = torch.empty(slots, dtype=torch.int64, device=device)
        slot_at = self.values.data_ptr() + 4 * TOPKQ_CHUNK * self.first_chunk
        table[:, _TOPK_SEG_BODY] = slot_at
        self.sizes = 4 + lks * np.where(lns >= rt.TOPK_INDEX32_LIMIT, 8, 4) + (lks + 7) // 8
        rooms = -(-self.sizes // 4) * 4  # 4-byte aligned: m and the index words
        self.firsts = np.cumsum(rooms) - rooms
        self.buf = torch.empty(max(int(rooms.sum()), 4), dtype=torch.uint8, device=device)
        writes = np.zeros_like(table)
        writes[:, _TOPKQ_SEG_A] = table[:, rt._SEG_AUX]
        writes[:, _TOPKQ_SEG_BODY] = self.buf.data_ptr() + self.firsts
        writes[:, rt._SEG_N] = lns
        writes[:, _TOPK_SEG_K] = lks
        writes[:, _TOPK_SEG_BODY] = slot_at
        (self.elements,), (self.slots,) = rt._stacked_tilings(
            [(table, {rt._SEG_TILE: lns}), (writes, {rt._SEG_TILE: np.maximum(lks, 1)})], device
        )
        self.states = self.sums = None

    def chunk_sums(self) -> list[list[float]]:
        out = [[] for _ in self.ks]
        for row, i in enumerate(self.live.tolist()):
            first = int(self.first_chunk[row])
            out[i] = self.sums[first : first + int(self.chunks[row])].tolist()
        return out


def topkq_select_segments(gs, es, ks):
    """Top-k's select sequence into slots, their chunk sums, one read of both."""
    device = _bucket_device(gs, "g")
    sel = TopKSignSelection(gs, es, ks, device)
    if not len(sel.live):
        return sel
    count = sel.elements.count
    with rt._Launcher(device) as k:
        size = count * rt._STATE_WORDS + 2 * sel.values.numel() // TOPKQ_CHUNK
        words = torch.zeros(size, dtype=torch.int32, device=device)  # states, then sums
        states = words[: count * rt._STATE_WORDS]
        sums = words[count * rt._STATE_WORDS :].view(torch.float64)
        _topk_select(k, sel.elements, sel.total, 0.0, states, (sel.values, sel.indices))
        chunk_args = (np.int64(sel.values.numel()), np.int64(TOPKQ_CHUNK), np.int32(0))
        k("primitives_chunk_sums", sums.numel(), sel.values, *chunk_args, sums)
        host = rt._read_state(words)
    sel.states = states
    state_words = host[: count * rt._STATE_WORDS].reshape(count, rt._STATE_WORDS)
    sel.nonfinite[sel.live] = state_words[:, rt._ST_NONFINITE] != 0
    sel.sums = host[count * rt._STATE_WORDS :].view(np.float64)
    return sel


def topkq_write_segments(sel, magnitudes):
    """One launch."""
    bodies = [torch.empty(0, dtype=torch.uint8, device=sel.device)] * len(sel.ks)
    if not len(sel.live):
        return bodies
    ms = np.asarray(magnitudes, dtype=np.float32).reshape(len(sel.ks))[sel.live]
    with rt._Launcher(sel.device) as k:
        dms = torch.from_numpy(ms).to(sel.device)
        args = (np.int64(rt.TOPK_INDEX32_LIMIT), sel.values, sel.indices, dms)
        k.tiles("sparse_topkq_write_segments", sel.slots, *args, sel.states)
    for row, i in enumerate(sel.live.tolist()):
        if not sel.nonfinite[i]:
            bodies[i] = sel.buf[int(sel.firsts[row]) :][: int(sel.sizes[row])]
    return bodies


def topk_decode_segments(frame, starts, ks, ns, outs):
    """Every entry checked (one launch, one read), then one launch adds those before;
    a refusal is (p, its error bits)."""
    return _kept_decode_segments(frame, starts, ks, ns, outs, signs=False)


def topkq_decode_segments(frame, starts, ks, ns, outs):
    """``topk_decode_segments`` of top-k + sign bodies (m, the indices, the sign bits)."""
    return _kept_decode_segments(frame, starts, ks, ns, outs, signs=True)


def _kept_decode_segments(frame, starts, ks, ns, outs, signs: bool) -> tuple[int, int] | None:
    if not outs:
        return None
    device = _bucket_device(outs, "out")
    starts, ks, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, ks, ns))
    isz = np.where(ns >= rt.TOPK_INDEX32_LIMIT, 8, 4)
    if signs:  # m, the indices, the sign bits
        sizes = 4 + ks * isz + (ks + 7) // 8
        first_index = 4
    else:  # the values, the indices
        sizes = ks * (4 + isz)
        first_index = 4 * ks
    body, at = _bodies_on(frame, starts, sizes, device)
    table = np.zeros((len(outs), rt._SEG_COLS), dtype=np.int64)
    table[:, rt._SPARSE_SEG_VALUES] = at
    table[:, rt._SPARSE_SEG_OUT] = [out.data_ptr() for out in outs]
    table[:, rt._SPARSE_SEG_N] = ns
    table[:, rt._SPARSE_SEG_INDICES] = at + first_index
    table[:, rt._SPARSE_SEG_SIGNS] = at + 4 + ks * isz
    table[:, rt._SPARSE_SEG_K] = ks
    table[:, rt._SPARSE_SEG_WIDE] = isz == 8
    units = np.maximum(ks, 1)  # a tile for every body: top-k + sign checks m even at k = 0
    seg = rt._segments(table, units, device)
    flag = np.int32(signs)
    with rt._Launcher(device) as k:
        states = k.states(seg.count)
        k.tiles("sparse_topk_check_segments", seg, flag, states)
        errors = rt._read_state(states)[:, rt._ST_ERROR]
        refused = np.flatnonzero(errors)
        good = int(refused[0]) if len(refused) else seg.count
        if good:
            k.tiles("sparse_topk_add_segments", _first_rows(seg, units, good), flag)
        del body  # stream-ordered: the launches above are queued before its reuse
    return None if not len(refused) else (good, int(errors[good]))


def dgc_update(g, u, v, momentum):
    """The CPU backend's dgc_update (the same float32 operations) with torch temporaries."""
    u_new = u * momentum + g if momentum else g.clone()
    v_new = v + u_new
    if v_new.numel() and not math.isfinite(float(v_new.abs().amax())):
        return True
    u.copy_(u_new)
    v.copy_(v_new)
    return False
