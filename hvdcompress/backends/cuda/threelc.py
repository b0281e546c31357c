"""3LC (kernels/threelc.cu): the fused encode and decode, of one tensor and of a bucket,
their building blocks (quantise, quartic and zero-run coders), and the zero-run coder's
launch sequences the TernGrad and DQSG bucket codecs reuse."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.backends.cuda._bucket import (
    _bucket_device,
    _check_residuals,
    _decode_rows,
    _first_rows,
    _gather_bodies,
    _rows,
)
from hvdcompress.errors import PayloadError


def _sparsity(sparsity: float) -> np.float32:
    s = np.float32(sparsity)
    if not (1.0 <= s < 2.0):
        raise ValueError(f"3LC sparsity must be in [1, 2) as a float32, got {sparsity!r}")
    return s


def _body_error(err: int, total: int | None = None, m: int | None = None) -> PayloadError:
    if err & rt.ERR_LENGTH:
        got = "" if total is None else f" ({total} bytes, expected {m})"
        return PayloadError(
            "body",
            f"zero-run decoding does not give exactly ceil(numel / 5) quartic bytes{got}",
        )
    if err & rt.ERR_BYTE:
        return PayloadError("body", "a quartic byte is above 242")
    if err & rt.ERR_PADDING:
        return PayloadError("body", "a padding digit of the last group is not zero")
    return PayloadError("body", f"decoding kernels reported error bits 0x{err:x}")


# ---- fused codec path ----------------------------------------------------------------------


def _quantize_quartic(
    k: rt._Launcher,
    x: torch.Tensor,
    e: torch.Tensor | None,
    s: np.float32,
    state: torch.Tensor,
    q_out: torch.Tensor | None,
) -> torch.Tensor:
    """max|x + e| into state, then the fused quantize + quartic encode: returns the
    ceil(n / 5) quartic bytes; S and the non-finite flag go to state, e (when given) is
    updated and q_out (int8, when given) written. x must have n >= 1 elements."""
    n = x.numel()
    k("threelc_absmax", n, x, e, np.int64(n), state)
    quartic = k.empty((n + 4) // 5, torch.uint8)
    k("threelc_quantize_quartic", quartic.numel(), x, e, np.int64(n), s, state, quartic, q_out)
    return quartic


_SCAN_ROW = 1024  # elements per row of _running_max's two-level scan


def _running_max(x: torch.Tensor) -> torch.Tensor:
    """``torch.cummax(x, 0).values`` of a 1-D int64 tensor, computed in parallel.

    torch's CUDA cummax parallelises over rows only, so a 1-D tensor is scanned by a
    single thread block: on an H200 that held 3LC encode at about 6 GB/s of float32 input
    for any size from 1e7 to 1e8 elements. Here rows of ``_SCAN_ROW`` values are scanned
    side by side, then each row takes the running max of the rows before it (the same
    function on the rows' last values, so the serial part shrinks by ``_SCAN_ROW`` a level).
    Exact: a max of integers, so the result is the same whatever the grouping."""
    n = x.numel()
    if n <= _SCAN_ROW:
        return torch.cummax(x, 0).values
    rows = -(-n // _SCAN_ROW)
    grid = torch.full((rows * _SCAN_ROW,), torch.iinfo(x.dtype).min, dtype=x.dtype, device=x.device)
    grid[:n] = x
    scanned = torch.cummax(grid.view(rows, _SCAN_ROW), 1).values
    before = _running_max(scanned[:, -1].contiguous())  # running max over whole rows
    scanned[1:] = torch.maximum(scanned[1:], before[:-1, None])
    return scanned.view(-1)[:n]


def _zre_emit_scan(
    k: rt._Launcher, qb: torch.Tensor, run_start: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The inclusive scan of the zero-run encoder's emit flags (which position writes an
    output byte): each emitting position's output index + 1."""
    m = qb.numel()
    emit = k.empty(m, torch.uint8)
    k("threelc_zre_flags", m, qb, run_start, np.int64(m), emit, state)
    return torch.cumsum(emit, 0, dtype=torch.int64)


def _zre_prepare(k: rt._Launcher, body: torch.Tensor, numel: int, state: torch.Tensor):
    """Expansion lengths, their inclusive scan and the check kernel (total length, and
    with numel >= 0 the length / padding checks) into state. Returns the scan."""
    length = body.numel()
    lens = k.empty(length, torch.uint8)
    k("threelc_zre_lengths", length, body, np.int64(length), lens)
    incl = torch.cumsum(lens, 0, dtype=torch.int64)
    k("threelc_zre_decode_check", 1, body, incl, np.int64(length), np.int64(numel), state)
    return incl


def threelc_decode_segments(frame, starts, lens, ns, scales, outs):
    """One launch sequence (threelc.cu section 7): every body checked, one read,
    then the expansion and scaled add of the bodies before the first refused one."""
    count = len(outs)
    if not count:
        return None
    device = _bucket_device(outs, "out")
    starts, lens, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, lens, ns))
    ms = (ns + 4) // 5
    # the host-side bounds of threelc_decode: each body byte expands to 1..14 quartic bytes
    bad = np.flatnonzero((lens > ms) | (lens * rt._MAX_RUN < ms))
    stop = int(bad[0]) if len(bad) else count
    failed = None if stop == count else (stop, _body_error(rt.ERR_LENGTH).detail)
    live = np.flatnonzero(ms[:stop] > 0)
    if not len(live):
        return failed
    blens, lms = lens[live], ms[live]
    table = _decode_rows(0, outs, live, ns)  # no address: a row's body is at _SEG_BOFF
    table[:, rt._SEG_QOFF] = np.cumsum(lms) - lms
    table[:, rt._SEG_BOFF] = np.cumsum(blens) - blens
    table[:, rt._SEG_BLEN] = blens
    table[:, rt._SEG_F32] = rt._f32_bits(np.asarray(scales, dtype=np.float32)[live])
    body = _gather_bodies(frame, starts[live], blens, device)  # one host copy in, at most
    with rt._Launcher(device) as k:
        seg = rt._segments(table, lms, device)
        states = k.states(seg.count)
        incl = _zre_check_segments(k, seg, body, states)
        host = rt._read_state(states)
        refused = np.flatnonzero(host[:, rt._ST_ERROR])
        good = seg.count
        if len(refused):
            row = int(refused[0])
            good, p = row, int(live[row])
            total = rt._count(host[row])
            failed = (p, _body_error(int(host[row, rt._ST_ERROR]), total, int(ms[p])).detail)
        if good == 0:
            return failed
        quartic = _zre_expand_rows(k, table, lms, good, body, incl, rt._RUN_GROUP, states)
        part = _first_rows(seg, lms, good)
        k.tiles("threelc_quartic_decode_add_segments", part, quartic, states)
    return failed


