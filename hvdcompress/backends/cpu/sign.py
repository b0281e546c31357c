"""signSGD and EF-signSGD on the CPU (kernels/sign.c; see hvdcompress.codecs.sign)."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cpu._library import (
    _F32,
    _PRIM_ERRORS,
    LIB,
    _addresses,
    _check,
    _i64_array,
    _numels,
    _parts,
    _ptr,
    _run_parts,
)

# ---- sign codecs (kernels/sign.c; see hvdcompress.codecs.sign) -------------------------------


def sign_encode(x: torch.Tensor) -> torch.Tensor | None:
    """The packed sign bits of x (bit 1 for x < 0), or None when x holds a NaN or an Inf."""
    n = x.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    base, dst = _ptr(x), _ptr(out)

    def part(lo: int, hi: int) -> int:
        return LIB.hvdc_sign_encode(base + _F32 * lo, hi - lo, dst + lo // 8)

    return None if any(_run_parts(part, _parts(n, 8))) else out


def sign_encode_segments(xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``sign_encode`` of each tensor (a bucket) in one native call over a segment table;
    the bodies are views of one buffer."""
    sizes = [x.numel() for x in xs]
    nbytes = [(n + 7) // 8 for n in sizes]
    buf = torch.empty(sum(nbytes), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes)) if xs else []
    table = np.array(
        [[x.data_ptr() for x in xs], sizes, [b.data_ptr() for b in bodies]], dtype=np.uint64
    )
    flags = np.zeros(len(xs), dtype=np.int32)
    if xs:
        LIB.hvdc_sign_encode_segments(
            len(xs),
            table[0].ctypes.data,
            table[1].ctypes.data,
            table[2].ctypes.data,
            flags.ctypes.data,
        )
    return [None if bad else body for bad, body in zip(flags.tolist(), bodies, strict=True)]


EF_CHUNK = 1024  # elements per order-fixed partial sum of EF-signSGD's mean |a|


def efsign_sums(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
    """float64 sums of |g + e| over EF_CHUNK-element chunks (each left to right), or None
    when g + e holds a NaN or an Inf."""
    n = g.numel()
    sums = torch.empty((n + EF_CHUNK - 1) // EF_CHUNK, dtype=torch.float64)
    pg, pe, ps = _ptr(g), _ptr(e), _ptr(sums)

    def part(lo: int, hi: int) -> int:
        off = _F32 * lo
        return LIB.hvdc_efsign_sums(
            pg + off, pe + off, hi - lo, EF_CHUNK, ps + 8 * (lo // EF_CHUNK)
        )

    return None if any(_run_parts(part, _parts(n, EF_CHUNK))) else sums


def efsign_encode(g: torch.Tensor, e: torch.Tensor, scale: float) -> torch.Tensor:
    """The sign bits of a = g + e; e <- a - (a < 0 ? -scale : scale). a is finite."""
    n = g.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    pg, pe, po = _ptr(g), _ptr(e), _ptr(out)

    def part(lo: int, hi: int) -> None:
        LIB.hvdc_efsign_encode(pg + _F32 * lo, pe + _F32 * lo, scale, hi - lo, po + lo // 8)

    _run_parts(part, _parts(n, 8))
    return out


def sign_decode(
    body: torch.Tensor, n: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    """out = (bit ? -scale : scale), or out += that; body has ceil(n / 8) bytes."""
    _check(LIB.hvdc_sign_decode(_ptr(body), n, scale, _ptr(out), int(accumulate)), _PRIM_ERRORS)


def sign_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """``sign_decode`` (accumulating) of each body at ``frame[starts[p]:]`` (the caller
    checked the lengths) into ``outs[p]``, one native call: None, or (p, message) of the
    first body with a padding bit set (the ones before it are added)."""
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
    """``efsign_sums`` of each (g, e) of a bucket in one native call: (each tensor's chunk
    sums, each tensor's non-finite flag)."""
    count = len(gs)
    ns = _numels(gs)
    chunks = (ns + EF_CHUNK - 1) // EF_CHUNK
    starts = np.zeros(count, dtype=np.int64)
    np.cumsum(chunks[:-1], out=starts[1:])
    sums = np.zeros(max(int(chunks.sum()), 1), dtype=np.float64)
    bad = np.zeros(count, dtype=np.int32)
    g_at, e_at = _addresses(gs), _addresses(es)  # locals: alive across the call
    LIB.hvdc_efsign_sums_segments(
        count,
        g_at.ctypes.data,
        e_at.ctypes.data,
        ns.ctypes.data,
        EF_CHUNK,
        sums.ctypes.data,
        starts.ctypes.data,
        bad.ctypes.data,
    )
    bounds = zip(starts.tolist(), (starts + chunks).tolist(), strict=True)
    return [sums[a:b].tolist() for a, b in bounds], [bool(b) for b in bad.tolist()]


def efsign_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor], scales: list[float], skip: list[bool]
) -> list[torch.Tensor]:
    """``efsign_encode`` of each (g, e, scale) of a bucket whose ``skip`` is False, in one
    native call: the bodies (views of one new buffer; empty where skipped)."""
    count = len(gs)
    ns = _numels(gs)
    nbytes = np.where(np.asarray(skip, dtype=bool), 0, (ns + 7) // 8)
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes.tolist())) if count else []
    g_at, e_at, out_at = _addresses(gs), _addresses(es), _addresses(bodies)
    scales32 = np.asarray(scales, dtype=np.float32)
    skip32 = np.asarray(skip, dtype=np.int32)
    LIB.hvdc_efsign_encode_segments(
        count,
        g_at.ctypes.data,
        e_at.ctypes.data,
        ns.ctypes.data,
        scales32.ctypes.data,
        skip32.ctypes.data,
        out_at.ctypes.data,
    )
    return bodies
