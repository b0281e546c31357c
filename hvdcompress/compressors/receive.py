"""What a decode checks (``GatherCompressor.decode_parsed`` and ``decode_frame``): the
output tensor the caller hands in, the most elements a payload may make the receiver
allocate (a bound the receiver sets, never the payload), every header check before the
body is touched (one payload's, or a whole frame's scan), and a decoded float32 tensor's
cast to the payload's dtype."""

from __future__ import annotations

import ctypes
import math
import os
import sys

import numpy as np
import torch

from hvdcompress import wire
from hvdcompress.backends import for_device
from hvdcompress.errors import DecodeOverflowError, PayloadError

_HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


def _madvise():
    if sys.platform != "linux" or os.environ.get("HVDCOMPRESS_HUGE_PAGES", "1") == "0":
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


_MADVISE = _madvise()


def new_float32(numel: int, device: torch.device, fill: float | None = None) -> torch.Tensor:
    """A new flat float32 tensor for a decode to write (``fill``: filled first).

    Why the advice: a fresh CPU tensor of 40 MB is mapped by the kernel at first touch,
    one fault per 4 KiB page, and that costs 2.6-4.3 memcpys of its size, more than most
    decodes themselves (docs/benchmarks.md, "Public path against the bucket path"). Where
    the tensor spans whole 2 MiB pages those are advised as transparent huge pages
    (``madvise(MADV_HUGEPAGE)``, what ``THP_MEM_ALLOC_ENABLE=1`` asks of torch's
    allocator) before the first write, 512 times fewer faults. Only advice: where THP is
    off the call fails and nothing changes. ``HVDCOMPRESS_HUGE_PAGES=0`` turns it off."""
    flat = torch.empty(numel, dtype=torch.float32, device=device)
    if _MADVISE is not None and flat.device.type == "cpu" and numel * 4 >= 2 * _HUGE_PAGE:
        begin = flat.data_ptr()
        first = -(-begin // _HUGE_PAGE) * _HUGE_PAGE
        last = (begin + numel * 4) // _HUGE_PAGE * _HUGE_PAGE
        if last > first:
            _MADVISE(first, last - first, _MADV_HUGEPAGE)
    if fill is not None:
        flat.fill_(fill)
    return flat


def check_out(out: torch.Tensor) -> None:
    """The caller's output tensor (a ValueError: the caller's mistake, not the payload's)."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 tensor, got {getattr(out, 'dtype', type(out))}"
        )


def numel_limit(
    expect_shape: tuple[int, ...] | None, out: torch.Tensor | None, max_numel: int | None
):
    """(the most elements a payload may make this decode produce, where that comes from):
    the expected tensor's size, ``out``'s size, an explicit ``max_numel`` (the smallest of
    those given), else the default bound (``wire.decode_limit``). With ``out`` a payload
    must describe exactly ``out.numel()`` elements (``decode_parsed`` checks)."""
    limits = []
    if expect_shape is not None:
        limits.append((math.prod(expect_shape), "the expected tensor's shape"))
    if out is not None:
        limits.append((out.numel(), "the output tensor's size"))
    if max_numel is not None:
        limits.append((wire.decode_limit(max_numel), "max_numel"))
    if not limits:
        return wire.decode_limit(), "the default bound; pass expect= or max_numel="
    return min(limits)


def check_header(comp, header: wire.Header, payload: torch.Tensor, expect, name, limit, source):
    """Every check of a payload's header for compressor ``comp`` (``expect``: a Ctx or None)
    before any allocation or body access; ``limit`` from ``numel_limit``, as ``source``."""
    if header.codec != comp.name:
        raise PayloadError("codec", f"expected {comp.name!r}, got {header.codec!r}")
    if expect is not None:
        if header.shape != tuple(expect.shape):
            raise PayloadError("shape", f"expected {tuple(expect.shape)}, got {header.shape}")
        if header.dtype != expect.dtype:
            raise PayloadError("dtype", f"expected {expect.dtype}, got {header.dtype}")
    if header.numel > limit:  # before any allocation
        raise PayloadError(
            "numel",
            f"header claims {header.numel} elements {tuple(header.shape)}, more than the "
            f"{limit} this receiver accepts ({source})",
        )
    comp.check_params(header, name)
    if header.nonfinite and header.body_len != 0:
        raise PayloadError(
            "body_len", f"a non-finite payload carries no body, got {header.body_len} bytes"
        )
    if not header.nonfinite and header.numel > comp.max_numel(header.body_len, name):
        raise PayloadError(
            "numel", f"{header.numel} elements cannot come from {header.body_len} body bytes"
        )
    wire.verify_checksum(header, payload)


def scan_accepted(comp, frame: torch.Tensor, outs: list[torch.Tensor], ctxs, names: list[str]):
    """``decode_frame``'s fast-path checks for compressor ``comp``: (params, body starts, body
    lengths, numels, non-finite flags) of every payload when the scan, ``comp.accepts_bucket``
    and the outputs' sizes accept the frame, else None (the per-payload way)."""
    devices = {o.device for o in outs}
    if len(devices) > 1:
        return None
    device = devices.pop() if devices else torch.device("cpu")
    if device.type != "cpu" and not (device.type == "cuda" and comp.cuda_decode_segments):
        return None
    if device.type == "cpu" and frame.device.type != "cpu":
        return None  # the per-payload path moves each payload
    scanned = wire.scan_frame(frame, comp.frame_layout(ctxs))  # on the frame's device
    if scanned is None:
        return None
    fields, params = scanned
    col = wire.SCAN
    flags = fields[:, col["flags"]]
    lens = np.ascontiguousarray(fields[:, col["body_len"]])
    starts = fields[:, col["start"]] + fields[:, col["length"]] - lens
    numels = np.ascontiguousarray(fields[:, col["numel"]])
    sizes = np.fromiter((o.numel() for o in outs), dtype=np.int64, count=len(outs))
    nonfinite = (flags & wire.FLAG_NONFINITE) != 0
    if not np.array_equal(sizes, numels) or not bool((lens[nonfinite] == 0).all()):
        return None  # decode_parsed names the mismatch ("numel", "body_len")
    if not comp.accepts_bucket(names, flags, params, lens, numels):
        return None
    return params, starts, lens, numels, nonfinite


