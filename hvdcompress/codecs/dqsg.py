"""DQSG: dithered quantisation (Abdi & Fekri, arXiv 1904.01197; docs/design.md section 3).

Per bucket of ``bucket_size`` consecutive elements (default 512, the last may be short),
with s = ``levels`` (1..127) and the subtractive dither u_i = v_i - 1/2 in [-1/2, 1/2),
v_i the counter-based uniform of element i (hvdcompress.codecs.primitives; the key
hashes seed, step, rank and tensor id, all carried in the header, so the receiver
regenerates exactly the sender's dither):

    delta_b = max|w_bucket| / s                 # float32, one per bucket, transmitted
    q       = clamp(rint(w / delta_b + u), -s, s)   # 0 where delta_b == 0
    decode: w_hat = delta_b * (q - u)

Each step is one IEEE float32 operation (torch ops, identical on the CPU and CUDA).
The error w_hat - w is uniform on [-delta/2, delta/2] and independent of w (the point
of subtractive dither). Body: the deltas (float32 per bucket), then q: s = 1 as quartic
+ zero-run encoding (3LC's coder, digits q + 1), s > 1 as codes q + s in
ceil(log2(2 s + 1)) bits, bit-packed LSB first.
"""

from __future__ import annotations

import torch

from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import threelc
from hvdcompress.codecs.quant import num_buckets, padded
from hvdcompress.errors import PayloadError

DEFAULT_BUCKET = 512


def dqsg_bits(levels: int) -> int:
    return prim.bits_for(2 * levels + 1)


def dither(key: int, n: int, device: torch.device) -> torch.Tensor:
    """u in [-1/2, 1/2): exact (uniforms are multiples of 2**-24)."""
    return prim.uniform(key, n, device) - 0.5


def bucket_absmax(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """max |x| per bucket (float32; exact, so the same on every device)."""
    if x.numel() == 0:
        return x.new_zeros(0)
    return padded(x, bucket).abs().amax(dim=1)


def quantize(
    w: torch.Tensor, levels: int, bucket: int, key: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 in [-s, s], deltas float32 per bucket) for the finite flat float32 w."""
    n = w.numel()
    w2 = padded(w, bucket)
    deltas = prim.divide(bucket_absmax(w, bucket), float(levels))
    safe = torch.where(deltas > 0, deltas, torch.ones_like(deltas))[:, None]
    t = w2 / safe
    t += dither(key, w2.numel(), w.device).view(w2.shape)
    q = torch.round_(t).clamp_(-levels, levels).to(torch.int8)
    return q.view(-1)[:n], deltas


def encode(w: torch.Tensor, levels: int, bucket: int, key: int) -> torch.Tensor:
    q, deltas = quantize(w, levels, bucket, key)
    if levels == 1:
        packed = threelc.zero_run_encode(threelc.quartic_encode(q))
    else:
        packed = prim.bitpack((q.to(torch.int16) + levels).to(torch.uint8), dqsg_bits(levels))
    return torch.cat([prim.float_bytes(deltas), packed])


def decode_q(body: torch.Tensor, n: int, levels: int, bucket: int):
    """(q int8, deltas float32) from a body; raises PayloadError when corrupt."""
    nb = num_buckets(n, bucket)
    if body.numel() < 4 * nb:
        raise PayloadError("body", f"{body.numel()} bytes cannot hold {nb} bucket deltas")
    deltas = prim.floats_from(body, nb)
    if nb and not bool((torch.isfinite(deltas) & (deltas >= 0)).all()):
        raise PayloadError("body", "a DQSG delta is negative or not finite")
    rest = body[4 * nb :]
    if levels == 1:
        qb = threelc.zero_run_decode(rest, threelc.quartic_len(n))
        q = threelc.quartic_decode(qb, n)
    else:
        codes = prim.bitunpack(rest, n, dqsg_bits(levels))
        if n and int(codes.max()) > 2 * levels:
            raise PayloadError("body", f"a DQSG code is above {2 * levels}")
        q = (codes.to(torch.int16) - levels).to(torch.int8)
    return q, deltas


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
    if n == 0:
        return
    q2 = padded(q, bucket).to(torch.float32)
    q2 -= dither(key, q2.numel(), out.device).view(q2.shape)
    val = (deltas[:, None] * q2).view(-1)[:n]
    if accumulate:
        out += val
    else:
        out.copy_(val)
