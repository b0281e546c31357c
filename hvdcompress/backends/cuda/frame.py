"""Checksums and frames on the device (kernels/threelc.cu sections 7 and 8): a payload's
and a bucket's checksums, the checksum fields written in place, a frame's scan and an
allgather's length prefixes."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.records import CHECKSUM_FIELD, SCAN, FrameScan, mix


def _sum_segments(k: rt._Launcher, buf: torch.Tensor, starts: list[int], lengths: list[int]):
    """The segments ``buf[starts[i]:][:lengths[i]]`` as a table on the device, and their
    checksum state rows (hvd_checksum_segments, one launch)."""
    table = np.zeros((len(starts), rt._SEG_COLS), dtype=np.int64)
    table[:, rt._SEG_IN] = buf.data_ptr() + np.asarray(starts, dtype=np.int64)
    table[:, rt._SEG_N] = lengths
    seg = rt._segments(table, table[:, rt._SEG_N], buf.device)
    states = k.states(seg.count)
    k.tiles("hvd_checksum_segments", seg, states)
    return seg, states


def checksum_segments(buf, starts, lengths):
    """One launch, one device-to-host copy for all."""
    rt._check_tensor(buf, "buf", torch.uint8)
    if not starts:
        return []
    with rt._Launcher(buf.device) as k:
        seg, states = _sum_segments(k, buf, starts, lengths)
        host = rt._read_state(states)
    return [int(w) for w in host[:, rt._ST_SUM]]


def store_checksums(buf, starts, lengths, field):
    """Two launches, no host round trip."""
    rt._check_tensor(buf, "buf", torch.uint8)
    if not starts:
        return
    with rt._Launcher(buf.device) as k:
        seg, states = _sum_segments(k, buf, starts, lengths)
        k.rows("hvd_checksum_store", seg, np.int64(field), states)


# A frame scan's rows (HVD_FRAME_* of kernels/frame.cu section 3): the fields, the shape,
# the stored checksum, the codec parameters.
_FRAME_FIELDS, _FRAME_SHAPE, _FRAME_STORED, _FRAME_PARAMS = 10, 10, 18, 19
_FRAME_OK, _FRAME_PARAMS_LEN = SCAN["ok"], SCAN["params_len"]
_FRAME_ROW = _FRAME_PARAMS + 256 // 8


def frame_scan(frame, count):
    """Three launches (length table, checksums, headers), one read of 440 bytes a payload."""
    rt._check_tensor(frame, "frame", torch.uint8)
    length = frame.numel()
    words = 1 + count * _FRAME_ROW
    with rt._Launcher(frame.device) as k:
        # the scan's rows and the checksum states, one buffer: one read
        out = torch.zeros(words + count * rt._STATE_WORDS // 2, dtype=torch.int64, device=k.device)
        states = out[words:].view(torch.int32)
        rows = torch.zeros((max(count, 1), rt._SEG_COLS), dtype=torch.int64, device=k.device)
        sizes = np.int64(length), np.int64(count), np.int64(rt.SEGMENT_TILE)
        k("hvd_frame_table", 1, frame, *sizes, out, rows)
        if count:
            # the table's tiles are counted on the device: launch for the most a frame of
            # this length can have (a payload adds at most one partial tile); the surplus
            # tiles sum no bytes
            tiles = -(-length // rt.SEGMENT_TILE) + count
            seg = rt._Segments(rows, count, tiles, rt.SEGMENT_TILE)
            k.tiles("hvd_checksum_segments", seg, states)
            k("hvd_frame_headers", count, frame, np.int64(count), out)
        host = rt._read_state(out)
    scan = host[: 2 * words].view(np.int64)
    if scan[0] != 1:
        return None
    table = scan[1:].reshape(count, _FRAME_ROW)
    fields = table[:, :_FRAME_FIELDS].copy()
    shapes = table[:, _FRAME_SHAPE : _FRAME_SHAPE + 8].view(np.uint64).copy()
    stored = table[:, _FRAME_STORED].astype(np.uint64)
    # The device summed the checksum field's own bytes; frame.c sums them as zeros.
    field = CHECKSUM_FIELD + np.arange(4, dtype=np.uint64)
    stored_bytes = (stored[:, None] >> (np.uint64(8) * np.arange(4, dtype=np.uint64))) & 0xFF
    extra = (stored_bytes * mix(field)[None, :]).sum(axis=1)
    sums = host[2 * words :].reshape(count, rt._STATE_WORDS)[:, rt._ST_SUM].astype(np.uint64)
    zeroed = (sums - extra) & np.uint64(0xFFFFFFFF)
    ok = (fields[:, _FRAME_OK] == 1) & (zeroed == stored)
    fields[:, _FRAME_OK] = ok
    block = table[:, _FRAME_PARAMS:].view(np.uint8)
    params = [
        block[i, :n].tobytes() if good else b""
        for i, (good, n) in enumerate(
            zip(ok.tolist(), fields[:, _FRAME_PARAMS_LEN].tolist(), strict=True)
        )
    ]
    return FrameScan(fields, shapes, params)


def length_prefixes(buf: torch.Tensor, size: int) -> np.ndarray:
    """The verdict on a device allgather's framing (``size`` x (8-byte length, bytes);
    kernels/threelc.cu, hvd_length_prefixes): int64 [verdict, where, each rank's count],
    one launch and one read of 8 (size + 2) bytes."""
    rt._check_tensor(buf, "buf", torch.uint8)
    with rt._Launcher(buf.device) as k:
        out = torch.zeros(size + 2, dtype=torch.int64, device=k.device)
        k("hvd_length_prefixes", 1, buf, np.int64(buf.numel()), np.int64(size), out)
        return rt._read_state(out).view(np.int64)
