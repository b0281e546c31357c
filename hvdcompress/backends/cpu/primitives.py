"""The shared primitives on the CPU (kernels/primitives.c; see
hvdcompress.codecs.primitives): counter-based uniforms, bit packing, chunk sums and the
non-finite check."""

from __future__ import annotations

import torch

from hvdcompress.backends.cpu._library import _PRIM_ERRORS, LIB, _check, _ptr


def uniform(key, n, device=None):
    out = torch.empty(n, dtype=torch.float32)
    if n:
        LIB.hvdc_prim_uniform(key, 0, n, _ptr(out))
    return out


def bitpack(codes, bits):
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    if n:
        LIB.hvdc_prim_bitpack(_ptr(codes), n, bits, _ptr(out))
    return out


def bitunpack(buf, n, bits):
    codes = torch.empty(n, dtype=torch.uint8)
    _check(LIB.hvdc_prim_bitunpack(_ptr(buf), buf.numel(), n, bits, _ptr(codes)), _PRIM_ERRORS)
    return codes


def chunk_sums(x, chunk, square):
    n = x.numel()
    out = torch.empty((n + chunk - 1) // chunk, dtype=torch.float64)
    if n:
        LIB.hvdc_prim_chunk_sums(_ptr(x), n, chunk, int(square), _ptr(out))
    return out


# A floating dtype's exponent field (all bits set: a NaN or an Inf) and its element width.
EXPONENT_BITS = {
    torch.float32: (4, 0x7F800000),
    torch.float16: (2, 0x7C00),
    torch.bfloat16: (2, 0x7F80),
}


def nonfinite(x):
    width, exponent = EXPONENT_BITS[x.dtype]
    if not x.is_contiguous():
        raise ValueError("nonfinite takes a contiguous tensor")
    return bool(x.numel()) and bool(LIB.hvdc_prim_nonfinite(_ptr(x), x.numel(), width, exponent))
