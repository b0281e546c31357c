"""3LC on the CPU (kernels/threelc.c): the fused encode / decode, its building blocks
(quantise, quartic, zero-run) and the bucket encoders and decoders."""

from __future__ import annotations

import math

import numpy as np
import torch

from hvdcompress.backends.cpu._library import (
    _ERRORS,
    LIB,
    NONFINITE_BITS,
    _addresses,
    _bodies_buffer,
    _check,
    _decode,
    _message,
    _native,
    _numels,
    _ptr,
)
from hvdcompress.errors import PayloadError


def scale_for(max_bits: int, sparsity: float) -> tuple[float, bool]:
    """S = float32(sparsity) * M in float32, and whether the input (or S) is non-finite."""
    if max_bits >= NONFINITE_BITS:
        return 0.0, True
    scale = LIB.hvdc_threelc_scale(max_bits, sparsity)
    if not math.isfinite(scale):  # s * M overflowed float32
        return 0.0, True
    return scale, False


def quantize(x, sparsity):
    n = x.numel()
    scale, nonfinite = scale_for(LIB.hvdc_threelc_absmax_bits(_ptr(x), None, n), sparsity)
    if nonfinite:
        raise ValueError("quantize: input holds NaN or Inf (or max|x| * sparsity overflows)")
    q = torch.empty(n, dtype=torch.int8)
    LIB.hvdc_threelc_quantize(_ptr(x), None, None, scale, n, _ptr(q), None)
    return q, torch.tensor(scale, dtype=torch.float32)


def quartic_encode(q):
    if q.numel() and (q.min() < -1 or q.max() > 1):
        raise ValueError("quartic_encode: digits must be in {-1, 0, 1}")
    out = torch.empty((q.numel() + 4) // 5, dtype=torch.uint8)
    LIB.hvdc_threelc_quartic_encode(_ptr(q), q.numel(), _ptr(out))
    return out


def quartic_decode(buf, numel):
    q = torch.empty(numel, dtype=torch.int8)
    _check(LIB.hvdc_threelc_quartic_decode(_ptr(buf), numel, _ptr(q)))
    return q


def zero_run_encode(buf):
    if buf.numel() and buf.max() > 242:
        raise ValueError("zero_run_encode: quartic bytes are at most 242")
    out = torch.empty(buf.numel() + 2, dtype=torch.uint8)  # 2 bytes of encoder slack
    length = LIB.hvdc_threelc_zre_encode(_ptr(buf), buf.numel(), _ptr(out))
    return out[:length].clone()


def zero_run_decode(buf, expected_len=None):
    total = LIB.hvdc_threelc_zre_decoded_len(_ptr(buf), buf.numel())
    if expected_len is not None and total != expected_len:
        raise PayloadError(
            "body", f"zero-run decoding gives {total} bytes, expected {expected_len}"
        )
    out = torch.empty(total, dtype=torch.uint8)
    _check(LIB.hvdc_threelc_zre_decode(_ptr(buf), buf.numel(), _ptr(out), total))
    return out


def threelc_encode_segments(gs, es, sparsities):
    count = len(gs)
    ns = _numels(gs)
    room = (ns + 4) // 5 + 2
    buf, starts = _bodies_buffer(room)
    scales = np.empty(count, dtype=np.float32)
    lens = np.empty(count, dtype=np.int64)
    s = np.asarray(sparsities, dtype=np.float32)
    g_at, e_at = _addresses(gs), _addresses(es)
    _native(LIB.hvdc_threelc_encode_segments, count, g_at, e_at, ns, s, buf, starts, scales, lens)
    spans = zip(starts.tolist(), lens.tolist(), strict=True)
    bodies = [buf[a : a + n] if n >= 0 else buf[:0] for a, n in spans]
    return bodies, scales.tolist(), (lens < 0).tolist()


def threelc_decode_segments(frame, starts, lens, ns, scales, outs):
    scales32, out_at = np.ascontiguousarray(scales, dtype=np.float32), _addresses(outs)
    fn, tables = LIB.hvdc_threelc_decode_segments, (starts, lens, ns)
    failed = _decode(fn, len(outs), frame, tables, scales32, out_at)
    return None if failed is None else (failed[0], _message(failed[1], _ERRORS))
