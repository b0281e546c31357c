"""Checksums and whole frames on the CPU (kernels/frame.c):
per-segment checksums, the frame scan and the frame writer."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cpu._library import (
    LIB,
    _addresses,
    _i64_array,
    _ptr,
)
from hvdcompress.backends.records import FIXED_HEADER_BYTES, SCAN, FrameScan


def checksum_segments(buf: torch.Tensor, starts: list[int], lengths: list[int]) -> list[int]:
    """The checksum (offset 0, ``wire.checksum``) of each segment [start, start + length)
    of buf: one call."""
    count = len(starts)
    table = np.array([starts, lengths], dtype=np.int64)
    out = np.empty(count, dtype=np.uint32)
    if count:
        LIB.hvdc_checksum_segments(
            _ptr(buf), count, table[0].ctypes.data, table[1].ctypes.data, out.ctypes.data
        )
    return out.tolist()


def store_checksums(buf: torch.Tensor, starts: list[int], lengths: list[int], field: int) -> None:
    """Write each segment's checksum (offset 0, computed with its 4 bytes at ``start +
    field`` zero) little-endian into those 4 bytes: a frame's checksum fields."""
    sums = np.asarray(checksum_segments(buf, starts, lengths), dtype="<u4")
    at = np.asarray(starts, dtype=np.int64)[:, None] + field + np.arange(4)
    buf.numpy()[at.reshape(-1)] = sums.view(np.uint8)


SCAN_FIELDS = 10  # kernels/frame.c (FRAME_FIELDS); their names: records.SCAN_FIELDS


def frame_scan(frame: torch.Tensor, count: int) -> FrameScan | None:
    """The scan of a frame of ``count`` payloads (``FrameScan``: SCAN_FIELDS int64 fields
    and the shape of each, the parameters of each accepted one), or None when its length
    table does not describe it."""
    fields = np.empty((count, SCAN_FIELDS), dtype=np.int64)
    shapes = np.zeros((count, 8), dtype=np.uint64)
    rc = LIB.hvdc_frame_scan(
        _ptr(frame), frame.numel(), count, fields.ctypes.data, shapes.ctypes.data
    )
    if rc < 0:
        return None
    view, col = frame.numpy(), SCAN
    at = fields[:, col["start"]] + FIXED_HEADER_BYTES + 8 * fields[:, col["ndim"]]
    params = [
        view[a:][:n].tobytes() if ok else b""
        for ok, a, n in zip(
            fields[:, col["ok"]].tolist(),
            at.tolist(),
            fields[:, col["params_len"]].tolist(),
            strict=True,
        )
    ]
    return FrameScan(fields, shapes, params)


def frame_write(
    heads: np.ndarray,
    head_starts: np.ndarray,
    head_lens: np.ndarray,
    flags: np.ndarray,
    params: bytes,
    params_lens: np.ndarray,
    bodies: list[torch.Tensor],
) -> torch.Tensor:
    """One rank's frame (kernels/frame.c, hvdc_frame_write): per payload its header
    template (``heads[head_starts[p]:][:head_lens[p]]``), flags, params and body, each
    payload's checksum in place."""
    count = len(bodies)
    body_lens = np.fromiter((b.numel() for b in bodies), dtype=np.int64, count=count)
    param_starts = np.zeros(count, dtype=np.int64)
    np.cumsum(params_lens[:-1], out=param_starts[1:])
    total = 8 * (count + 1) + int(head_lens.sum() + params_lens.sum() + body_lens.sum())
    frame = torch.empty(total, dtype=torch.uint8)
    # locals, so that every array lives across the call
    params_buf = np.frombuffer(params, dtype=np.uint8) if params else np.zeros(1, np.uint8)
    flags8, body_at = np.ascontiguousarray(flags, dtype=np.uint8), _addresses(bodies)
    LIB.hvdc_frame_write(
        count,
        heads.ctypes.data,
        _i64_array(head_starts),
        _i64_array(head_lens),
        flags8.ctypes.data,
        params_buf.ctypes.data,
        _i64_array(param_starts),
        _i64_array(params_lens),
        body_at.ctypes.data,
        _i64_array(body_lens),
        _ptr(frame),
    )
    return frame
