"""Random-k, the sparsifying codec whose receiver regenerates the kept indices
(docs/baselines.md, "Random-k": the formulas, layout and receiver checks); the other
sparsifiers are in hvdcompress.codecs.sparse, which re-exports these names.

Random-k keeps element i iff u_i < p = T / 2**24 for the counter-based uniform u_i
(hvdcompress.codecs.primitives), so a receiver regenerates the mask from (seed, step,
rank, tensor id) and only the kept values travel; ``unbiased`` scales them by float32(1 /
p), which makes E[decode] = x over the seed.
"""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.codecs import primitives as prim
from hvdcompress.errors import PayloadError

RANDOMK_ONE = 2**24


def randomk_threshold(ratio: float) -> int:
    """T with keep probability p = T / 2**24 (1 <= T <= 2**24)."""
    return min(RANDOMK_ONE, max(1, round(ratio * RANDOMK_ONE)))


def randomk_scale(ratio: float, unbiased: bool) -> float:
    """The float32 factor the decoder applies: 1 / p when unbiased, else 1."""
    if not unbiased:
        return 1.0
    return float(torch.tensor(RANDOMK_ONE / randomk_threshold(ratio), dtype=torch.float32))


def randomk_encode(a: torch.Tensor, key: int, ratio: float, residual: torch.Tensor | None):
    """The kept values of the finite flat float32 a (float32, index order); residual (not
    None: error feedback, unscaled values) <- a with the kept entries zeroed. The bucket
    encoder with one tensor: with a residual, of a = a + e with e = -0.0 (bit for bit a)."""
    return randomk_encode_with(for_device(a.device), a, key, randomk_threshold(ratio), residual)


def randomk_encode_with(backend, a, key: int, threshold: int, residual):
    """``randomk_encode`` through ``backend``'s bucket encoder (the threshold given)."""
    if residual is None:
        bodies, _ = backend.randomk_encode_segments([a], [key], threshold, None)
    else:
        if residual.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
            a = a.clone()  # the encoder forms a + e in e
        bodies, _ = backend.randomk_encode_segments([a], [key], threshold, [residual.fill_(-0.0)])
    return bodies[0].view(torch.float32)


def randomk_decode_into(
    body: torch.Tensor,
    key: int,
    n: int,
    ratio: float,
    scale: float,
    out: torch.Tensor,
    accumulate: bool,
    fresh: bool = False,
) -> None:
    """Write (or add) scale * the kept values at the regenerated indices; PayloadError,
    out untouched, when the body does not hold exactly the regenerated count of finite
    values. The backend's bucket decoder adds; a write adds into +0.0, then sets the kept
    entries whose value * scale is -0.0 (+0.0 + v is v for every v but -0.0). ``fresh``:
    ``out`` is a new tensor of +0.0 that the caller drops on a failure, written in place
    (no copy to keep it untouched)."""
    backend, threshold = for_device(out.device), randomk_threshold(ratio)
    body = body.reshape(-1)
    target = out if accumulate or fresh else torch.zeros_like(out)
    segment = prim.one(0), prim.one(body.numel()), prim.one(n)  # a bucket of one
    failed = backend.randomk_decode_segments(body, *segment, [key], threshold, scale, [target])
    if failed is not None:
        raise _randomk_error(failed[1], body.numel())
    if accumulate:
        return
    if body.numel():
        values = body.to(out.device).clone().view(torch.float32) * np.float32(scale)
        negative_zero = (values == 0) & torch.signbit(values)
        if bool(negative_zero.any()):
            kept = backend.uniform(key, n, out.device) < threshold * 2.0**-24
            target[kept] = values
    if target is not out:
        out.copy_(target)


def randomk_decoded_bound(body: torch.Tensor, scale: float) -> float:
    """fl32(max |kept value| * scale) of a decoded (so checked) random-k body: each decoded
    value is the float32 product fl32(v * scale), at most that (rounding is monotone)."""
    if body.numel() == 0:
        return 0.0
    top = body.reshape(-1).clone().view(torch.float32).abs().max()
    return float(top * torch.tensor(scale, dtype=torch.float32, device=top.device))


def _randomk_error(code: int, body_len: int) -> PayloadError:
    """The error of a random-k body the backend refused: code -1, else the kept count."""
    if code == -1:
        return PayloadError("body", "a random-k value is not finite")
    return PayloadError(
        "body",
        f"the regenerated mask keeps {code} values ({4 * code} bytes), body has "
        f"{body_len} bytes (wrong seed, step, rank or tensor, or corrupt)",
    )


def randomk_encode_segments(
    gs: list[torch.Tensor], keys: list[int], ratio: float, es: list[torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], list[bool]]:
    """``randomk_encode`` of a bucket's tensors (flat float32 on one device), with the
    residuals ``es`` or without: the backend's ``randomk_encode_segments``."""
    return for_device(gs[0].device).randomk_encode_segments(gs, keys, randomk_threshold(ratio), es)


def randomk_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    keys: list[int],
    ratio: float,
    scale: float,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``sparse.topk_decode_segments`` for random-k's bodies (``randomk_decode_into``; on CUDA
    kernels/sparse.cu, "Random-k's buckets")."""
    from hvdcompress.backends import cpu

    backend = for_device(outs[0].device) if outs else cpu
    failed = backend.randomk_decode_segments(
        frame, starts, lens, ns, keys, randomk_threshold(ratio), scale, outs
    )
    if failed is None:
        return None
    i, code = failed
    return i, _randomk_error(code, int(lens[i]))
