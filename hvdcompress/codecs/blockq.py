"""Block-scaled 3LC: a scale per block of ``block`` values instead of one per tensor.

A screening prototype (issue 61; docs/screening.md) in torch arithmetic, with the 3LC
library's native quartic and zero-run coders for the ternary digits: no fused native or
CUDA kernel yet, so its encode is several passes where 3LC's is one. Per block b of
``block`` consecutive elements of a = g + e (the last block may be shorter), with
s = ``sparsity`` in [1, 2) and L = ``levels`` in [1, 127]:

    M_b     = max |a_b|
    delta_b = float32(min(s M_b / L, FLT_MAX))  (computed in float64; one per block, sent)
    q       = clamp(rint(a / delta_b), -L, L)   (round half to even; 0 where delta_b == 0)
    decode:  delta_b * q (float32), the new residual a - delta_b q

Stochastic rounding (``noise`` u, uniform in [0, 1) a value, drawn by the sender):
q = clamp(floor(a / delta_b + u), -L, L), unbiased (E[delta_b q] = a) where the
deterministic q is biased towards zero for every value under delta_b / 2. The receiver
does not need u: the body and its decode are the same.

L = 1 is 3LC's quantiser per block (S_b = s M_b); its digits are quartic + zero-run coded
as 3LC's. L > 1 sends the codes q + L bit-packed in ``bits_for(2 L + 1)`` bits (DQSG's
layout without the dither). Body: the block deltas (float32, little-endian), then the
digits. Header parameters: ``PARAMS`` (sparsity float32, levels uint32, block uint32).
Wire cost: 32 / block bits a value for the deltas plus the digits'.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import threelc
from hvdcompress.errors import PayloadError

PARAMS = struct.Struct("<fII")  # sparsity, levels, block
MAX_LEVELS = 127
MAX_BLOCK = 1 << 24
FLT_MAX = float(np.finfo(np.float32).max)


def check_levels(levels) -> int:
    if isinstance(levels, bool) or int(levels) != levels or not 1 <= int(levels) <= MAX_LEVELS:
        raise ValueError(f"block3lc levels must be an int in [1, {MAX_LEVELS}], got {levels!r}")
    return int(levels)


def check_block(block) -> int:
    if isinstance(block, bool) or int(block) != block or not 1 <= int(block) <= MAX_BLOCK:
        raise ValueError(f"block3lc block must be an int in [1, {MAX_BLOCK}], got {block!r}")
    return int(block)


def num_blocks(n: int, block: int) -> int:
    return -(-n // block)


def code_bits(levels: int) -> int:
    return prim.bits_for(2 * levels + 1)


def max_numel(body_len: int, levels: int) -> int:
    """The most values a body of ``body_len`` bytes can describe (an upper bound)."""
    if levels == 1:
        return body_len * threelc.MAX_VALUES_PER_BYTE
    return 8 * body_len // code_bits(levels)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flat x zero-padded to whole blocks, as (blocks, block)."""
    n = x.numel()
    if n <= block:  # one block, no padding (a block may be far larger than the tensor)
        return x.view(1, n)
    pad = num_blocks(n, block) * block - n
    return torch.nn.functional.pad(x, (0, pad)).view(-1, block)


def quantize(
    a: torch.Tensor, sparsity: float, levels: int, block: int, noise: torch.Tensor | None = None
):
    """(q int8 flat of a's numel, deltas float32 per block) of the finite flat float32 a;
    rounded stochastically with ``noise`` (float32 uniforms in [0, 1), one per value)."""
    n = a.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int8), torch.zeros(0, dtype=torch.float32)
    ab = _blocks(a, block).double()
    m = ab.abs().amax(dim=1)
    deltas = (float(np.float32(sparsity)) * m / levels).clamp(max=FLT_MAX).float()
    d = deltas.double()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    scaled = ab / safe[:, None]
    if noise is None:
        q = torch.round(scaled)
    else:
        q = torch.floor(scaled + _blocks(noise.reshape(-1).to(torch.float32), block).double())
    q = q.clamp(-levels, levels)
    q = torch.where(d[:, None] > 0, q, torch.zeros_like(q))
    return q.reshape(-1)[:n].to(torch.int8), deltas


def dequantize(q: torch.Tensor, deltas: torch.Tensor, block: int) -> torch.Tensor:
    """delta_b * q as flat float32 (the decode, and the sender's copy of it)."""
    n = q.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    qb = _blocks(q.to(torch.float32), block)
    return (qb * deltas.to(torch.float32)[:, None]).reshape(-1)[:n]


def encode(
    g: torch.Tensor,
    residual: torch.Tensor | None,
    sparsity: float,
    levels: int,
    block: int,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """(body, nonfinite, q) of flat float32 g plus ``residual`` (updated in place to the
    new residual; untouched, the body empty and q None, when g + residual is not finite);
    ``noise``: stochastic rounding (``quantize``)."""
    a = g.reshape(-1).to(torch.float32)
    if residual is not None:
        a = a + residual
    if not prim.all_finite(a):
        return torch.empty(0, dtype=torch.uint8, device=g.device), True, None
    q, deltas = quantize(a.cpu(), sparsity, levels, block, None if noise is None else noise.cpu())
    if residual is not None:
        residual.copy_((a.cpu() - dequantize(q, deltas, block)).to(residual.device))
    if levels == 1:
        digits = threelc.zero_run_encode(threelc.quartic_encode(q))
    else:
        digits = prim.bitpack((q.to(torch.int16) + levels).to(torch.uint8), code_bits(levels))
    body = torch.cat([prim.float_bytes(deltas), digits])
    return body.to(g.device), False, q


def read_body(body: torch.Tensor, n: int, levels: int, block: int):
    """(q int8, deltas float32) of a body; PayloadError "body" when it is corrupt."""
    body = body.reshape(-1).cpu()
    nb = num_blocks(n, block)
    if body.numel() < 4 * nb:
        raise PayloadError("body", f"{body.numel()} bytes cannot hold {nb} block scales")
    deltas = prim.floats_from(body, nb)
    if nb and not bool((torch.isfinite(deltas) & (deltas >= 0)).all()):
        raise PayloadError("body", "a block3lc scale is negative or not finite")
    rest = body[4 * nb :]
    if levels == 1:
        qb = threelc.zero_run_decode(rest, threelc.quartic_len(n))
        return threelc.quartic_decode(qb, n), deltas
    codes = prim.bitunpack(rest, n, code_bits(levels))
    if n and int(codes.max()) > 2 * levels:
        raise PayloadError("body", f"a block3lc code is above {2 * levels}")
    return (codes.to(torch.int16) - levels).to(torch.int8), deltas


def decode_into(
    body: torch.Tensor, n: int, levels: int, block: int, out: torch.Tensor, accumulate: bool
) -> None:
    """Write (or add) delta_b * q into flat float32 ``out``; PayloadError, ``out``
    untouched, for a body that does not decode."""
    q, deltas = read_body(body, n, levels, block)
    values = dequantize(q, deltas, block).to(out.device)
    if accumulate:
        out.add_(values)
    else:
        out.copy_(values)