def fits(bound: float, dtype: torch.dtype) -> bool:
    """Whether every float32 of magnitude at most ``bound`` is finite in ``dtype``: the
    float32 ``bound`` itself is finite and stays finite when rounded to ``dtype``."""
    if not math.isfinite(bound):
        return False
    value = torch.tensor(bound, dtype=torch.float32)
    return bool(torch.isfinite(value)) and bool(torch.isfinite(value.to(dtype)))


def checked_cast(
    flat32: torch.Tensor, dtype: torch.dtype, bound: float | None = None
) -> torch.Tensor:
    """The decoded float32 values in the payload's dtype; DecodeOverflowError when a value
    is not finite (the header's non-finite flag is clear on this path): the float32
    decode overflowed, or the cast to float16 / bfloat16 did. ``bound``: a bound on every
    |value| the decode can give (``GatherCompressor.decoded_bound``); when it ``fits``
    the dtype the answer is known without reading the values. Else the check is one read
    of the cast values by the device's backend (``nonfinite``: on the CPU a native pass
    over the bits, no boolean tensor); the error's text is worked out when it fails."""
    cast = flat32.to(dtype)
    if bound is not None and fits(bound, dtype):
        return cast
    if for_device(cast.device).nonfinite(cast):
        finite32 = bool(torch.isfinite(flat32).all())
        where = f"the cast to {dtype}" if finite32 else "the float32 decode"
        big = float(flat32[torch.isfinite(flat32)].abs().max()) if finite32 else math.inf
        raise DecodeOverflowError(
            f"{where} gives non-finite values (largest |value| {big:g}, {dtype} holds at "
            f"most {torch.finfo(dtype).max:g}) while the payload's non-finite flag is clear"
        )
    return cast
