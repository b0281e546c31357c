"""Random-k and GSpar (kernels/quant.cu sections 10 and 11): the kept flags from the
uniforms, the bucket encode and decode, and the per-tensor forms (torch ops on the device)."""

from __future__ import annotations

import math

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.cuda._bucket import (
    _bodies_on,
    _bucket_device,
    _decode_rows,
    _encode_bucket,
    _first_rows,
    _rows,
)
from hvdcompress.backends.cuda.primitives import chunk_sums, uniform

# GSpar's scale is at most the largest float32 (codecs/sparse.py, gspar_scale)
_GSPAR_MAX_SCALE = float(np.finfo(np.float32).max)


def randomk_encode_segments(gs, keys, threshold, es):
    """Kept flags, one scan, counts (one read), then one launch writes the bodies."""
    if not gs:
        return [], []
    device, ns, live, bodies, nonfinite = _encode_bucket(gs, es)
    if not len(live):
        return bodies, nonfinite
    lns = ns[live]
    table = _rows(gs, live, es)
    table[:, rt._QUANT_SEG_FLAGS] = np.cumsum(lns) - lns
    table[:, rt._QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    elements = rt._segments(table, lns, device)
    total = int(lns.sum())
    with rt._Launcher(device) as k:
        states = k.states(elements.count)
        flags = k.empty(total, torch.uint8)
        limit = np.float32(threshold * 2.0**-24)  # exact: T <= 2^24
        k.tiles("quant_randomk_flags_segments", elements, limit, flags)
        incl = torch.cumsum(flags, 0, dtype=torch.int64)
        k.tiles("quant_randomk_count_segments", elements, incl, states)
        host = rt._read_state(states)
        kept = host[:, rt._ST_COUNT : rt._ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        bad = host[:, rt._ST_NONFINITE] != 0
        sizes = np.where(bad, 0, 4 * kept)
        firsts = np.cumsum(sizes) - sizes
        buf = k.empty(max(int(sizes.sum()), 4), torch.uint8)
        at = torch.from_numpy(buf.data_ptr() + firsts).to(device)
        k.tiles("quant_randomk_gather_segments", elements, flags, incl, at, states)
    for row, i in enumerate(live.tolist()):
        nonfinite[i] = bool(bad[row])
        bodies[i] = buf[int(firsts[row]) :][: int(sizes[row])]
    return bodies, nonfinite


def randomk_decode_segments(frame, starts, lens, ns, keys, threshold, scale, outs):
    """Flags regenerated, one scan, every body checked (one read), then one add."""
    count = len(outs)
    if not count:
        return None
    device = _bucket_device(outs, "out")
    starts, lens, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, lens, ns))
    body, at = _bodies_on(frame, starts, lens, device)
    total = int(ns.sum())
    table = _decode_rows(at, outs, np.arange(count), ns)
    table[:, rt._QUANT_SEG_FLAGS] = np.cumsum(ns) - ns
    table[:, rt._QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64).view(np.int64)
    table[:, rt._QUANT_SEG_BODY_LEN] = lens
    elements, values = rt._tilings(
        table, device, {rt._SEG_TILE: ns, rt._QUANT_SEG_VALUE_TILE: np.maximum(lens // 4, 1)}
    )
    with rt._Launcher(device) as k:
        states = k.states(count)
        flags = k.empty(max(total, 1), torch.uint8)
        limit = np.float32(threshold * 2.0**-24)  # exact: T <= 2^24
        k.tiles("quant_randomk_flags_segments", elements, limit, flags)
        incl = torch.cumsum(flags[:total], 0, dtype=torch.int64) if total else flags.long()
        k.tiles("quant_randomk_check_segments", values, incl, states)
        host = rt._read_state(states)
        kept = host[:, rt._ST_COUNT : rt._ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        wrong = 4 * kept != lens
        refused = np.flatnonzero(wrong | (host[:, rt._ST_ERROR] != 0))
        good = int(refused[0]) if len(refused) else count
        if good:
            part = _first_rows(elements, ns, good)
            k.tiles("quant_randomk_add_segments", part, flags, incl, np.float32(scale))
        del body  # stream-ordered: the launches above are queued before its reuse
    if not len(refused):
        return None
    return good, int(kept[good]) if wrong[good] else -1


_GSPAR_SEG_CHUNK = 4  # HVD_GSPAR_SEG_CHUNK of kernels/quant.cu: a segment's first chunk


def gspar_encode_segments(gs, keys, budgets, chunk, es=None):
    """kernels/sparse.cu, "GSpar's buckets": every tensor's scale iteration at once, a
    launch and a read a round (the host sums the chunk sums with ``math.fsum``, as the CPU)."""
    if not gs:
        return [], []
    device, ns, live, bodies, nonfinite = _encode_bucket(gs, es)
    if not len(live):
        return bodies, nonfinite
    lns = ns[live]
    chunks = -(-lns // chunk)
    first_chunk = np.cumsum(chunks) - chunks
    nchunks = int(chunks.sum())
    table = _rows(gs, live, es)
    table[:, rt._QUANT_SEG_FLAGS] = np.cumsum(lns) - lns
    table[:, _GSPAR_SEG_CHUNK] = first_chunk
    table[:, rt._QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    budget = np.asarray(budgets, dtype=np.float64).reshape(len(gs))[live]
    elements = rt._segments(table, lns, device)
    with rt._Launcher(device) as k:
        states = k.states(elements.count)
        k.tiles("quant_gspar_prepare_segments", elements, states)
        host = rt._read_state(states)
        bad = host[:, rt._ST_NONFINITE] != 0
        nonzero = host[:, rt._ST_COUNT : rt._ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        if es is not None:
            k.tiles("quant_gspar_form_segments", elements, states)
        rounds = (chunk, chunks, first_chunk, nchunks)
        c32, left_over = _gspar_scales(k, elements, device, rounds, budget, nonzero, bad)
        draw = np.where(bad | left_over, np.float32(-1.0), c32).astype(np.float32)
        buf, firsts, sizes = _gspar_draw_bodies(k, elements, device, states, lns, draw, es)
    for row, i in enumerate(live.tolist()):
        nonfinite[i] = bool(bad[row])
        if left_over[row]:
            bodies[i] = None
        elif not bad[row]:
            bodies[i] = buf[int(firsts[row]) :][: int(sizes[row])]
    return bodies, nonfinite


def _gspar_scales(k, elements, device, rounds, budget, nonzero, bad):
    """Every live tensor's scale (codecs/sparse.py, gspar_scale), a round launch and a read
    a round: (the float32 scales, the tensors whose rest summed to 0). ``rounds``: (chunk,
    the chunks per tensor, each tensor's first chunk, the chunks in all)."""
    chunk, chunks, first_chunk, nchunks = rounds
    scales = np.where(budget >= nonzero, np.inf, -1.0).astype(np.float32)
    scales[bad] = -1.0
    iterating = ~bad & (budget < nonzero)
    first = iterating.copy()  # the pending round is round 0 (c = 0: nothing saturated)
    left_over = np.zeros(elements.count, dtype=bool)  # the rest summed to 0: per tensor
    saturated = np.zeros(elements.count, dtype=np.int64)
    c32 = np.where(iterating, np.float32(0.0), scales).astype(np.float32)
    words = torch.empty(2 * elements.count + 2 * nchunks, dtype=torch.int32, device=device)
    for _ in range(int(nonzero.max()) + 3):  # codecs/sparse.py gspar_scale's bound
        if not iterating.any():
            break
        words.zero_()
        counts, sums = words[: 2 * elements.count], words[2 * elements.count :]
        at = torch.from_numpy(np.where(iterating, c32, np.float32(-1.0))).to(device)
        args = (elements.rows, np.int64(elements.count), np.int64(nchunks), np.int64(chunk), at)
        k("quant_gspar_round_segments", nchunks, *args, counts, sums)
        read = rt._read_state(words)
        now = read[: 2 * elements.count].view(np.int64)
        totals = read[2 * elements.count :].view(np.float64)
        for row in np.flatnonzero(iterating).tolist():
            if not first[row] and now[row] == saturated[row]:
                iterating[row] = False  # converged: c32[row] is the scale
                continue
            first[row] = False
            saturated[row] = now[row]
            lo = int(first_chunk[row])
            rest = math.fsum(totals[lo : lo + int(chunks[row])].tolist())
            if not rest > 0.0:
                iterating[row], left_over[row] = False, True
                continue
            c32[row] = np.float32(min((budget[row] - saturated[row]) / rest, _GSPAR_MAX_SCALE))
    else:
        raise AssertionError("the GSpar scale iteration did not converge")
    return c32, left_over


def _gspar_draw_bodies(k, elements, device, states, lns, draw, es):
    """The kept flags at the scales ``draw`` (< 0: none), their counts (one read), then one
    launch writes the bodies: (the buffer, each body's first byte in it, its size)."""
    scales_at = torch.from_numpy(draw).to(device)
    flags = k.empty(int(lns.sum()), torch.uint8)
    k.tiles("quant_gspar_flags_segments", elements, scales_at, flags)
    incl = torch.cumsum(flags, 0, dtype=torch.int64)
    k.rows("quant_gspar_count_segments", elements, incl, states)
    host = rt._read_state(states)
    kept = host[:, rt._ST_COUNT : rt._ST_COUNT + 2].copy().view(np.int64).reshape(-1)
    sizes = np.where(draw >= 0, kept * np.where(lns >= rt.TOPK_INDEX32_LIMIT, 12, 8), 0)
    rooms = -(-sizes // 8) * 8
    firsts = np.cumsum(rooms) - rooms
    buf = k.empty(max(int(rooms.sum()), 8), torch.uint8)
    at = np.where(draw >= 0, buf.data_ptr() + firsts, 0).astype(np.int64)
    body_at = torch.from_numpy(at).to(device)
    args = (np.int32(es is None), np.int64(rt.TOPK_INDEX32_LIMIT), scales_at)
    gather = (*args, flags, incl, body_at, states)
    k.tiles("quant_gspar_gather_segments", elements, *gather)
    return buf, firsts, sizes


def gspar_round(a, c, chunk):
    """Torch ops and ``chunk_sums``."""
    mag = a.abs()
    saturated = mag * c >= 1.0
    rest = torch.where(saturated, torch.zeros_like(mag), mag)
    return int(saturated.sum()), chunk_sums(rest, chunk, False)


def gspar_draw(a, c, key, scaled, budget):
    """Torch ops (p from the same float32 product; ``budget`` only sizes the CPU's output)."""
    mag = a.abs()
    if math.isinf(c):
        p = (mag > 0).to(torch.float32)
    else:
        p = torch.clamp(mag * torch.tensor(c, dtype=torch.float32, device=a.device), max=1.0)
    keep = uniform(key, a.numel(), a.device) < p
    idx = torch.nonzero(keep).reshape(-1)
    values = a[idx] / p[idx] if scaled else a[idx]
    return values, idx
