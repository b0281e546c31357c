"""Sign codecs: signSGD and EF-signSGD (docs/design.md section 4).

signSGD (Bernstein et al., ICML 2018): one bit per value, bit 1 for x < 0, bit-packed LSB
first. Scale-free: decoding gives +1 or -1 (a zero, or -0.0, is sent as +1). The paper
aggregates by majority vote; here every gather-only payload is decoded and the decoded
signs are averaged across ranks (the optimizer's usual mean), which is the
sign-compressed gradient mean: a vector with entries in [-1, 1] whose magnitude does not
shrink with the gradient, so the learning rate takes the role of the step size (signSGD
learning rates are typically 1e-4 .. 1e-3, far below SGD's).

EF-signSGD (Karimireddy et al., ICML 2019): a = g + e, scale = mean|a| (float32 of the
correctly rounded sum of order-fixed double chunk sums, divided by n), decoded value
scale * sign(a) (zero as +1), residual e = a - scale * sign(a).
"""

from __future__ import annotations

import torch

from hvdcompress.codecs import primitives as prim
from hvdcompress.errors import PayloadError


def sign_bits(x: torch.Tensor) -> torch.Tensor:
    return prim.bitpack((x < 0).to(torch.uint8), 1)


def signs(body: torch.Tensor, n: int) -> torch.Tensor:
    """+1 / -1 float32 from a packed body (PayloadError on a wrong length or padding)."""
    if body.numel() != prim.packed_len(n, 1):
        raise PayloadError(
            "body", f"{body.numel()} bytes cannot hold {n} sign bits (expected {(n + 7) // 8})"
        )
    bits = prim.bitunpack(body, n, 1)
    return 1.0 - 2.0 * bits.to(torch.float32)


def ef_scale(a: torch.Tensor) -> float:
    n = a.numel()
    if n == 0:
        return 0.0
    return float(torch.tensor(prim.abs_sum(a) / n, dtype=torch.float32))


def decode_into(
    body: torch.Tensor, n: int, scale: float | None, out: torch.Tensor, accumulate: bool
) -> None:
    val = signs(body, n)
    if scale is not None:
        val = val * scale
    if accumulate:
        out += val
    else:
        out.copy_(val)
