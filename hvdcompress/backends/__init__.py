"""Codec backends: the same tensor math on the CPU (C, via ctypes) and on CUDA (CuPy RawKernels).

Both backends implement the protocol below and must produce identical bytes for
identical input (docs/design.md, "Concepts and where they live"). ``for_device`` picks one by the
tensor's device; the codecs in ``hvdcompress.codecs`` never branch on the device themselves.

Backend protocol (all tensors contiguous, on the backend's device):

``threelc_encode(g, e, sparsity) -> ThreeLCEncoded``
    g: float32 gradient, e: float32 residual of the same numel or None (no error
    feedback). Computes a = g + e, M = max|a|, S = float32(sparsity) * M,
    q = rint(a / S), e <- a - S * q (only when e is given and the input is finite),
    quartic-encodes q and zero-run-encodes the quartic bytes. Non-finite a, or an S
    that overflows, gives ``nonfinite=True``, an empty body and e untouched.
``threelc_decode(body, numel, scale, out, accumulate) -> None``
    Zero-run-decodes ``body``, checks it yields exactly ceil(numel / 5) quartic bytes,
    and writes (or, with accumulate, adds) scale * q into the float32 ``out``.
    Raises ``hvdcompress.wire.PayloadError`` (field "body") on a corrupt body.
``checksum(buf, offset) -> int``
    sum over j of (buf[j] + 1) * mix(offset + j) mod 2**32, see ``wire.checksum``.
``checksum_segments(buf, starts, lengths) -> list[int]``,
``store_checksums(buf, starts, lengths, field)``
    ``checksum`` (offset 0) of each segment of buf; the second writes each little-endian
    into the segment's 4 bytes at ``field`` (a frame's checksum fields).
``threelc_encode_segments(gs, es, sparsities)``, ``threelc_decode_segments(frame, starts,
lens, ns, scales, outs)``
    A bucket's ``threelc_encode`` / accumulating ``threelc_decode`` in one native call
    (CPU) or one launch sequence (CUDA); the decode returns None or (index, message) of
    the first body it refuses, the ones before it added.
Building blocks (public API of ``hvdcompress.codecs.threelc``):
``quantize(x, sparsity) -> (q int8, scale float32 0-dim tensor)``,
``quartic_encode(q) -> uint8``, ``quartic_decode(buf, numel) -> int8``,
``zero_run_encode(buf) -> uint8``, ``zero_run_decode(buf) -> uint8``.
The other codecs' passes (signSGD, QSGD, TernGrad, DQSG, top-k, and random-k's
``randomk_encode`` / ``randomk_decode``, GSpar's ``gspar_round`` / ``gspar_draw``, DGC's
``dgc_update``, NDQSG's ``ndqsg_coset`` / ``ndqsg_side_decode``) have the same signature
in both modules; the CUDA module computes some of them with torch operations on the
device (docs/backends.md).
"""

from __future__ import annotations

import torch

from hvdcompress.backends.records import FrameScan, ThreeLCEncoded

__all__ = ["FrameScan", "ThreeLCEncoded", "for_device"]


_BACKENDS: dict[str, object] = {}


def for_device(device: torch.device):
    """Return the backend module for ``device`` (``cpu`` or ``cuda``)."""
    backend = _BACKENDS.get(device.type)
    if backend is not None:
        return backend
    if device.type == "cpu":
        from hvdcompress.backends import cpu as backend
    elif device.type == "cuda":
        from hvdcompress.backends import cuda as backend
    else:
        raise TypeError(f"hvdcompress has no backend for device type {device.type!r}")
    _BACKENDS[device.type] = backend
    return backend
