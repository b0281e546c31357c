"""DQSG's and NDQSG's bucket codecs (kernels/quant.cu): the ternary digits quartic +
zero-run coded, or packed codes (quant.py), and NDQSG's coset and side-information
decoder (torch ops on the device)."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.cuda._bucket import _bucket_device, _decode_rows, _first_rows
from hvdcompress.backends.cuda.primitives import uniform
from hvdcompress.backends.cuda.quant import (
    _aliased,
    _aliasing_counts,
    _packed_bucket_decode,
    _packed_bucket_encode,
)
from hvdcompress.backends.cuda.threelc import (
    _quartic_table,
    _segment_bodies,
    _zre_check_segments,
    _zre_encode,
    _zre_expand_rows,
)


def dqsg_encode_segments(xs, keys, levels, bits, bucket):
    """s > 1: ``_packed_bucket_encode``; s = 1: ``_digits_ternary_encode``."""
    if levels == 1:
        return _digits_ternary_encode(xs, keys, bucket)
    return _packed_bucket_encode(xs, keys, levels, bits, bucket, dqsg=True)


def digits_encode_segments(xs, keys, levels, rho, bits, bucket):
    """``_digits_ternary_encode`` for rho <= 3, else ``_packed_bucket_encode``."""
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    device = _bucket_device(xs, "x") if xs else torch.device(rt.DEVICE_TYPE)
    ks = torch.empty(int(ns.sum()), dtype=torch.int8, device=device)
    if rho <= 3:
        return _digits_ternary_encode(xs, keys, bucket, levels, rho, ks), ks
    return _packed_bucket_encode(xs, keys, levels, bits, bucket, True, rho, ks), ks


def _digits_ternary_encode(
    xs, keys, bucket: int, levels: int = 1, rho: int = 0, ks: torch.Tensor | None = None
) -> list[torch.Tensor | None]:
    """Bodies of ternary digits (rho 0: DQSG's q at s = 1; rho 2 or 3: NDQSG's cosets):
    every delta (quant_bucket_floats_segments), every quartic byte
    (quant_dqsg_quartic_segments), the bucket's zero-run encode (threelc.cu section 7), one
    read of the states; then one ``cat`` puts each tensor's deltas before its zero-run bytes."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns, live, zre = _quartic_table(xs)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    bodies: list[torch.Tensor | None] = [empty] * len(xs)
    if not len(live):
        return bodies
    nb = (ns[live] + bucket - 1) // bucket
    ms = (ns[live] + 4) // 5
    deltas = torch.empty(int(nb.sum()), dtype=torch.float32, device=device)
    dfirst = np.cumsum(nb) - nb
    digits = zre.copy()  # the digit kernel reads column 3 as the deltas, 1 as the quartic
    digits[:, rt._QUANT_SEG_QUARTIC] = zre[:, rt._SEG_QOFF]
    digits[:, rt._QUANT_SEG_DELTAS] = deltas.data_ptr() + 4 * dfirst
    digits[:, rt._QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    if ks is not None:
        digits[:, rt._QUANT_SEG_KS] = ks.data_ptr() + (np.cumsum(ns) - ns)[live]
    (per_bucket, groups), (runs,) = rt._stacked_tilings(
        [(digits, {rt._SEG_BOFF: nb, rt._SEG_TILE: ms}), (zre, {rt._SEG_TILE: ms})], device
    )
    with rt._Launcher(device) as k:
        states = k.states(len(live))
        args = (np.int32(levels), np.int64(bucket), np.int32(1), states)
        k.tiles("quant_bucket_floats_segments", per_bucket, np.int32(rt._SEG_BOFF), *args)
        quartic = k.empty(int(ms.sum()), torch.uint8)
        digit_args = (np.int64(bucket), np.int32(levels), np.int32(rho), states)
        k.tiles("quant_dqsg_quartic_segments", groups, *digit_args, quartic)
        out = _zre_encode(k, runs, quartic, states)
        host = rt._read_state(states)
    coded = _segment_bodies(out, host)
    keep = [r for r in range(len(live)) if not host[r, rt._ST_NONFINITE]]
    delta_bytes = deltas.view(torch.uint8)
    pieces = []
    for r in keep:
        pieces += [delta_bytes[4 * dfirst[r] :][: 4 * nb[r]], coded[r]]
    joined = torch.cat(pieces) if pieces else delta_bytes[:0]
    at = 0
    for r, i in enumerate(live.tolist()):
        if host[r, rt._ST_NONFINITE]:
            bodies[i] = None
            continue
        size = 4 * int(nb[r]) + coded[r].numel()
        bodies[i], at = joined[at : at + size], at + size
    return bodies


_DQSG_ERRORS = ((rt._QUANT_ERR_NORM, -12), (rt._PRIM_ERR_PADDING, -14), (rt._QUANT_ERR_CODE, -15))


def dqsg_decode_segments(frame, starts, lens, ns, keys, levels, bits, bucket, outs):
    """s > 1: the lengths checked on the host, then ``_packed_bucket_decode``. s = 1:
    ``_digits_ternary_decode``, whose refusal (p, error bits) the codec words from the
    per-payload decoder."""
    if levels == 1:
        return _digits_ternary_decode(frame, starts, lens, ns, keys, bucket, outs)[0]
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    nb = (ns + bucket - 1) // bucket
    short, wrong = lens < 4 * nb, lens - 4 * nb != (ns * bits + 7) // 8
    bad = np.flatnonzero(short | wrong)
    stop = int(bad[0]) if len(bad) else len(outs)
    head = (frame, np.asarray(starts)[:stop], ns[:stop], list(keys)[:stop], bits, bucket)
    failed, _ = _packed_bucket_decode(*head, outs[:stop], "dqsg", levels)
    if failed is not None:
        return failed[0], next(code for bit, code in _DQSG_ERRORS if failed[1] & bit)
    return None if stop == len(outs) else (stop, -11 if short[stop] else -13)


def digits_decode_segments(
    frame, starts, lens, ns, keys, bucket, outs, rho=0, bits=0, divisor=1, k_trues=None
):
    """``_digits_ternary_decode`` for rho <= 3, else ``_packed_bucket_decode``; a
    refusal is (p, error bits), -1 for a length the host refused."""
    nested = (rho, divisor, k_trues)
    if rho <= 3:
        failed, aliased = _digits_ternary_decode(frame, starts, lens, ns, keys, bucket, outs,
                                                 *nested)  # fmt: skip
        return aliased, failed
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    nb = (ns + bucket - 1) // bucket
    bad = np.flatnonzero(lens - 4 * nb != (ns * bits + 7) // 8)
    stop = int(bad[0]) if len(bad) else len(outs)
    head = (frame, np.asarray(starts)[:stop], ns[:stop], list(keys)[:stop], bits, bucket)
    trues = None if k_trues is None else list(k_trues)[:stop]
    failed, part = _packed_bucket_decode(*head, outs[:stop], "dqsg", rho // 2, rho, divisor, trues)
    aliased = np.zeros(len(outs), dtype=np.int64)
    aliased[:stop] = part
    if failed is None and stop < len(outs):
        failed = (stop, -1)
    return aliased, failed


def _digits_ternary_decode(
    frame, starts, lens, ns, keys, bucket: int, outs, rho=0, divisor=1, k_trues=None
):
    """The decode of ``_digits_ternary_encode``'s bodies, accumulating: the lengths on the
    host (the deltas fit, and 1 .. 14 quartic bytes a zero-run byte), the bodies' zero-run
    parts and deltas gathered into one device buffer (one host-to-device copy for a host
    frame), the zero-run lengths and one scan, every body's zero-run total and padding
    (threelc.cu) and deltas (quant_dqsg_deltas_check_segments), one read, then the
    expansion (run groups as zero groups) and quant_dqsg_quartic_decode_add_segments for
    the bodies before the first refused one; the aliasing counts are read after the last
    launch, only when some k_true is given. (None, or (p, its error bits; -1 for a length
    the host refused); the aliasing count of each body.)"""
    count = len(outs)
    aliased = np.zeros(count, dtype=np.int64)
    if not count:
        return None, aliased
    device = _bucket_device(outs, "out")
    starts, lens, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, lens, ns))
    nb, ms = (ns + bucket - 1) // bucket, (ns + 4) // 5
    zlens = lens - 4 * nb
    bad = np.flatnonzero((zlens < 0) | (zlens > ms) | (zlens * rt._MAX_RUN < ms))
    stop = int(bad[0]) if len(bad) else count
    failed = None if stop == count else (stop, -1)
    live = np.flatnonzero(ms[:stop] > 0)
    if not len(live):
        return failed, aliased
    zl, lms, lnb = zlens[live], ms[live], nb[live]
    flat = frame.reshape(-1)
    first = starts[live] + 4 * lnb
    pieces = [flat[a : a + n] for a, n in zip(first.tolist(), zl.tolist(), strict=True)]
    pieces += [
        flat[a : a + 4 * n] for a, n in zip(starts[live].tolist(), lnb.tolist(), strict=True)
    ]
    body = torch.cat(pieces).to(device)  # the zero-run parts, then the deltas
    length = int(zl.sum())
    deltas_at = body.data_ptr() + length + 4 * (np.cumsum(lnb) - lnb)
    table = _decode_rows(deltas_at, outs, live, ns)
    table[:, rt._SEG_QOFF] = np.cumsum(lms) - lms
    table[:, rt._SEG_BOFF] = np.cumsum(zl) - zl
    table[:, rt._SEG_BLEN] = zl
    table[:, rt._QUANT_SEG_DECODE_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    check = np.zeros_like(table)
    check[:, rt._SEG_IN], check[:, rt._SEG_N] = deltas_at, ns[live]
    (seg,), (per_bucket,) = rt._stacked_tilings(
        [(table, {rt._SEG_TILE: lms}), (check, {rt._SEG_TILE: lnb})], device
    )
    with rt._Launcher(device) as k:
        states = k.states(seg.count)
        trues, counts = _aliasing_counts(k, live, k_trues)
        incl = _zre_check_segments(k, seg, body[:length], states)
        at = np.int32(rt._SEG_TILE)
        k.tiles("quant_dqsg_deltas_check_segments", per_bucket, at, np.int64(bucket), states)
        host = rt._read_state(states)
        refused = np.flatnonzero(host[:, rt._ST_ERROR])
        good = int(refused[0]) if len(refused) else seg.count
        if len(refused):
            failed = (int(live[good]), int(host[good, rt._ST_ERROR]))
        if good:
            # run groups expanded as plain zero groups: a zero q adds its dither term too
            quartic = _zre_expand_rows(k, table, lms, good, body, incl, rt._ZERO_GROUP, states)
            part = _first_rows(seg, lms, good)
            args = (np.int64(bucket), quartic, np.int32(rho), np.float32(divisor), trues, counts)
            k.tiles("quant_dqsg_quartic_decode_add_segments", part, *args)
        aliased = _aliased(counts, live, count)
        del body  # stream-ordered: the launches above are queued before its reuse
    return failed, aliased


def ndqsg_coset(k, rho, code_offset):
    """Torch ops on the device."""
    kf = k.to(torch.float32)
    m = kf - rho * torch.round(kf / torch.full((), float(rho), device=k.device))
    return (m.to(torch.int16) + code_offset).to(torch.uint8)


def ndqsg_side_decode(m, deltas, y, rho, bucket, key, out, accumulate, k_true):
    """The CPU backend's ndqsg_side_decode (the same float32 operations) with torch ops."""
    n = m.numel()
    nb = (n + bucket - 1) // bucket
    pad = nb * bucket - n
    u = (uniform(key, nb * bucket, y.device) - 0.5).view(nb, bucket)
    mf = torch.cat([m.to(torch.float32), m.new_zeros(pad, dtype=torch.float32)]).view(nb, -1)
    y2 = torch.cat([y.to(torch.float32), y.new_zeros(pad, dtype=torch.float32)]).view(nb, -1)
    d = deltas.to(y.device)[:, None]
    safe = torch.where(d > 0, d, torch.ones_like(d))
    r = safe * (mf - u) - y2
    j = torch.round(r / (safe * float(rho)))
    k = torch.where(d > 0, mf - float(rho) * j, torch.zeros_like(mf))
    if out is not None:
        w = (d * (k - u)).view(-1)[:n]
        if accumulate:
            out += w
        else:
            out.copy_(w)
    if k_true is None:
        return 0
    return int((k_true.to(torch.float32) != k.view(-1)[:n]).sum())
