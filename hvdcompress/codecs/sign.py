"""Sign codecs: signSGD and EF-signSGD (docs/baselines.md, "signSGD and EF-signSGD").

signSGD (Bernstein et al., ICML 2018): one bit per value, bit 1 for x < 0, bit-packed LSB
first; decoding gives +1 or -1 (a zero, or -0.0, is sent as +1). The paper aggregates by
majority vote; here the decoded signs are averaged across ranks (the sign-compressed
gradient mean, whose magnitude does not shrink with the gradient: the learning rate takes
the role of the step size, typically 1e-4 .. 1e-3).

EF-signSGD (Karimireddy et al., ICML 2019): a = g + e, scale = mean|a| (float32 of the
correctly rounded sum of order-fixed chunk sums, divided by n), decoded value scale *
sign(a) (zero as +1), residual e = a - scale * sign(a).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.codecs import primitives as prim
from hvdcompress.errors import PayloadError


def encode(x: torch.Tensor) -> torch.Tensor | None:
    """signSGD body of the flat float32 x (one native pass), or None when x holds a NaN
    or an Inf."""
    return encode_segments([x])[0]


def encode_segments(xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``encode`` of each flat float32 tensor of a bucket (all on one device)."""
    if not xs:
        return []
    return for_device(xs[0].device).sign_encode_segments(xs)


def ef_scale(sums: torch.Tensor | list[float], n: int) -> float:
    """mean |a| as float32: the correctly rounded sum of the order-fixed chunk sums,
    divided by n (0.0 when n == 0)."""
    if n == 0:
        return 0.0
    values = sums.cpu().tolist() if isinstance(sums, torch.Tensor) else sums
    return float(np.float32(math.fsum(values) / n))


def ef_encode(g: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """EF-signSGD of a = g + e (flat float32): (body, scale = mean|a|), the residual e set to
    a - scale * sign(a) in place; None, e untouched, when a holds a NaN or an Inf. Two
    native passes: the chunk sums of |a| (and the finiteness check), then bits and e."""
    return ef_encode_segments([g], [e])[0]


def ef_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor]
) -> list[tuple[torch.Tensor, float] | None]:
    """``ef_encode`` of each (g, e) of a bucket (flat float32 on one device): the same two
    passes, each one backend call for the bucket."""
    backend = for_device(gs[0].device)
    sums, nonfinite = backend.efsign_sums_segments(gs, es)
    scales = [
        0.0 if bad else ef_scale(s, g.numel())
        for s, bad, g in zip(sums, nonfinite, gs, strict=True)
    ]
    bodies = backend.efsign_encode_segments(gs, es, scales, nonfinite)
    return [
        None if bad else (body, scale)
        for body, scale, bad in zip(bodies, scales, nonfinite, strict=True)
    ]


def decode_into(
    body: torch.Tensor, n: int, scale: float | None, out: torch.Tensor, accumulate: bool
) -> None:
    """Write (or add) +-scale (+-1 when scale is None) per packed sign bit into flat float32
    ``out``; PayloadError, ``out`` untouched, on a wrong length or set padding bits."""
    if body.numel() != prim.packed_len(n, 1):
        raise _length_error(body.numel(), n)
    if n == 0:
        return
    body = body.reshape(-1).to(out.device).contiguous()
    decode_with(for_device(out.device), body, n, 1.0 if scale is None else scale, out, accumulate)


def decode_with(backend, body, n: int, scale: float, out: torch.Tensor, accumulate: bool) -> None:
    """One checked body through ``backend``'s bucket decoder (a bucket of one)."""
    segment = body, prim.one(0), prim.one(n), prim.one(scale, np.float32)
    prim.decode_one(lambda t: backend.sign_decode_segments(*segment, [t]), out, accumulate)


def decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``decode_into`` (accumulating) of each body ``frame[starts[i]:][:lens[i]]``, ``ns[i]``
    signs of magnitude ``scales[i]``, into ``outs[i]`` (``GatherCompressor.decode_segments``)."""
    backend = for_device(outs[0].device) if outs else for_device(frame.device)

    def decode(upto: int):
        failed = backend.sign_decode_segments(
            frame, starts[:upto].copy(), ns[:upto].copy(), scales[:upto], outs[:upto]
        )
        return None if failed is None else (failed[0], PayloadError("body", failed[1]))

    return prim.decode_to_wrong_length(
        lens, (ns + 7) // 8, decode, lambda i: _length_error(int(lens[i]), int(ns[i]))
    )


def _length_error(nbytes: int, n: int) -> PayloadError:
    return PayloadError(
        "body", f"{nbytes} bytes cannot hold {n} sign bits (expected {(n + 7) // 8})"
    )
