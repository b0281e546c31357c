"""Bucket frames and the receive path: the wire layer's work for a gather compressor.

A gather compressor knows its algorithm (``FrameCodec``: encode a bucket's tensors, the
bounds its payloads obey, decode one payload's body, or a frame's accepted bodies, into
an accumulator); what is the same for every compressor lives here, and the exchanges
call it (docs/wire-format.md, "Bucket frame"; docs/backends.md, "One call per bucket"):

* send: ``compress_bucket`` builds one rank's frame of a bucket from what the compressor
  describes of each payload (flags, params, body), with the bucket's ``wire.FrameLayout``
  (made once per set of tensors, their dtypes checked then);
* receive: ``decode_frame`` adds one rank's frame into float32 accumulators: one native
  scan checks every header (``wire.scan_frame``), the compressor's ``accepts_bucket`` the
  codec parameters and ``decode_segments`` adds the bodies; what they do not accept goes
  the per-payload way (``decode_bucket``, ``decode_parsed``), whose errors name the field;
* every check of a payload before its body is touched (``check_header``), the most
  elements a payload may make the receiver allocate (a bound the receiver sets, never the
  payload: ``numel_limit``) and a decoded tensor's cast to its dtype (``checked_cast``).

Invariant: a payload either decodes to a tensor of exactly the header's (and, when given,
the receiver's expected) shape and dtype, or raises ``PayloadError`` naming the field;
the output is untouched then.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from typing import NamedTuple, Protocol

import numpy as np
import torch

from hvdcompress import wire
from hvdcompress.backends import for_device
from hvdcompress.buckets import StateKey
from hvdcompress.errors import DecodeOverflowError, PayloadError


class Ctx(NamedTuple):  # a NamedTuple: a bucket makes one per tensor and step
    """What the sender knows about a tensor that the payload must match."""

    name: StateKey  # the tensor's name, or a piece's key
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class FrameCodec(Protocol):
    """What this module uses of a gather compressor (``compressors.GatherCompressor``)."""

    name: str  # the payloads' codec
    uses_side_info: bool  # decode_into gets the mean of the lower ranks' tensors (NDQSG)
    cuda_decode_segments: bool  # decode_segments also adds into outputs on a CUDA device

    def check_dtype(self, name, dtype: torch.dtype) -> None: ...
    def encode_bucket(self, tensors: list[torch.Tensor], names: list) -> list: ...
    def check_params(self, header: wire.Header, name) -> None: ...
    def max_numel(self, body_len: int, name) -> int: ...
    def accepts_bucket(self, names, flags, params, body_lens, numels) -> bool: ...
    def decode_into(self, header, body, out, accumulate: bool, side_info) -> None: ...
    def decode_segments(self, frame, params, starts, lens, numels, outs, names, rank): ...
    def decode_new(self, header, body, side_info) -> torch.Tensor: ...
    def decoded_bound(self, header, body) -> float | None: ...


# ---- send ------------------------------------------------------------------------------


_LAYOUTS: dict[tuple, wire.FrameLayout] = {}


def layout(comp: FrameCodec, ctxs: list[Ctx]) -> wire.FrameLayout:
    """The ``wire.FrameLayout`` of a bucket of these tensors for ``comp``'s codec, made once
    per set of tensors (their dtypes checked then) and kept."""
    key = (comp.name, type(comp), tuple(ctxs))
    made = _LAYOUTS.get(key)
    if made is None:
        for ctx in ctxs:
            comp.check_dtype(ctx.name, ctx.dtype)
        if len(_LAYOUTS) >= 256:  # buckets come and go (sparse gradients): stay bounded
            _LAYOUTS.clear()
        made = _LAYOUTS[key] = wire.FrameLayout(
            comp.name, [c.shape for c in ctxs], [c.dtype for c in ctxs]
        )
    return made


def compress_bucket(
    comp: FrameCodec, tensors: list[torch.Tensor], names: list
) -> tuple[torch.Tensor, list[Ctx]]:
    """One rank's frame of a bucket (``wire.frame`` of the payloads ``comp.compress`` gives
    for each tensor in order, byte for byte, the state updated in the same order) and the
    tensors' contexts. The compressor describes each payload (``encode_bucket``: flags,
    params, body); the wire format builds the frame (``wire.frame_bucket``)."""
    if len(tensors) != len(names):
        raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
    ctxs = [
        Ctx(name, tuple(t.shape), t.dtype, t.device) for t, name in zip(tensors, names, strict=True)
    ]
    frame_layout = layout(comp, ctxs)  # checks the dtypes (once per set of tensors)
    return wire.frame_bucket(frame_layout, comp.encode_bucket(tensors, names)), ctxs


# ---- receive: one payload --------------------------------------------------------------


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
    decodes themselves (docs/benchmarks-codecs.md, "Public path against the bucket path"). Where
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


def decode_filled(comp: FrameCodec, header, body, side_info, fill: float | None):
    """The checked body decoded into a new flat float32 tensor on the body's device: added
    into one filled with ``fill`` where ``comp`` gives one (its written ``decode_into`` is,
    bit for bit, the added one into that fill, so a new tensor needs no copy), else
    written into an empty one."""
    flat = new_float32(header.numel, body.device, fill)
    comp.decode_into(header, body, flat, fill is not None, side_info)
    return flat


def decode_parsed(
    comp: FrameCodec,
    header: wire.Header,
    payload: torch.Tensor,
    *,
    expect: Ctx | None = None,
    name=None,
    rank: int | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    side_info: torch.Tensor | None = None,
    max_numel: int | None = None,
) -> torch.Tensor:
    """``GatherCompressor.decode`` of a payload whose header was parsed already (the
    gather path parses each payload once, ``wire.parse``)."""
    if side_info is not None and not comp.uses_side_info:
        raise TypeError(f"{comp.name} decodes without side information")
    if out is not None:
        check_out(out)
    limit, source = numel_limit(None if expect is None else expect.shape, out, max_numel)
    try:
        check_header(comp, header, payload, expect, name, limit, source)
        body = payload[header.size :]
        if out is not None:
            if header.numel != out.numel():
                raise PayloadError(
                    "numel", f"{header.numel} elements for an output of {out.numel()}"
                )
            if header.nonfinite:
                out.fill_(float("nan"))
            else:
                comp.decode_into(header, body, out.view(-1), accumulate, side_info)
            return out
        if header.nonfinite:
            return torch.full(header.shape, float("nan"), dtype=header.dtype, device=payload.device)
        flat = comp.decode_new(header, body, side_info)
        bound = comp.decoded_bound(header, body)  # the body decoded: checked
        return checked_cast(flat.view(header.shape), header.dtype, bound)
    except PayloadError as err:
        raise err.locate(rank=rank, tensor=name) from None


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


# ---- receive: a bucket's frame ---------------------------------------------------------


def decode_bucket(
    comp: FrameCodec,
    parsed: list[tuple[wire.Header, torch.Tensor]],
    outs: list[torch.Tensor],
    ctxs: list[Ctx],
    *,
    rank: int | None = None,
) -> None:
    """Add one rank's decoded payloads of a bucket into ``outs`` (contiguous float32, one
    per tensor, holding the sums of the lower ranks' payloads): ``decode_parsed(...,
    accumulate=True)`` of each in order, with the same checks and errors. A compressor
    that decodes with side information (NDQSG) gets the gather path's: the mean of the
    lower ranks' decoded tensors, ``out / rank`` for rank > 0."""
    for (header, payload), out, ctx in zip(parsed, outs, ctxs, strict=True):
        side = out / rank if comp.uses_side_info and rank else None
        decode_parsed(
            comp,
            header,
            payload,
            expect=ctx,
            name=ctx.name,
            rank=rank,
            out=out,
            accumulate=True,
            side_info=side,
        )


