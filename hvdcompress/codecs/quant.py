"""Stochastic quantisers: QSGD and TernGrad (docs/design.md section 4).

QSGD (Alistarh et al., NeurIPS 2017) with s = ``levels`` (1..127) and buckets of
``bucket_size`` consecutive elements (default 512, the last one may be short; as in the
paper's experiments, a norm per bucket keeps the variance bounded on large tensors):

    norm_b = float32(sqrt(sum over the bucket of x^2))   # sum in double, order fixed
    r      = (|x| / norm_b) * s                          # float32, in [0, s]
    l      = floor(r + u)                                # u: counter-based uniform [0, 1)
    decode: x_hat = -((l / s) * norm_b) if x < 0 else (l / s) * norm_b

E[l] = r, so E[x_hat] = x (up to float rounding). Body: the norms (float32 per bucket),
then one code per element, ``1 + ceil(log2(s + 1))`` bits (s = 16: 6 bits), bit-packed LSB
first: code = 2 l + sign, sign = 1 for x < 0 with l > 0 (a zero is never "negative").

TernGrad (Wen et al., NeurIPS 2017), scale per tensor: M = max|x|, q = sign(x) * [u < |x| /
M] in {-1, 0, 1}, decode M q (unbiased); q is quartic + zero-run encoded exactly like 3LC
(hvdcompress.codecs.threelc), so the 3LC decoder decodes it. The paper's gradient clipping
is left to the optimizer.
"""

from __future__ import annotations

import torch

from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import threelc
from hvdcompress.errors import PayloadError

MAX_LEVELS = 127
DEFAULT_BUCKET = 512


def check_levels(levels: int, name: str, hi: int = MAX_LEVELS) -> int:
    if isinstance(levels, bool) or int(levels) != levels or not 1 <= levels <= hi:
        raise ValueError(f"{name} levels must be an int in [1, {hi}], got {levels!r}")
    return int(levels)


def check_bucket(bucket_size: int, name: str) -> int:
    if (
        isinstance(bucket_size, bool)
        or int(bucket_size) != bucket_size
        or not (1 <= bucket_size <= 2**31 - 1)
    ):
        raise ValueError(
            f"{name} bucket_size must be an int in [1, 2**31 - 1], got {bucket_size!r}"
        )
    return int(bucket_size)


def qsgd_bits(levels: int) -> int:
    return 1 + prim.bits_for(levels + 1)


def num_buckets(n: int, bucket: int) -> int:
    return (n + bucket - 1) // bucket


def padded(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """x as a (buckets, bucket) view, zero-padded at the end (a copy only when n % bucket)."""
    n = x.numel()
    pad = -n % bucket
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, bucket)


def qsgd_encode(x: torch.Tensor, levels: int, bucket: int, key: int) -> torch.Tensor | None:
    """Body for the flat float32 x, or None when a norm overflows float32."""
    n = x.numel()
    norms = torch.sqrt(prim.chunk_sums(x, bucket, True)).to(torch.float32)
    if not prim.all_finite(norms):
        return None
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))[:, None]
    x2 = padded(x, bucket)
    r = (x2.abs() / safe) * float(levels)
    r += prim.uniform(key, x2.numel(), x.device).view(x2.shape)
    lvl = torch.floor_(r).clamp_(0, levels).to(torch.uint8)
    neg = ((x2 < 0) & (lvl > 0)).to(torch.uint8)
    codes = (lvl * 2 + neg).view(-1)[:n]
    return torch.cat([prim.float_bytes(norms), prim.bitpack(codes, qsgd_bits(levels))])


def qsgd_decode_into(
    body: torch.Tensor, n: int, levels: int, bucket: int, out: torch.Tensor, accumulate: bool
) -> None:
    nb = num_buckets(n, bucket)
    bits = qsgd_bits(levels)
    if body.numel() != 4 * nb + prim.packed_len(n, bits):
        raise PayloadError(
            "body",
            f"QSGD of {n} values needs {4 * nb + prim.packed_len(n, bits)} bytes, "
            f"got {body.numel()}",
        )
    norms = prim.floats_from(body, nb)
    if nb and not bool((torch.isfinite(norms) & (norms >= 0)).all()):
        raise PayloadError("body", "a QSGD norm is negative or not finite")
    codes = prim.bitunpack(body[4 * nb :], n, bits)
    lvl = codes >> 1
    neg = codes & 1
    if n and (int(lvl.max()) > levels or bool(((lvl == 0) & (neg == 1)).any())):
        raise PayloadError("body", f"a QSGD level is above {levels} or a zero is signed")
    if n == 0:
        return
    mag = prim.divide(padded(lvl, bucket).to(torch.float32), float(levels)) * norms[:, None]
    mag = mag.view(-1)[:n]
    val = torch.where(neg.bool(), -mag, mag)
    if accumulate:
        out += val
    else:
        out.copy_(val)


def terngrad_encode(x: torch.Tensor, key: int) -> tuple[torch.Tensor, float]:
    """(zero-run-encoded quartic body, the float32 scale M) for the finite flat x."""
    n = x.numel()
    scale = prim.absmax(x)
    if scale == 0.0:
        q = torch.zeros(n, dtype=torch.int8, device=x.device)
    else:
        keep = prim.uniform(key, n, x.device) < prim.divide(x.abs(), scale)
        q = torch.where(keep, torch.sign(x), torch.zeros_like(x)).to(torch.int8)
    return threelc.zero_run_encode(threelc.quartic_encode(q)), scale


def terngrad_decode_into(
    body: torch.Tensor, n: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    threelc.decode_into(body, n, scale, out, accumulate)
