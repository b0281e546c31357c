"""DQSG: dithered quantisation (Abdi & Fekri, arXiv 1904.01197; docs/codecs.md, "DQSG":
the float32 operations, packing and receiver checks).

Per bucket of ``bucket_size`` consecutive elements, with s = ``levels`` (1..127) and the
subtractive dither u_i = v_i - 1/2, v_i the counter-based uniform of element i (its key
travels in the header, so the receiver regenerates exactly the sender's dither):

    delta_b = max|w_bucket| / s                 # float32, one per bucket, transmitted
    q       = clamp(rint(w / delta_b + u), -s, s)   # 0 where delta_b == 0
    decode: w_hat = delta_b * (q - u)

The error w_hat - w is uniform on [-delta/2, delta/2] and independent of w (the point of
subtractive dither). Body: the deltas, then q: s = 1 quartic + zero-run coded (3LC's
coder), s > 1 as codes q + s, bit-packed. Native on both devices, byte for byte the same.
"""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import threelc
from hvdcompress.codecs.quant import num_buckets
from hvdcompress.errors import PayloadError


def dqsg_bits(levels: int) -> int:
    return prim.bits_for(2 * levels + 1)


def quantize(
    w: torch.Tensor, levels: int, bucket: int, key: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in [-s, s], deltas float32 per bucket) for the finite flat float32 w (one
    native pass per bucket: its max, then q)."""
    result = for_device(w.device).dqsg_quantize(w, levels, bucket, key, 0)
    if result is None:
        raise ValueError("dqsg quantize: the input holds NaN or Inf")
    q, deltas = result
    return q.view(torch.int8), deltas


def encode(w: torch.Tensor, levels: int, bucket: int, key: int) -> torch.Tensor | None:
    """The body of the flat float32 w, or None when w holds a NaN or an Inf. s > 1: the
    quantiser writes the codes q + s that are bit-packed; s = 1: q, quartic + zero-run
    encoded."""
    code_offset = 0 if levels == 1 else levels
    result = for_device(w.device).dqsg_quantize(w, levels, bucket, key, code_offset)
    if result is None:
        return None
    codes, deltas = result
    if levels == 1:
        packed = threelc.zero_run_encode(threelc.quartic_encode(codes.view(torch.int8)))
    else:
        packed = prim.bitpack(codes, dqsg_bits(levels))
    return torch.cat([prim.float_bytes(deltas), packed])


def decode_q(body: torch.Tensor, n: int, levels: int, bucket: int):
    """(q int8, deltas float32) from a body; raises PayloadError when corrupt."""
    return read_body(body, n, bucket, levels == 1, levels, "a DQSG")


def read_body(body: torch.Tensor, n: int, bucket: int, ternary: bool, half: int, what: str):
    """(digits int8 in [-half, half], deltas float32) of a DQSG or NDQSG body: the deltas,
    then the digits quartic + zero-run coded (``ternary``) or as codes digit + half;
    PayloadError naming ``what`` ("a DQSG") when corrupt."""
    nb = num_buckets(n, bucket)
    if body.numel() < 4 * nb:
        raise PayloadError("body", f"{body.numel()} bytes cannot hold {nb} bucket deltas")
    deltas = prim.floats_from(body, nb)
    if nb and not bool((torch.isfinite(deltas) & (deltas >= 0)).all()):
        raise PayloadError("body", f"{what} delta is negative or not finite")
    rest = body[4 * nb :]
    if ternary:  # {-1, 0, 1}: every digit is valid
        qb = threelc.zero_run_decode(rest, threelc.quartic_len(n))
        return threelc.quartic_decode(qb, n), deltas
    codes = prim.bitunpack(rest, n, prim.bits_for(2 * half + 1))
    if n and int(codes.max()) > 2 * half:
        raise PayloadError("body", f"{what} code is above {2 * half}")
    return (codes.to(torch.int16) - half).to(torch.int8), deltas


def max_numel(body_len: int, levels: int) -> int:
    """The most values a body of ``body_len`` bytes can hold."""
    if levels == 1:
        return body_len * threelc.MAX_VALUES_PER_BYTE
    return 8 * body_len // dqsg_bits(levels)


def decode_into(
    body: torch.Tensor,
    n: int,
    levels: int,
    bucket: int,
    key: int,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    q, deltas = decode_q(body, n, levels, bucket)
    dequantize_into(q, deltas, bucket, key, out, accumulate)


def dequantize_into(
    q: torch.Tensor,
    deltas: torch.Tensor,
    bucket: int,
    key: int,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """out = delta * (q - u), or out += that, for ``decode_q``'s (q, deltas)."""
    if q.numel() == 0:
        return
    for_device(out.device).dqsg_dequantize(q, deltas, bucket, key, out, accumulate)


def encode_segments(
    ws: list[torch.Tensor], levels: int, bucket: int, keys: list[int]
) -> list[torch.Tensor | None]:
    """``encode`` of each (w, key) of a bucket (contiguous float32 on one device): one
    backend call for the tensors the codec threads do not cut (``splits``)."""
    from hvdcompress.backends import cpu

    backend = for_device(ws[0].device)
    bits = dqsg_bits(levels)

    def batched(pairs):
        xs, ks = [w for w, _ in pairs], [k for _, k in pairs]
        if levels == 1 and backend is cpu:  # ternary q: quartic + zero-run codes
            return cpu.digits_encode_segments(xs, ks, 1, 0, 0, bucket)[0]
        return backend.dqsg_encode_segments(xs, ks, levels, bits, bucket)

    def single(w, key):
        return encode(w, levels, bucket, key)

    return prim.batched_except_split(ws, keys, backend.splits, batched, single)


def decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    levels: int,
    bucket: int,
    keys: list[int],
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``decode_into`` (accumulating) of each body ``frame[starts[i]:][:lens[i]]`` into
    ``outs[i]`` (``GatherCompressor.decode_segments``)."""
    from hvdcompress.backends import cpu

    backend = for_device(outs[0].device) if outs else cpu
    if levels == 1 and backend is cpu:  # ternary q: quartic + zero-run codes
        failed = cpu.digits_decode_segments(frame, starts, lens, ns, keys, bucket, outs)[1]
    else:
        failed = backend.dqsg_decode_segments(
            frame, starts, lens, ns, keys, levels, dqsg_bits(levels), bucket, outs
        )
    if failed is None:
        return None
    i = failed[0]  # the per-payload decoder's error names the check
    body = frame[int(starts[i]) : int(starts[i]) + int(lens[i])]
    return i, prim.refusal(lambda: decode_q(body, int(ns[i]), levels, bucket))
