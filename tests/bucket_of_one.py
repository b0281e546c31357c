"""A backend's bucket operations called on one tensor (a bucket of one), with the argument
order and results the tests compare: every backend has only the bucket form of each codec
operation (``*_segments``), and a tensor is a bucket of one (hvdcompress.codecs)."""

from __future__ import annotations

import torch

from hvdcompress.backends import ThreeLCEncoded
from hvdcompress.codecs import quant, sign, sparse, threelc


def sign_encode(backend, x: torch.Tensor) -> torch.Tensor | None:
    return backend.sign_encode_segments([x])[0]


def efsign_sums(backend, g: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
    sums, bad = backend.efsign_sums_segments([g], [e])
    return None if bad[0] else torch.as_tensor(sums[0], dtype=torch.float64)


def efsign_encode(backend, g: torch.Tensor, e: torch.Tensor, scale: float) -> torch.Tensor:
    return backend.efsign_encode_segments([g], [e], [scale], [False])[0]


def sign_decode(backend, body, n: int, scale: float, out, accumulate: bool) -> None:
    sign.decode_with(backend, body, n, scale, out, accumulate)


def threelc_encode(backend, g: torch.Tensor, e: torch.Tensor | None, sparsity: float):
    bodies, scales, bad = backend.threelc_encode_segments([g], [e], [sparsity])
    return ThreeLCEncoded(bodies[0], scales[0], bad[0])


def threelc_decode(backend, body, numel: int, scale: float, out, accumulate: bool) -> None:
    threelc.decode_with(backend, body, numel, scale, out, accumulate)


def qsgd_encode(backend, x, levels: int, bits: int, bucket: int, key: int):
    return backend.qsgd_encode_segments([x], levels, bits, bucket, [key])[0]


def qsgd_decode(backend, body, n: int, levels, bits, bucket, out, accumulate: bool) -> None:
    quant.qsgd_decode_with(backend, body, n, levels, bits, bucket, out, accumulate)


def terngrad_encode(backend, x, key: int):
    return backend.terngrad_encode_segments([x], [key])[0]


def randomk_encode(backend, a, key: int, threshold: int, residual):
    return sparse.randomk_encode_with(backend, a, key, threshold, residual)


def checksum(backend, buf: torch.Tensor) -> int:
    """The checksum (offset 0) of the whole of buf: a bucket of one segment."""
    return backend.checksum_segments(buf, [0], [buf.numel()])[0]
