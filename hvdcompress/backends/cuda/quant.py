"""The stochastic quantisers (kernels/quant.cu; see hvdcompress.codecs.quant): QSGD, the
packed-code bucket encode and decode QSGD, DQSG and NDQSG share, TernGrad and DQSG's
per-tensor quantiser."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.cuda._bucket import (
    _bodies_on,
    _bucket_device,
    _decode_rows,
    _first_rows,
    _rows,
)
from hvdcompress.backends.cuda.threelc import _quartic_bucket, _quartic_table


def qsgd_encode_segments(xs, levels, bits, bucket, keys):
    """Every norm, then every code, one launch each (quant.cu section 9), one read."""
    return _packed_bucket_encode(xs, keys, levels, bits, bucket, dqsg=False)


def _packed_bucket_encode(
    xs, keys, levels: int, bits: int, bucket: int, dqsg: bool, rho: int = 0, ks=None
):
    """A bucket of bodies made of one float32 per ``bucket`` elements (QSGD's norms, or
    with ``dqsg`` DQSG's deltas: quant_bucket_floats_segments, one thread a bucket,
    non-finite flags into the state rows), then ``bits``-bit codes
    (quant_packed_encode_segments, one thread a group of eight: QSGD's, DQSG's, or with
    ``rho`` NDQSG's cosets, the fine indices q into ``ks`` when given)."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    nb = (ns + bucket - 1) // bucket
    sizes = 4 * nb + (ns * bits + 7) // 8
    room = (sizes + 3) // 4 * 4  # the next body's floats stay 4-byte aligned
    firsts = np.cumsum(room) - room
    buf = torch.empty(int(room.sum()), dtype=torch.uint8, device=device)
    bodies: list[torch.Tensor | None] = [
        buf[a : a + n] for a, n in zip(firsts.tolist(), sizes.tolist(), strict=True)
    ]
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return bodies
    table = _rows(xs, live)
    table[:, rt._SIGN_SEG_OUT] = buf.data_ptr() + firsts[live]
    table[:, rt._QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    if ks is not None:
        table[:, rt._SEG_AUX] = ks.data_ptr() + (np.cumsum(ns) - ns)[live]
    tilings = {rt._SEG_BOFF: nb[live], rt._SEG_TILE: (ns[live] + 7) // 8}
    per_bucket, groups = rt._tilings(table, device, tilings)
    with rt._Launcher(device) as k:
        states = k.states(per_bucket.count)
        at, flag = np.int32(rt._SEG_BOFF), np.int32(dqsg)
        args = (np.int32(levels), np.int64(bucket), flag, states)
        k.tiles("quant_bucket_floats_segments", per_bucket, at, *args)
        args = (np.int32(levels), np.int32(bits), np.int64(bucket), flag, np.int32(rho))
        k.tiles("quant_packed_encode_segments", groups, np.int32(rt._SEG_TILE), *args)
        bad = rt._read_state(states)[:, rt._ST_NONFINITE]
    for row, i in enumerate(live.tolist()):
        if bad[row]:
            bodies[i] = None
    return bodies


def qsgd_decode_segments(frame, starts, ns, levels, bits, bucket, outs):
    """Every body checked (one launch, one read), then one launch adds those before."""
    failed, _ = _packed_bucket_decode(frame, starts, ns, None, bits, bucket, outs, "qsgd", levels)
    return None if failed is None else (failed[0], _qsgd_refusal(failed[1]))


def _aliasing_counts(k, live: np.ndarray, k_trues) -> tuple[torch.Tensor | None, ...]:
    """(the device array of each live row's k_true address, 0 where None; the zeroed
    int64 counts the decode kernels add into), or (None, None) when no k_true is given.
    The caller keeps both alive until its launches are queued."""
    if k_trues is None or all(k_trues[p] is None for p in live.tolist()):
        return None, None
    at = [0 if k_trues[p] is None else k_trues[p].data_ptr() for p in live.tolist()]
    trues = torch.tensor(at, dtype=torch.int64).to(k.device)
    return trues, torch.zeros(len(live), dtype=torch.int64, device=k.device)


def _aliased(counts: torch.Tensor | None, live: np.ndarray, count: int) -> np.ndarray:
    out = np.zeros(count, dtype=np.int64)
    if counts is not None:
        out[live] = rt._read_state(counts).view(np.int64)
    return out


def _packed_bucket_decode(
    frame, starts, ns, keys, bits, bucket, outs, codec: str, levels, rho=0, divisor=1,
    k_trues=None,
):  # fmt: skip
    """The decode of ``_packed_bucket_encode``'s bodies (lengths checked by the caller) of
    ``codec`` ("qsgd" or "dqsg"; with ``rho`` NDQSG's cosets, ``levels`` = rho // 2, side
    information ``outs[p] / divisor``, aliasing against ``k_trues``):
    ``quant_packed_check_segments`` (one launch, one read), then
    ``quant_packed_decode_add_segments`` for the bodies before the first refused one.
    (None, or (p, its error bits); the aliasing count of each body.)"""
    aliased = np.zeros(len(outs), dtype=np.int64)
    if not outs:
        return None, aliased
    device = _bucket_device(outs, "out")
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    nb = (ns + bucket - 1) // bucket
    groups = (ns + 7) // 8
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return None, aliased
    sizes = 4 * nb + (ns * bits + 7) // 8
    body, at = _bodies_on(frame, np.asarray(starts, dtype=np.int64)[live], sizes[live], device)
    table = _decode_rows(at, outs, live, ns)
    if keys is not None:
        table[:, rt._QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    units = np.maximum(groups, nb)[live]
    check, decode = rt._tilings(table, device, {rt._SEG_TILE: units, rt._SEG_BOFF: groups[live]})
    args = (np.int32(levels), np.int32(bits), np.int64(bucket))
    with rt._Launcher(device) as k:
        states = k.states(check.count)
        trues, counts = _aliasing_counts(k, live, k_trues)
        rule = np.int32(codec == "dqsg")
        at = np.int32(rt._SEG_TILE)
        k.tiles("quant_packed_check_segments", check, at, *args, rule, states)
        errors = rt._read_state(states)[:, rt._ST_ERROR]
        refused = np.flatnonzero(errors)
        good = int(refused[0]) if len(refused) else check.count
        if good:
            part = _first_rows(decode, groups[live], good)
            at = np.int32(rt._SEG_BOFF)
            side = (np.int32(rho), np.float32(divisor), trues, counts)
            k.tiles("quant_packed_decode_add_segments", part, at, *args, rule, *side)
        aliased = _aliased(counts, live, len(outs))
        del body  # stream-ordered: the launches above are queued before its reuse
    return None if not len(refused) else (int(live[good]), int(errors[good])), aliased


def _qsgd_refusal(err: int) -> str:
    """The QSGD decoder's message for the check's error bits (the CPU backend's order)."""
    if err & rt._QUANT_ERR_NORM:
        return "a QSGD norm is negative or not finite"
    if err & rt._PRIM_ERR_PADDING:
        return "a padding bit after the last packed value is set"
    return "a QSGD level is above the levels or a zero is signed"


def terngrad_encode_segments(xs, keys):
    """max|x|, the quartic digits, the zero-run encode, then one read of the states."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns, live, table = _quartic_table(xs)
    table[:, rt._SEG_BLEN] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)  # the key
    encoded: list[tuple[torch.Tensor, float] | None] = [
        (torch.empty(0, dtype=torch.uint8, device=device), 0.0)
    ] * len(xs)
    if not len(live):
        return encoded
    host, bodies = _quartic_bucket(device, table, ns, "quant_terngrad_quartic_segments")
    for row, (i, body) in enumerate(zip(live.tolist(), bodies, strict=True)):
        max_bits = int(host[row, rt._ST_ABSMAX])
        encoded[i] = None if max_bits >= 0x7F800000 else (body, rt._f32(max_bits))
    return encoded


def dqsg_quantize(w, levels, bucket, key, code_offset):
    """Two launches, one device-to-host copy (the non-finite flag)."""
    rt._check_tensor(w, "w", torch.float32)
    n = w.numel()
    nb = (n + bucket - 1) // bucket
    deltas = torch.empty(nb, dtype=torch.float32, device=w.device)
    q = torch.empty(n, dtype=torch.uint8, device=w.device)
    if n == 0:
        return q, deltas
    with rt._Launcher(w.device) as k:
        state = k.state()
        sizes = np.int64(n), np.int32(levels), np.int64(bucket)
        k("quant_dqsg_deltas", nb, w, *sizes, deltas, state)
        k("quant_dqsg_quantize", n, w, *sizes, np.uint64(key), np.int32(code_offset), deltas, q)
        return None if rt._read_state(state)[rt._ST_NONFINITE] else (q, deltas)


def dqsg_dequantize(q, deltas, bucket, key, out, accumulate):
    """One launch."""
    rt._check_tensor(out, "out", torch.float32)
    n = q.numel()
    if n == 0:
        return
    with rt._Launcher(out.device) as k:
        tail = np.int64(bucket), np.uint64(key), out, np.int32(bool(accumulate))
        k("quant_dqsg_dequantize", n, q, np.int64(n), deltas, *tail)
