"""Checksums and whole frames on the CPU (kernels/frame.c):
per-segment checksums, the frame scan and the frame writer."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cpu._library import LIB, _addresses, _i64_array, _native, _numels
from hvdcompress.backends.records import FIXED_HEADER_BYTES, MAX_NDIM, SCAN, SCAN_FIELDS, FrameScan


def checksum_segments(buf, starts, lengths):
    count = len(starts)
    table = np.array([starts, lengths], dtype=np.int64)
    out = np.empty(count, dtype=np.uint32)
    if count:
        _native(LIB.hvdc_checksum_segments, buf, count, table[0], table[1], out)
    return out.tolist()


def store_checksums(buf, starts, lengths, field):
    sums = np.asarray(checksum_segments(buf, starts, lengths), dtype="<u4")
    at = np.asarray(starts, dtype=np.int64)[:, None] + field + np.arange(4)
    buf.numpy()[at.reshape(-1)] = sums.view(np.uint8)


def frame_scan(frame, count):
    """One native call (kernels/frame.c, hvdc_frame_scan), then the accepted parameters."""
    fields = np.empty((count, len(SCAN_FIELDS)), dtype=np.int64)  # kernels/frame.c FRAME_FIELDS
    shapes = np.zeros((count, MAX_NDIM), dtype=np.uint64)
    rc = _native(LIB.hvdc_frame_scan, frame, frame.numel(), count, fields, shapes)
    if rc < 0:
        return None
    view, col = frame.numpy(), SCAN
    at = fields[:, col["start"]] + FIXED_HEADER_BYTES + 8 * fields[:, col["ndim"]]
    oks, lens = fields[:, col["ok"]].tolist(), fields[:, col["params_len"]].tolist()
    rows = zip(oks, at.tolist(), lens, strict=True)
    params = [view[a:][:n].tobytes() if ok else b"" for ok, a, n in rows]
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
    body_lens = _numels(bodies)
    param_starts = np.cumsum(params_lens) - params_lens
    total = 8 * (count + 1) + int(head_lens.sum() + params_lens.sum() + body_lens.sum())
    frame = torch.empty(total, dtype=torch.uint8)
    params_buf = np.frombuffer(params, dtype=np.uint8) if params else np.zeros(1, np.uint8)
    flags8 = np.ascontiguousarray(flags, dtype=np.uint8)
    heads_table = _i64_array(head_starts), _i64_array(head_lens)
    params_table = _i64_array(param_starts), _i64_array(params_lens)
    _native(
        LIB.hvdc_frame_write, count, heads, *heads_table, flags8, params_buf, *params_table,
        _addresses(bodies), _i64_array(body_lens), frame,
    )  # fmt: skip
    return frame