def _zre_check_segments(
    k: rt._Launcher, seg: rt._Segments, body: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """The zero-run bodies of a bucket (side by side in ``body``; the table's BOFF / BLEN
    columns): their expansion lengths, one scan, each body's total and padding checked
    into its state row (kernels/threelc.cu section 7). Returns the inclusive scan."""
    length = body.numel()
    lengths = k.empty(length, torch.uint8)
    k("threelc_zre_lengths", length, body, np.int64(length), lengths)
    incl = torch.cumsum(lengths, 0, dtype=torch.int64)
    del lengths
    k.rows("threelc_zre_decode_check_segments", seg, body, incl, states)
    return incl


def _zre_expand_rows(k, table, ms, rows: int, body, incl, run_byte: int, states) -> torch.Tensor:
    """The quartic bytes of the first ``rows`` checked bodies (their bodies and quartic
    bytes are prefixes of the bucket's, and their tiles the first ones), a zero group from
    a run code written as ``run_byte``."""
    used_len = int(table[rows - 1, rt._SEG_BOFF] + table[rows - 1, rt._SEG_BLEN])
    used_m = int(table[rows - 1, rt._SEG_QOFF] + ms[rows - 1])
    quartic = k.empty(used_m, torch.uint8)
    _zre_expand(k, body, incl, used_len, run_byte, quartic, states)
    return quartic


def _zre_expand(k: rt._Launcher, body, incl, length: int, run_byte: int, out, state) -> None:
    """Expand the first ``length`` zero-run bytes of ``body`` into ``out`` (``incl``: the
    inclusive scan of their expansion lengths), a run code's zero group written as
    ``run_byte``."""
    n, run, m = np.int64(length), np.uint8(run_byte), np.int64(out.numel())
    k("threelc_zre_expand", length, body, incl, n, run, out, m, state)


# ---- building blocks -----------------------------------------------------------------------


def quantize(x, sparsity):
    rt._check_tensor(x, "x", torch.float32)
    s = _sparsity(sparsity)
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    if n == 0:
        return q, torch.zeros((), dtype=torch.float32, device=x.device)
    with rt._Launcher(x.device) as k:
        state = k.state()
        _quantize_quartic(k, x, None, s, state, q)
        host = rt._read_state(state)
    if host[rt._ST_NONFINITE]:
        raise ValueError("quantize: input holds NaN or Inf (or max|x| * sparsity overflows)")
    return q, state[rt._ST_SCALE : rt._ST_SCALE + 1].view(torch.float32)[0].clone()


def quartic_encode(q):
    rt._check_tensor(q, "q", torch.int8)
    n = q.numel()
    out = torch.empty((n + 4) // 5, dtype=torch.uint8, device=q.device)
    if n == 0:
        return out
    with rt._Launcher(q.device) as k:
        state = k.state()
        k("threelc_quartic_encode", out.numel(), q, np.int64(n), out, state)
        if rt._read_state(state)[rt._ST_ERROR]:
            raise ValueError("quartic_encode: digits must be -1, 0 or 1")
    return out


def quartic_decode(buf, numel):
    rt._check_tensor(buf, "buf", torch.uint8)
    m = (numel + 4) // 5
    if buf.numel() != m:
        raise PayloadError(
            "body", f"{buf.numel()} quartic bytes cannot hold {numel} values (expected {m})"
        )
    q = torch.empty(numel, dtype=torch.int8, device=buf.device)
    if numel == 0:
        return q
    with rt._Launcher(buf.device) as k:
        state = k.state()
        k("threelc_quartic_decode", m, buf, np.int64(numel), q, state)
        err = int(rt._read_state(state)[rt._ST_ERROR])
    if err:
        raise _body_error(err)
    return q


def zero_run_encode(buf):
    rt._check_tensor(buf, "buf", torch.uint8)
    m = buf.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.uint8, device=buf.device)
    table = np.zeros((1, rt._SEG_COLS), dtype=np.int64)  # one row: m quartic bytes at 0
    table[0, rt._SEG_N] = 5 * m
    with rt._Launcher(buf.device) as k:
        seg = rt._segments(table, np.array([m], dtype=np.int64), buf.device)
        states = k.states(1)
        out = _zre_encode(k, seg, buf, states, input_state=states[0])
        host = rt._read_state(states)[0]
    if host[rt._ST_ERROR] & rt.ERR_INPUT:
        raise ValueError("zero_run_encode: input bytes must be quartic bytes (<= 242)")
    return out[: rt._count(host)].clone()


def zero_run_decode(buf, expected_len=None):
    rt._check_tensor(buf, "buf", torch.uint8)
    length = buf.numel()
    if length == 0:
        total = 0
    else:
        with rt._Launcher(buf.device) as k:
            state = k.state()
            incl = _zre_prepare(k, buf, -1, state)
            total = rt._count(rt._read_state(state))
    if expected_len is not None and total != expected_len:
        raise PayloadError(
            "body", f"zero-run decoding gives {total} bytes, expected {expected_len}"
        )
    out = torch.empty(total, dtype=torch.uint8, device=buf.device)
    if length:
        with rt._Launcher(buf.device) as k:
            _zre_expand(k, buf, incl, length, rt._ZERO_GROUP, out, k.state())
    return out


def threelc_encode_segments(gs, es, sparsities):
    """One launch sequence (threelc.cu section 7), one zero-run encode of the
    bucket (runs stop at tensor ends), one read of the states."""
    if not gs:
        return [], [], []
    device = _bucket_device(gs, "g")
    _check_residuals(gs, [g if e is None else e for g, e in zip(gs, es, strict=True)])
    ss = [_sparsity(s) for s in sparsities]
    ns, live, table = _quartic_table(gs)
    table[:, rt._SEG_AUX] = [0 if es[i] is None else es[i].data_ptr() for i in live.tolist()]
    table[:, rt._SEG_F32] = rt._f32_bits([ss[i] for i in live.tolist()])
    bodies = [torch.empty(0, dtype=torch.uint8, device=device)] * len(gs)
    scales, nonfinite = [0.0] * len(gs), [False] * len(gs)
    if not len(live):
        return bodies, scales, nonfinite
    host, encoded = _quartic_bucket(device, table, ns, "threelc_quantize_quartic_segments")
    words = host[:, rt._ST_SCALE].copy().view(np.float32)
    for row, (i, body) in enumerate(zip(live.tolist(), encoded, strict=True)):
        if host[row, rt._ST_NONFINITE]:  # no body, scale 0, the residual untouched
            nonfinite[i] = True
        else:
            bodies[i], scales[i] = body, float(words[row])
    return bodies, scales, nonfinite


def _quartic_table(xs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(numels, the non-empty tensors' indices, their segment table with the input, size
    and first quartic byte filled in)."""
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    live = np.flatnonzero(ns > 0)
    ms = (ns[live] + 4) // 5
    table = _rows(xs, live)
    table[:, rt._SEG_QOFF] = np.cumsum(ms) - ms
    return ns, live, table


def _quartic_bucket(
    device: torch.device, table: np.ndarray, ns: np.ndarray, digits: str
) -> tuple[np.ndarray, list[torch.Tensor]]:
    """The launch sequence of a bucket of quartic + zero-run coded tensors (3LC, TernGrad):
    every tensor's max|g + e| into its state row, the ``digits`` kernel (which reads it)
    writing the bucket's quartic bytes, the bucket's zero-run encode, one read. Returns
    the state rows and each table row's body."""
    live_ms = (table[:, rt._SEG_N] + 4) // 5
    with rt._Launcher(device) as k:
        seg = rt._segments(table, live_ms, device)
        states = k.states(seg.count)
        k.tiles("threelc_absmax_segments", seg, states)
        quartic = k.empty(int(((ns + 4) // 5).sum()), torch.uint8)
        k.tiles(digits, seg, states, quartic)
        out = _zre_encode(k, seg, quartic, states)
        host = rt._read_state(states)
    return host, _segment_bodies(out, host)


def _zre_encode(
    k: rt._Launcher,
    seg: rt._Segments,
    quartic: torch.Tensor,
    states: torch.Tensor,
    input_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Zero-run encode the quartic bytes of ``seg``'s rows, each row's on its own (runs
    stop at its end), into one new buffer; each row's body length goes to its state row.
    Input bytes > 242 set rt.ERR_INPUT in ``input_state``: only ``zero_run_encode`` takes
    bytes from outside (the bucket encoders write quartic bytes), the others pass none
    and the flag goes to a scratch state. No host synchronisation."""
    total = quartic.numel()
    start = k.empty(total, torch.int64)
    k.tiles("threelc_zre_run_starts_segments", seg, quartic, start)
    run_start = _running_max(start)
    del start  # stream-ordered: reused only by later work on this stream
    incl = _zre_emit_scan(k, quartic, run_start, k.state() if input_state is None else input_state)
    out = k.empty(total, torch.uint8)
    k.tiles(
        "threelc_zre_scatter_segments", seg, quartic, run_start, incl, out, np.int64(total), states
    )
    return out


def _segment_bodies(out: torch.Tensor, host: np.ndarray) -> list[torch.Tensor]:
    """Each tensor's body, in order, from the state rows' lengths (a view of ``out``)."""
    if host[:, rt._ST_ERROR].any():
        raise RuntimeError("bucket zero-run encode: a write past the buffer was refused")
    lengths = host[:, rt._ST_COUNT : rt._ST_COUNT + 2].copy().view(np.int64).reshape(-1)
    firsts = np.cumsum(lengths) - lengths
    return [out[a : a + n] for a, n in zip(firsts.tolist(), lengths.tolist(), strict=True)]
