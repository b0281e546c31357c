"""What the backends hand back, and the fixed layouts their native code hard-codes.

The backends sit below the wire format (``hvdcompress.wire`` calls them for checksums
and whole frames, never the other way round): what they return is a plain record, and
the few facts of the payload layout their kernels compile in (the 32-byte fixed
header, where its checksum sits, the scan's columns, the checksum's position weights)
are declared here, once. ``hvdcompress.wire`` checks at import that its header agrees
(docs/wire-format.md).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

# The payload header's fixed part as kernels/frame.c and kernels/threelc.cu read it.
FIXED_HEADER_BYTES = 32
CHECKSUM_FIELD = 12  # offset of the 4-byte checksum field in the header
MAX_NDIM = 8

# What a frame scan (hvdc_frame_scan, hvd_frame_headers) reports per payload, in its
# column order.
SCAN_FIELDS = (
    "ok",
    "start",
    "length",
    "codec",
    "flags",
    "dtype",
    "ndim",
    "params_len",
    "numel",
    "body_len",
)
SCAN = {name: i for i, name in enumerate(SCAN_FIELDS)}

_MIX = np.uint64(0x9E3779B97F4A7C15)


def mix(index: np.ndarray) -> np.ndarray:
    """Odd 32-bit weight of each byte position (uint64 array in, uint64 array out): the
    high 32 bits of ``index * 0x9E3779B97F4A7C15 mod 2**64``, or-ed with 1."""
    with np.errstate(over="ignore"):
        return ((index.astype(np.uint64) * _MIX) >> np.uint64(32)) | np.uint64(1)


class ThreeLCEncoded(NamedTuple):
    body: torch.Tensor  # uint8, zero-run-encoded quartic bytes (empty when nonfinite)
    scale: float  # S, the float32 scale (as a Python float, exactly representable)
    nonfinite: bool


class FrameScan(NamedTuple):
    """A backend's ``frame_scan`` of one rank's frame (kernels/frame.c, hvdc_frame_scan;
    on CUDA kernels/threelc.cu, hvd_frame_headers): a row per payload."""

    fields: np.ndarray  # int64 (count, len(SCAN_FIELDS))
    shapes: np.ndarray  # uint64 (count, MAX_NDIM), zero past ndim
    params: list[bytes]  # each accepted payload's codec parameters; b"" for the others