def decode_frame(
    comp: FrameCodec,
    frame: torch.Tensor,
    outs: list[torch.Tensor],
    ctxs: list[Ctx],
    *,
    rank: int | None = None,
) -> None:
    """Add one rank's frame of a bucket (``compress_bucket``'s) into ``outs``: exactly
    ``decode_bucket`` of ``wire.unframe_parsed(frame, ...)`` (same sums, checks and
    errors). Fast path (CPU outputs, or GPU ones for ``cuda_decode_segments``): one native
    scan checks every header against the bucket's ``layout`` (``wire.scan_frame``),
    ``comp.accepts_bucket`` the codec parameters, ``comp.decode_segments`` adds the
    bodies; what they do not accept goes the per-payload way, whose errors name the field."""
    names = [ctx.name for ctx in ctxs]
    scanned = scan_accepted(comp, frame, outs, ctxs, names)
    if scanned is None:
        device = outs[0].device if outs else torch.device("cpu")
        parsed = wire.unframe_parsed(frame, rank, names, device)
        decode_bucket(comp, parsed, outs, ctxs, rank=rank)
        return
    params, starts, lens, numels, nonfinite = scanned
    for out in outs:
        check_out(out)
    outs = [out if out.dim() == 1 else out.view(-1) for out in outs]
    finite = np.flatnonzero(~nonfinite)
    pick = finite.tolist()
    failed = None
    if pick:
        segments = [params[i] for i in pick], starts[finite], lens[finite], numels[finite]
        picked = [outs[i] for i in pick], [names[i] for i in pick]
        failed = comp.decode_segments(frame, *segments, *picked, rank)
    # a non-finite payload's output is all NaN, in bucket order: up to a failed body
    stop = len(outs) if failed is None else pick[failed[0]]
    for i in np.flatnonzero(nonfinite[:stop]).tolist():
        outs[i].fill_(float("nan"))
    if failed is not None:
        raise failed[1].locate(rank=rank, tensor=names[stop]) from None


