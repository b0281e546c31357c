"""Stochastic quantisers: QSGD and TernGrad (docs/baselines.md, "QSGD" and "TernGrad": the
float32 operations, layouts and receiver checks).

QSGD (Alistarh et al., NeurIPS 2017) with s = ``levels`` (1..127) and a norm per bucket of
``bucket_size`` consecutive elements (as in the paper's experiments, bounded variance on
large tensors): l = floor(|x| / norm_b * s + u) for the counter-based uniform u, decoded
as +-(l / s) * norm_b, so E[x_hat] = x (up to float rounding). Body: the float32 norms,
then one code 2 l + sign per element in ``1 + ceil(log2(s + 1))`` bits, bit-packed.

TernGrad (Wen et al., NeurIPS 2017), scale per tensor: M = max|x|, q = sign(x) * [u < |x| /
M] in {-1, 0, 1}, decode M q (unbiased); q is quartic + zero-run encoded exactly like 3LC
(hvdcompress.codecs.threelc), so the 3LC decoder decodes it. The paper's gradient clipping
is left to the optimizer.
"""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.codecs import primitives as prim
from hvdcompress.errors import PayloadError

MAX_LEVELS = 127


def int_in(v, lo: int, hi: int) -> bool:
    """v is an int (not a bool, a float equal to one will do) in [lo, hi]."""
    return not isinstance(v, bool) and int(v) == v and lo <= v <= hi


def check_levels(levels: int, name: str) -> int:
    if not int_in(levels, 1, MAX_LEVELS):
        raise ValueError(f"{name} levels must be an int in [1, {MAX_LEVELS}], got {levels!r}")
    return int(levels)


def check_bucket(bucket_size: int, name: str) -> int:
    if not int_in(bucket_size, 1, 2**31 - 1):
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
    """Body for the flat float32 x (one native pass: bucket norms and packed codes), or
    None when x holds a NaN or an Inf or a norm overflows float32."""
    bodies = for_device(x.device).qsgd_encode_segments(
        [x], levels, qsgd_bits(levels), bucket, [key]
    )
    return bodies[0]


def qsgd_decode_into(
    body: torch.Tensor, n: int, levels: int, bucket: int, out: torch.Tensor, accumulate: bool
) -> None:
    """Write (or add) the decoded values into flat float32 ``out``; PayloadError, ``out``
    untouched, on a wrong length, a bad norm, set padding bits or an invalid code;
    ValueError for levels outside [1, 127] (the caller's, not the payload's)."""
    levels = check_levels(levels, "QSGD")
    bits = qsgd_bits(levels)
    need = 4 * num_buckets(n, bucket) + prim.packed_len(n, bits)
    if body.numel() != need:
        raise PayloadError("body", f"QSGD of {n} values needs {need} bytes, got {body.numel()}")
    if n == 0:
        return
    body = body.reshape(-1).to(out.device).contiguous()
    qsgd_decode_with(for_device(out.device), body, n, levels, bits, bucket, out, accumulate)


def qsgd_decoded_bound(body: torch.Tensor, n: int, bucket: int) -> float:
    """The largest norm of a decoded (so checked) body: every decoded |value|, fl32(fl32(l /
    s) * norm_b) with l <= s, is at most its bucket's norm (rounding is monotone)."""
    nb = num_buckets(n, bucket)
    return float(body[: 4 * nb].clone().view(torch.float32).max()) if nb else 0.0


def qsgd_decode_with(backend, body, n, levels, bits, bucket, out, accumulate) -> None:
    """One checked body through ``backend``'s bucket decoder (a bucket of one)."""
    segment = body, prim.one(0), prim.one(n), levels, bits, bucket
    # -0.0 + v is v: written (not added) is added into -0.0
    prim.decode_one(lambda t: backend.qsgd_decode_segments(*segment, [t]), out, accumulate)


def terngrad_encode(x: torch.Tensor, key: int) -> tuple[torch.Tensor, float] | None:
    """(zero-run-encoded quartic body, the float32 scale M = max|x|) of the flat float32 x,
    or None when x holds a NaN or an Inf."""
    return terngrad_encode_segments([x], [key])[0]


def qsgd_encode_segments(
    xs: list[torch.Tensor], levels: int, bucket: int, keys: list[int]
) -> list[torch.Tensor | None]:
    """``qsgd_encode`` of each (x, key) of a bucket (contiguous float32 on one device)."""
    levels = check_levels(levels, "QSGD")
    return for_device(xs[0].device).qsgd_encode_segments(
        xs, levels, qsgd_bits(levels), bucket, keys
    )


def terngrad_encode_segments(
    xs: list[torch.Tensor], keys: list[int]
) -> list[tuple[torch.Tensor, float] | None]:
    """``terngrad_encode`` of each (x, key) of a bucket (contiguous float32 on one device)."""
    return for_device(xs[0].device).terngrad_encode_segments(xs, keys)


def qsgd_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    levels: int,
    bucket: int,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``qsgd_decode_into`` (accumulating) of each body ``frame[starts[i]:][:lens[i]]`` into
    ``outs[i]`` (``GatherCompressor.decode_segments``)."""
    backend = for_device(outs[0].device) if outs else for_device(frame.device)
    levels = check_levels(levels, "QSGD")
    bits = qsgd_bits(levels)
    need = 4 * ((ns + bucket - 1) // bucket) + (ns * bits + 7) // 8

    def decode(upto: int):
        failed = backend.qsgd_decode_segments(
            frame, starts[:upto].copy(), ns[:upto].copy(), levels, bits, bucket, outs[:upto]
        )
        return None if failed is None else (failed[0], PayloadError("body", failed[1]))

    def length_error(i: int) -> PayloadError:
        n, got = int(ns[i]), int(lens[i])
        return PayloadError("body", f"QSGD of {n} values needs {int(need[i])} bytes, got {got}")

    return prim.decode_to_wrong_length(lens, need, decode, length_error)
