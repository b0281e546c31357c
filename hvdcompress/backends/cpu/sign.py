"""signSGD and EF-signSGD on the CPU (kernels/sign.c; see hvdcompress.codecs.sign)."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cpu._library import (
    _F32,
    _PRIM_ERRORS,
    LIB,
    _addresses,
    _i64_array,
    _native,
    _numels,
    _row,
    _Rows,
)


def sign_encode_segments(xs):
    sizes = [x.numel() for x in xs]
    nbytes = [(n + 7) // 8 for n in sizes]
    buf = torch.empty(sum(nbytes), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes)) if xs else []
    rows = _Rows(sizes, 8)
    x_at = rows.at([x.data_ptr() for x in xs], _F32)
    out_at = rows.at([b.data_ptr() for b in bodies], 1, 8)
    flags = np.zeros(len(rows.n), dtype=np.int32)
    if xs:
        rows.call(LIB.hvdc_sign_encode_segments, x_at, rows.n, out_at, flags)
    bad = rows.any_per_tensor(flags, len(xs))
    return [None if b else body for b, body in zip(bad, bodies, strict=True)]


EF_CHUNK = 1024  # elements per order-fixed partial sum of EF-signSGD's mean |a|


def sign_decode_segments(frame, starts, ns, scales, outs):
    scales32, out_at = np.ascontiguousarray(scales, dtype=np.float32), _addresses(outs)
    table = _i64_array(starts), _i64_array(ns)
    rc = _native(LIB.hvdc_sign_decode_segments, len(outs), frame, *table, scales32, out_at)
    return None if rc == 0 else (-1 - rc, _PRIM_ERRORS[-4])


def efsign_sums_segments(gs, es):
    count = len(gs)
    ns = _numels(gs)
    chunks = (ns + EF_CHUNK - 1) // EF_CHUNK
    starts = np.cumsum(chunks) - chunks
    sums = np.zeros(max(int(chunks.sum()), 1), dtype=np.float64)
    rows = _Rows(ns.tolist(), EF_CHUNK)
    bad = np.zeros(len(rows.n), dtype=np.int32)
    g_at, e_at = rows.at(_addresses(gs), _F32), rows.at(_addresses(es), _F32)
    sum_starts = starts[rows.owner] + rows.lo // EF_CHUNK  # locals: alive across the calls
    rows.run(
        lambda a, c: LIB.hvdc_efsign_sums_segments(
            c, _row(g_at, a), _row(e_at, a), _row(rows.n, a), EF_CHUNK, sums.ctypes.data,
            _row(sum_starts, a), _row(bad, a),
        )
    )  # fmt: skip
    bounds = zip(starts.tolist(), (starts + chunks).tolist(), strict=True)
    return [sums[a:b].tolist() for a, b in bounds], rows.any_per_tensor(bad, count)


def efsign_encode_segments(gs, es, scales, skip):
    count = len(gs)
    ns = _numels(gs)
    nbytes = np.where(np.asarray(skip, dtype=bool), 0, (ns + 7) // 8)
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes.tolist())) if count else []
    rows = _Rows(ns.tolist(), 8)
    g_at, e_at = rows.at(_addresses(gs), _F32), rows.at(_addresses(es), _F32)
    out_at = rows.at(_addresses(bodies), 1, 8)
    scales32 = np.asarray(scales, dtype=np.float32).reshape(-1)[rows.owner]
    skip32 = np.asarray(skip, dtype=np.int32).reshape(-1)[rows.owner]
    if count:
        fn = LIB.hvdc_efsign_encode_segments
        rows.call(fn, g_at, e_at, rows.n, scales32, skip32, out_at)
    return bodies
