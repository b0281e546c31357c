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
    _numels,
    _ptr,
    _row,
    _Rows,
)

# ---- sign codecs (kernels/sign.c; see hvdcompress.codecs.sign) -------------------------------


def sign_encode_segments(xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The packed sign bits (bit 1 for x < 0) of each tensor of a bucket, None where x
    holds a NaN or an Inf: one native call over a segment table (a tensor the codec
    threads cut, ``splits``, a call a part on the threads); the bodies are views of one
    buffer."""
    sizes = [x.numel() for x in xs]
    nbytes = [(n + 7) // 8 for n in sizes]
    buf = torch.empty(sum(nbytes), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes)) if xs else []
    rows = _Rows(sizes, 8)
    x_at = rows.at([x.data_ptr() for x in xs], _F32)
    out_at = rows.at([b.data_ptr() for b in bodies], 1, 8)
    flags = np.zeros(len(rows.n), dtype=np.int32)
    if xs:
        rows.run(
            lambda a, c: LIB.hvdc_sign_encode_segments(
                c, _row(x_at, a), _row(rows.n, a), _row(out_at, a), _row(flags, a)
            )
        )
    bad = rows.any_per_tensor(flags, len(xs))
    return [None if b else body for b, body in zip(bad, bodies, strict=True)]


EF_CHUNK = 1024  # elements per order-fixed partial sum of EF-signSGD's mean |a|


def sign_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """The sign decode (+-scale per bit added: bit ? -scale : scale) of each body at
    ``frame[starts[p]:]`` (the caller checked the lengths) into ``outs[p]``, one native
    call: None, or (p, message) of the first body with a padding bit set (the ones before it
    are added)."""
    scales32, out_at = np.ascontiguousarray(scales, dtype=np.float32), _addresses(outs)
    rc = LIB.hvdc_sign_decode_segments(
        len(outs),
        _ptr(frame),
        _i64_array(starts),
        _i64_array(ns),
        scales32.ctypes.data,
        out_at.ctypes.data,
    )
    return None if rc == 0 else (-1 - rc, _PRIM_ERRORS[-4])


def efsign_sums_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor]
) -> tuple[list[list[float]], list[bool]]:
    """float64 sums of |g + e| over EF_CHUNK-element chunks (each left to right) of each
    (g, e) of a bucket in one native call (a tensor the codec threads cut, ``splits``, a
    call a part): (each tensor's chunk sums, each tensor's flag that g + e holds a NaN or
    an Inf)."""
    count = len(gs)
    ns = _numels(gs)
    chunks = (ns + EF_CHUNK - 1) // EF_CHUNK
    starts = np.zeros(count, dtype=np.int64)
    np.cumsum(chunks[:-1], out=starts[1:])
    sums = np.zeros(max(int(chunks.sum()), 1), dtype=np.float64)
    rows = _Rows(ns.tolist(), EF_CHUNK)
    bad = np.zeros(len(rows.n), dtype=np.int32)
    g_at, e_at = rows.at(_addresses(gs), _F32), rows.at(_addresses(es), _F32)
    sum_starts = starts[rows.owner] + rows.lo // EF_CHUNK  # locals: alive across the calls
    rows.run(
        lambda a, c: LIB.hvdc_efsign_sums_segments(
            c,
            _row(g_at, a),
            _row(e_at, a),
            _row(rows.n, a),
            EF_CHUNK,
            sums.ctypes.data,
            _row(sum_starts, a),
            _row(bad, a),
        )
    )
    bounds = zip(starts.tolist(), (starts + chunks).tolist(), strict=True)
    return [sums[a:b].tolist() for a, b in bounds], rows.any_per_tensor(bad, count)


def efsign_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor], scales: list[float], skip: list[bool]
) -> list[torch.Tensor]:
    """The sign bits of a = g + e, e <- a - (a < 0 ? -scale : scale) (a finite), of each
    (g, e, scale) of a bucket whose ``skip`` is False, in one native call (a tensor the
    codec threads cut, ``splits``, a call a part): the bodies (views of one new buffer;
    empty where skipped, e untouched)."""
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
        rows.run(
            lambda a, c: LIB.hvdc_efsign_encode_segments(
                c,
                _row(g_at, a),
                _row(e_at, a),
                _row(rows.n, a),
                _row(scales32, a),
                _row(skip32, a),
                _row(out_at, a),
            )
        )
    return bodies
