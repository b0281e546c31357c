"""The sign codecs: signSGD and EF-signSGD (kernels/sign.cu; see hvdcompress.codecs.sign)."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.cuda._bucket import (
    _bodies_on,
    _bucket_device,
    _check_residuals,
    _decode_rows,
    _encode_bucket,
    _first_rows,
    _rows,
)

EF_CHUNK = 1024  # elements per order-fixed partial sum of EF-signSGD's mean |a| (cpu.EF_CHUNK)


def sign_encode_segments(xs):
    """One launch over a segment table (kernels/sign.cu section 5), one read."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    nbytes = (ns + 7) // 8
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
    bodies: list[torch.Tensor | None] = list(torch.split(buf, nbytes.tolist()))
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return bodies
    table = _rows(xs, live)
    table[:, rt._SIGN_SEG_OUT] = [bodies[i].data_ptr() for i in live.tolist()]
    with rt._Launcher(device) as k:
        seg = rt._segments(table, nbytes[live], device)
        states = k.states(seg.count)
        k.tiles("sign_encode_segments", seg, states)
        bad = rt._read_state(states)[:, rt._ST_NONFINITE]
    for row, i in enumerate(live.tolist()):
        if bad[row]:
            bodies[i] = None
    return bodies


def efsign_sums_segments(gs, es):
    """One launch over a segment table, one read (the sums as host arrays)."""
    if not gs:
        return [], []
    device, ns, live, _, bad = _encode_bucket(gs, es)
    chunks = (ns + EF_CHUNK - 1) // EF_CHUNK
    first = np.cumsum(chunks) - chunks
    total = int(chunks.sum())
    # the chunk sums, then the state rows (4 doubles = 8 words each): one read for both
    scratch = torch.zeros(total + 4 * len(live), dtype=torch.float64, device=device)
    if len(live):
        states = scratch[total:].view(torch.int32)
        table = _rows(gs, live, es)
        table[:, rt._SIGN_SEG_OUT] = scratch.data_ptr() + 8 * first[live]
        with rt._Launcher(device) as k:
            seg = rt._segments(table, chunks[live], device)
            k.tiles("sign_ef_sums_segments", seg, np.int64(EF_CHUNK), states)
    host = rt._read_state(scratch)
    sums = host[: 2 * total].view(np.float64)
    words = host[2 * total :].reshape(-1, rt._STATE_WORDS)
    for row, i in enumerate(live.tolist()):
        bad[i] = bool(words[row, rt._ST_NONFINITE])
    return [sums[a : a + c] for a, c in zip(first.tolist(), chunks.tolist(), strict=True)], bad


def efsign_encode_segments(gs, es, scales, skip):
    """One launch over a segment table, no host copy."""
    if not gs:
        return []
    device = _bucket_device(gs, "g")
    _check_residuals(gs, es)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=len(gs))
    nbytes = np.where(np.asarray(skip, dtype=bool), 0, (ns + 7) // 8)
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
    bodies = list(torch.split(buf, nbytes.tolist()))
    live = np.flatnonzero(nbytes > 0)
    if len(live):
        table = _rows(gs, live, es)
        table[:, rt._SIGN_SEG_OUT] = [bodies[i].data_ptr() for i in live.tolist()]
        table[:, rt._SEG_F32] = rt._f32_bits(np.asarray(scales, dtype=np.float32)[live])
        with rt._Launcher(device) as k:
            k.tiles("sign_ef_encode_segments", rt._segments(table, nbytes[live], device))
    return bodies


def sign_decode_segments(frame, starts, ns, scales, outs):
    """Every body checked (one launch, one read), then one launch adds those before."""
    if not outs:
        return None
    device = _bucket_device(outs, "out")
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    nbytes = (ns + 7) // 8
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return None
    body, at = _bodies_on(frame, np.asarray(starts, dtype=np.int64)[live], nbytes[live], device)
    table = _decode_rows(at, outs, live, ns)
    table[:, rt._SEG_F32] = rt._f32_bits(np.asarray(scales, dtype=np.float32)[live])
    with rt._Launcher(device) as k:
        seg = rt._segments(table, nbytes[live], device)
        states = k.states(seg.count)
        k.rows("sign_decode_check_segments", seg, states)
        refused = np.flatnonzero(rt._read_state(states)[:, rt._ST_ERROR])
        good = int(refused[0]) if len(refused) else seg.count
        if good:
            k.tiles("sign_decode_add_segments", _first_rows(seg, nbytes[live], good))
        del body  # stream-ordered: the launches above are queued before its reuse
    if len(refused):
        return int(live[good]), "a padding bit after the last packed value is set"
    return None
