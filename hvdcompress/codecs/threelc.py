"""3LC: three-value quantisation, quartic encoding and zero-run encoding.

Lim, Andersen, Kaminsky, "3LC: Lightweight and Effective Traffic Compression for
Distributed Machine Learning", SysML 2019 (arXiv 1802.07389); byte layout and
rounding as fixed by docs/codecs.md, "3LC".

Invariants (every backend, every rank):
  * S = float32(s) * max|a| with a = g + e; q = rint(a / S) in {-1, 0, 1} (IEEE
    float32 division, round half to even); the decoded value is S * q and the
    new residual is a - S * q, so g_hat + e_new == a exactly up to one rounding.
  * Quartic bytes hold five consecutive digits d = q + 1 as 81 d0 + 27 d1 + 9 d2 +
    3 d3 + d4 <= 242; zero-run encoding maps runs of the zero group (121) to bytes
    243..255, so decoding is unambiguous.
  * The CPU and CUDA backends produce identical bytes.

The functions here dispatch on the tensor's device and are the public building
blocks; ``encode_segments`` / ``decode_segments`` are the fused paths the compressor uses.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from hvdcompress.backends import ThreeLCEncoded, for_device
from hvdcompress.codecs import primitives as prim
from hvdcompress.errors import PayloadError

ZERO_GROUP = 121
MAX_RUN = 14
MAX_VALUES_PER_BYTE = 5 * MAX_RUN  # 70: one byte of 255 stands for 14 zero groups
PARAMS = struct.Struct("<ff")  # sparsity, scale S (both float32)
SPARSITY_RANGE = (1.0, 2.0)


def check_sparsity(sparsity: float) -> float:
    """Return float(s) or raise: 1 <= s < 2 keeps the largest element (docs/codecs.md, "3LC")."""
    lo, hi = SPARSITY_RANGE
    s = float(sparsity)
    # the float32 value is what multiplies: 1.99999999 would round up to 2.0
    if not (lo <= s < hi and np.float32(s) < hi):
        raise ValueError(f"3LC sparsity must be in [{lo}, {hi}), got {sparsity!r}")
    return s


def quartic_len(numel: int) -> int:
    """Quartic bytes for numel values: ceil(numel / 5)."""
    return (numel + 4) // 5


def quantize(x: torch.Tensor, sparsity: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternarise x (no error feedback): returns (q int8 flat, S float32 0-dim tensor)."""
    return for_device(x.device).quantize(prim.flat_f32(x), check_sparsity(sparsity))


def quartic_encode(q: torch.Tensor) -> torch.Tensor:
    """Pack int8 digits in {-1, 0, 1} five to a byte; the last group is padded with zeros."""
    if q.dtype != torch.int8:
        raise TypeError(f"quartic_encode takes int8 digits, got {q.dtype}")
    return for_device(q.device).quartic_encode(q.reshape(-1).contiguous())


def quartic_decode(buf: torch.Tensor, numel: int) -> torch.Tensor:
    """Unpack numel int8 digits; raises PayloadError on bytes > 242, bad padding or length."""
    buf = _bytes(buf)
    if buf.numel() != quartic_len(numel):
        raise PayloadError(
            "body",
            f"{buf.numel()} quartic bytes cannot hold {numel} values "
            f"(expected {quartic_len(numel)})",
        )
    return for_device(buf.device).quartic_decode(buf, numel)


def zero_run_encode(buf: torch.Tensor) -> torch.Tensor:
    """Replace runs of the zero group 121 by run bytes 243..255 (docs/codecs.md, "3LC")."""
    return for_device(buf.device).zero_run_encode(_bytes(buf))


def zero_run_decode(buf: torch.Tensor, expected_len: int | None = None) -> torch.Tensor:
    """Expand run bytes back into 121s; with expected_len, a different length raises."""
    return for_device(buf.device).zero_run_decode(_bytes(buf), expected_len)


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    if buf.dtype != torch.uint8:
        raise TypeError(f"expected a uint8 tensor, got {buf.dtype}")
    return buf.reshape(-1).contiguous()


def encode(g: torch.Tensor, residual: torch.Tensor | None, sparsity: float) -> ThreeLCEncoded:
    """Fused quantise + error-feedback update + quartic + zero-run encoding.

    g: contiguous flat float32; residual: float32 of the same numel, updated in place
    (left untouched when the input is non-finite), or None.
    """
    return encode_segments([g], [residual], [sparsity])[0]


def decode_into(
    body: torch.Tensor, numel: int, scale: float, out: torch.Tensor, accumulate: bool = False
) -> None:
    """Write (or add) S * q of a zero-run-encoded body into flat float32 ``out``; PayloadError,
    ``out`` untouched, for a body that does not decode. The bucket decoder (accumulating)
    with one body: written, not added, is added into +0.0, which is S * q's bits for S > 0
    (or not finite: +0.0 + x is x for every x but -0.0, which S * q then never is) with
    the runs' +0.0; for any other S the digits q are decoded (S = 1) and S * q formed
    where the body has digits, +0.0 where it has runs, as the writing decoder does."""
    decode_with(for_device(out.device), body, numel, scale, out, accumulate)


def decode_with(
    backend, body: torch.Tensor, numel: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    """``decode_into`` through ``backend``'s bucket decoder."""
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements, expected {numel}")
    body = _bytes(body)
    segment = body, prim.one(0), prim.one(body.numel()), prim.one(numel)  # a bucket of one

    def add(target: torch.Tensor, s: float):
        return backend.threelc_decode_segments(*segment, prim.one(s, "float32"), [target])

    if accumulate or not scale <= 0.0:  # S > 0, NaN or Inf
        fill = out if accumulate else torch.zeros_like(out)
        _raise_failed(add(fill, scale))
        if not accumulate:
            out.copy_(fill)
        return
    q = torch.zeros_like(out)
    _raise_failed(add(q, 1.0))
    runs = torch.full_like(out, -0.0)  # a run leaves -0.0; a digit's -0.0 + q is not -0.0
    _raise_failed(add(runs, 1.0))
    at_run = (runs == 0) & torch.signbit(runs)
    out.copy_(torch.where(at_run, torch.zeros_like(out), q * float(np.float32(scale))))


def fresh_fill(scale: float) -> float | None:
    """What ``decode_with`` writes by adding into (the fill of ``framing.decode_filled``): +0.0
    for S > 0 (or not finite), None for S <= 0, which it writes another way."""
    return None if scale <= 0.0 else 0.0


def _raise_failed(failed) -> None:
    if failed is not None:
        raise PayloadError("body", failed[1])


def encode_segments(
    gs: list[torch.Tensor], residuals: list[torch.Tensor], sparsities: list[float]
) -> list[ThreeLCEncoded]:
    """``encode`` of each (g, residual, sparsity) of a bucket (contiguous flat float32 on the
    CPU), in one native call."""
    bodies, scales, nonfinite = for_device(gs[0].device).threelc_encode_segments(
        gs, residuals, sparsities
    )
    return [
        ThreeLCEncoded(body, 0.0 if bad else scale, bad)
        for body, scale, bad in zip(bodies, scales, nonfinite, strict=True)
    ]


def decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, PayloadError] | None:
    """``decode_into`` (accumulating) of each body ``frame[starts[i]:][:lens[i]]`` of ``ns[i]``
    values with scale ``scales[i]`` into ``outs[i]`` (``GatherCompressor.decode_segments``)."""
    backend = for_device(outs[0].device) if outs else for_device(frame.device)
    failed = backend.threelc_decode_segments(frame, starts, lens, ns, scales, outs)
    return None if failed is None else (failed[0], PayloadError("body", failed[1]))
