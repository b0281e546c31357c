"""The stochastic quantisers on the CPU (kernels/quant.c; see hvdcompress.codecs.quant):
QSGD, TernGrad, DQSG and NDQSG, per tensor and per bucket."""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from hvdcompress.backends.cpu._library import (
    _F32,
    _PRIM_ERRORS,
    LIB,
    NONFINITE_BITS,
    _addresses,
    _bodies_buffer,
    _decode,
    _message,
    _native,
    _numels,
    _parts,
    _ptr,
    _run_parts,
    _scratch,
    splits,
)


def dqsg_quantize(w, levels, bucket, key, code_offset):
    """A native call a part (``_parts``, whole buckets) on the codec threads."""
    n = w.numel()
    nb = (n + bucket - 1) // bucket
    deltas = torch.empty(nb, dtype=torch.float32)
    q = torch.empty(n, dtype=torch.uint8)
    pw, pd, pq = _ptr(w), _ptr(deltas), _ptr(q)

    def part(lo: int, hi: int) -> int:
        return LIB.hvdc_dqsg_quantize(
            pw + _F32 * lo, hi - lo, levels, bucket, key, lo, code_offset,
            pd + 4 * (lo // bucket), pq + lo,
        )  # fmt: skip

    return None if any(_run_parts(part, _parts(n, bucket))) else (q, deltas)


def dqsg_dequantize(q, deltas, bucket, key, out, accumulate):
    """A native call a part (``_parts``, whole buckets) on the codec threads."""
    n = q.numel()
    pq, pd, po = _ptr(q), _ptr(deltas), _ptr(out)

    def part(lo: int, hi: int) -> None:
        LIB.hvdc_dqsg_dequantize(
            pq + lo, hi - lo, pd + 4 * (lo // bucket), bucket, key, lo, po + _F32 * lo,
            int(accumulate),
        )  # fmt: skip

    _run_parts(part, _parts(n, bucket))


def ndqsg_coset(k, rho, code_offset):
    out = torch.empty(k.numel(), dtype=torch.uint8)
    LIB.hvdc_ndqsg_coset(_ptr(k), k.numel(), rho, code_offset, _ptr(out))
    return out


def ndqsg_side_decode(m, deltas, y, rho, bucket, key, out, accumulate, k_true):
    """One pass."""
    fn = LIB.hvdc_ndqsg_side_decode
    return int(_native(fn, m, m.numel(), deltas, y, rho, bucket, key, out, int(accumulate), k_true))


def qsgd_encode_segments(xs, levels, bits, bucket, keys):
    """A native call a tensor (a part a thread for a tensor they cut), no native bucket
    encoder: QSGD's encode is bound by its codec (norms, uniforms, codes), not by the call."""
    bodies: list[torch.Tensor | None] = []
    align = bucket * 8 // math.gcd(bucket, 8)  # whole buckets and whole bytes
    for x, key in zip(xs, keys, strict=True):
        n = x.numel()
        nb = (n + bucket - 1) // bucket
        body = torch.empty(4 * nb + (n * bits + 7) // 8, dtype=torch.uint8)
        px, pb = _ptr(x), _ptr(body)
        packed = pb + 4 * nb

        def part(lo: int, hi: int, px=px, pb=pb, packed=packed, key=key) -> int:
            return LIB.hvdc_qsgd_encode(
                px + _F32 * lo, hi - lo, levels, bits, bucket, key, lo, pb + 4 * (lo // bucket),
                packed + lo * bits // 8,
            )  # fmt: skip

        bodies.append(None if any(_run_parts(part, _parts(n, align))) else body)
    return bodies


def qsgd_decode_segments(frame, starts, ns, levels, bits, bucket, outs):
    fn, out_at = LIB.hvdc_qsgd_decode_segments, _addresses(outs)
    failed = _decode(fn, len(outs), frame, (starts, ns), levels, bits, bucket, out_at)
    return None if failed is None else (failed[0], _message(failed[1], _PRIM_ERRORS))


def terngrad_encode_segments(xs, keys):
    """One native call, except for the tensors the codec threads cut (``splits``): their
    quartic digits a part a thread, then their zero-run encode."""
    cut = [i for i, x in enumerate(xs) if splits(x.numel())]
    if not cut:
        return _terngrad_bucket(xs, keys)
    rest = [i for i in range(len(xs)) if i not in set(cut)]
    batch = _terngrad_bucket([xs[i] for i in rest], [keys[i] for i in rest])
    out = dict(zip(rest, batch, strict=True))
    out.update({i: _terngrad_cut(xs[i], keys[i]) for i in cut})
    return [out[i] for i in range(len(xs))]


def _terngrad_cut(x: torch.Tensor, key: int) -> tuple[torch.Tensor, float] | None:
    n = x.numel()
    bits = LIB.hvdc_threelc_absmax_bits(_ptr(x), None, n)
    if bits >= NONFINITE_BITS:
        return None
    scale = struct.unpack("<f", struct.pack("<I", bits))[0]
    m = (n + 4) // 5
    quartic = _scratch(2 * m + 2)
    px, pq = _ptr(x), _ptr(quartic)

    def part(lo: int, hi: int) -> None:
        LIB.hvdc_terngrad_quartic(px + _F32 * lo, hi - lo, scale, key, lo, pq + lo // 5)

    _run_parts(part, _parts(n, 5 * 8))
    length = LIB.hvdc_threelc_zre_encode(pq, m, pq + m)
    return quartic[m : m + length].clone(), scale


def _terngrad_bucket(
    xs: list[torch.Tensor], keys: list[int]
) -> list[tuple[torch.Tensor, float] | None]:
    count = len(xs)
    ns = _numels(xs)
    room = (ns + 4) // 5 + 2
    buf, starts = _bodies_buffer(room)
    quartic = _scratch(int(room.max()) if count else 1)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    scales = np.empty(count, dtype=np.float32)
    lens = np.empty(count, dtype=np.int64)
    tail = (buf, starts, quartic, scales, lens)
    _native(LIB.hvdc_terngrad_encode_segments, count, _addresses(xs), ns, key_array, *tail)
    spans = zip(starts.tolist(), lens.tolist(), scales.tolist(), strict=True)
    return [None if n < 0 else (buf[a : a + n], m) for a, n, m in spans]


def dqsg_encode_segments(xs, keys, levels, bits, bucket):
    count = len(xs)
    ns = _numels(xs)
    nb = (ns + bucket - 1) // bucket
    room = 4 * nb + (ns * bits + 7) // 8
    buf, starts = _bodies_buffer(room)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    bad = np.zeros(count, dtype=np.int32)
    deltas = np.empty(max(int(nb.max()) if count else 0, 1), dtype=np.float32)
    codes = np.empty(max(int(ns.max()) if count else 0, 1), dtype=np.uint8)
    _native(
        LIB.hvdc_dqsg_encode_segments, count, _addresses(xs), ns, key_array, levels, bits,
        bucket, buf, starts, bad, deltas, codes,
    )  # fmt: skip
    spans = zip(starts.tolist(), room.tolist(), bad.tolist(), strict=True)
    return [None if b else buf[a : a + r] for a, r, b in spans]


def dqsg_decode_segments(frame, starts, lens, ns, keys, levels, bits, bucket, outs):
    key_array = np.asarray(keys, dtype=np.uint64).reshape(len(outs))
    codes = np.empty(max(int(ns.max()) if len(outs) else 0, 1), dtype=np.uint8)
    args = key_array, levels, bits, bucket, _addresses(outs), codes
    return _decode(LIB.hvdc_dqsg_decode_segments, len(outs), frame, (starts, lens, ns), *args)


def digits_encode_segments(xs, keys, levels, rho, bits, bucket):
    count = len(xs)
    ns = _numels(xs)
    nb = (ns + bucket - 1) // bucket
    ternary = rho <= 3
    room = 4 * nb + ((ns + 4) // 5 + 2 if ternary else (ns * bits + 7) // 8)
    buf, starts = _bodies_buffer(room)
    k_starts = np.cumsum(ns) - ns
    ks = torch.empty(int(ns.sum()), dtype=torch.int8)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    lens = np.zeros(count, dtype=np.int64)
    most = max(int(ns.max()) if count else 0, 1)
    deltas = np.empty(max(int(nb.max()) if count else 0, 1), dtype=np.float32)
    codes = np.empty(most, dtype=np.uint8)
    quartic = np.empty((most + 4) // 5, dtype=np.uint8)
    _native(
        LIB.hvdc_digits_encode_segments, count, _addresses(xs), ns, key_array, levels, rho,
        bits, bucket, ks, k_starts, buf, starts, lens, deltas, codes, quartic,
    )  # fmt: skip
    spans = zip(starts.tolist(), lens.tolist(), strict=True)
    return [None if n < 0 else buf[a : a + n] for a, n in spans], ks


def digits_decode_segments(
    frame, starts, lens, ns, keys, bucket, outs, rho=0, bits=0, divisor=1, k_trues=None
):
    """One native call (NDQSG's side information formed in the same pass)."""
    count = len(outs)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    most = max(int(ns.max()) if count else 0, 1)
    digits = np.empty(most, dtype=np.int8)
    quartic = np.empty((most + 4) // 5, dtype=np.uint8)
    aliased = np.zeros(count, dtype=np.int64)
    k_at = _addresses(k_trues or [None] * count).reshape(count)
    args = key_array, rho, bits, bucket, float(divisor), _addresses(outs), k_at, aliased
    fn, tables = LIB.hvdc_digits_decode_segments, (starts, lens, ns)
    return aliased, _decode(fn, count, frame, tables, *args, digits, quartic)