def scan_accepted(comp: FrameCodec, frame: torch.Tensor, outs: list[torch.Tensor], ctxs, names):
    """``decode_frame``'s fast-path checks: (params, body starts, body lengths, numels,
    non-finite flags) of every payload when the scan, ``comp.accepts_bucket`` and the
    outputs' sizes accept the frame, else None (the per-payload way)."""
    devices = {o.device for o in outs}
    if len(devices) > 1:
        return None
    device = devices.pop() if devices else torch.device("cpu")
    if device.type != "cpu" and not (device.type == "cuda" and comp.cuda_decode_segments):
        return None
    if device.type == "cpu" and frame.device.type != "cpu":
        return None  # the per-payload path moves each payload
    scanned = wire.scan_frame(frame, layout(comp, ctxs))  # on the frame's device
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


def accepts_each(
    comp: FrameCodec,
    names: list,
    flags: np.ndarray,
    params: list[bytes],
    body_lens: np.ndarray,
    numels: np.ndarray,
) -> bool:
    """True when every payload of a scanned frame passes ``comp.check_params`` and, unless
    non-finite, ``numel <= comp.max_numel(body_len)``: ``GatherCompressor.accepts_bucket``
    unless a compressor does it with array arithmetic; False: the per-payload way."""
    for name, flag, param, body_len, numel in zip(
        names, flags.tolist(), params, body_lens.tolist(), numels.tolist(), strict=True
    ):
        header = wire.Header(comp.name, flag, torch.float32, (numel,), param, body_len)
        try:
            comp.check_params(header, name)
        except PayloadError:
            return False
        if not header.nonfinite and numel > comp.max_numel(body_len, name):
            return False
    return True


def decode_each(
    comp: FrameCodec,
    frame: torch.Tensor,
    params: list[bytes],
    starts: np.ndarray,
    lens: np.ndarray,
    numels: np.ndarray,
    outs: list[torch.Tensor],
    rank: int | None,
) -> tuple[int, PayloadError] | None:
    """``comp.decode_into`` (adding) of each accepted body ``frame[starts[i]:][:lens[i]]``
    into ``outs[i]``: ``GatherCompressor.decode_segments`` unless a codec has a batched
    decoder. None, or (i, the PayloadError) of the first that does not decode (the ones
    before it added, ``outs[i]`` untouched); side information as in ``decode_bucket``."""
    for i, (param, start, length, numel) in enumerate(
        zip(params, starts.tolist(), lens.tolist(), numels.tolist(), strict=True)
    ):
        header = wire.Header(comp.name, 0, torch.float32, (numel,), param, length)
        side = outs[i] / rank if comp.uses_side_info and rank else None
        try:
            comp.decode_into(header, frame[start : start + length], outs[i], True, side)
        except PayloadError as err:
            return i, err
    return None
