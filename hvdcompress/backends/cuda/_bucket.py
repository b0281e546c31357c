"""The checks and segment-table helpers a bucket's segment calls share (the CPU backend's
one-call signatures, one launch sequence for the bucket here: docs/backends.md, "The CUDA
path")."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt


def _check_residuals(gs: list[torch.Tensor], es: list[torch.Tensor]) -> None:
    for g, e in zip(gs, es, strict=True):
        rt._check_tensor(e, "e", torch.float32)
        if e.numel() != g.numel() or e.device != g.device:
            raise ValueError(
                f"residual has {e.numel()} elements on {e.device}, "
                f"gradient {g.numel()} on {g.device}"
            )


def _bucket_device(ts: list[torch.Tensor], name: str) -> torch.device:
    """The one device of a bucket's float32 tensors (checked)."""
    device = ts[0].device
    for t in ts:
        rt._check_tensor(t, name, torch.float32)
        if t.device != device:
            raise ValueError(f"a bucket's tensors are on {device} and {t.device}")
    return device


def splits(n):
    """No host threads here: no tensor leaves a bucket's segment calls."""
    return False


def _encode_bucket(gs: list[torch.Tensor], es) -> tuple:
    """What a bucket encoder starts from (gs not empty; the residuals ``es`` checked when
    given): (the device, the numels, the non-empty tensors' indices, empty bodies, no
    non-finite flags), the last two for the caller to fill in."""
    device = _bucket_device(gs, "g")
    if es is not None:
        _check_residuals(gs, es)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=len(gs))
    bodies: list[torch.Tensor | None] = [torch.empty(0, dtype=torch.uint8, device=device)]
    return device, ns, np.flatnonzero(ns > 0), bodies * len(gs), [False] * len(gs)


def _rows(xs: list[torch.Tensor], live: np.ndarray, es=None) -> np.ndarray:
    """A segment table of the tensors ``xs[i]`` for i in ``live``: each row's input,
    residual (``es``; none: column 1 stays 0) and size filled in."""
    table = np.zeros((len(live), rt._SEG_COLS), dtype=np.int64)
    table[:, rt._SEG_IN] = [xs[i].data_ptr() for i in live.tolist()]
    if es is not None:
        table[:, rt._SEG_AUX] = [es[i].data_ptr() for i in live.tolist()]
    table[:, rt._SEG_N] = [xs[i].numel() for i in live.tolist()]
    return table


def _decode_rows(at, outs: list[torch.Tensor], live: np.ndarray, ns: np.ndarray) -> np.ndarray:
    """A decode's segment table: row r reads its body at address ``at[r]`` (0 where the
    caller places bodies by another column) and adds into ``outs[live[r]]``, of
    ``ns[live[r]]`` elements."""
    table = np.zeros((len(live), rt._SEG_COLS), dtype=np.int64)
    table[:, rt._SEG_IN] = at
    table[:, rt._SEG_AUX] = [outs[p].data_ptr() for p in live.tolist()]
    table[:, rt._SEG_N] = ns[live]
    return table


def _bodies_on(
    frame: torch.Tensor, starts: np.ndarray, lens: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, np.ndarray]:
    """The bodies ``frame[starts[p]:][:lens[p]]`` side by side in one new buffer on
    ``device`` (one copy there for a host frame; a frame on the device is copied on the
    device, a few percent of the outputs' traffic, so that both cases take this one path),
    and each body's address in it."""
    buf = _gather_bodies(frame, starts, lens, device)
    return buf, buf.data_ptr() + (np.cumsum(lens) - lens)


def _gather_bodies(
    frame: torch.Tensor, starts: np.ndarray, lens: np.ndarray, device: torch.device
) -> torch.Tensor:
    flat = frame.reshape(-1)
    pieces = [flat[a : a + n] for a, n in zip(starts.tolist(), lens.tolist(), strict=True)]
    return torch.cat(pieces).to(device)


def _first_rows(seg: rt._Segments, units: np.ndarray, count: int) -> rt._Segments:
    """The first ``count`` rows of a segment table (their tiles are the first ones)."""
    tiles = int(-(-units[:count] // seg.tile).sum())
    return rt._Segments(seg.rows, count, tiles, seg.tile)
