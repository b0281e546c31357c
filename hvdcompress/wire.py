"""The self-describing payload format shared by every rank and backend (docs/wire-format.md).

A payload is a 1-D uint8 tensor: a fixed little-endian header, codec parameters,
then the codec's body::

    offset  size  field
    0       4     magic        b"HVDC"
    4       1     version      1
    5       1     codec        codec id (CODEC_IDS)
    6       1     flags        bit 0: non-finite input (decode gives all NaN)
    7       1     dtype        0 float32, 1 float16, 2 bfloat16
    8       1     ndim         0..8
    9       1     reserved     0
    10      2     params_len   bytes of codec parameters after the shape
    12      4     checksum     see ``checksum``; computed with this field zeroed
    16      8     numel        element count, product of the shape
    24      8     body_len     bytes of body after the parameters
    32      8*nd  shape        one uint64 per dimension
    ..      pl    params       codec-specific (3LC: sparsity f32, scale f32)
    ..      bl    body

Invariant: ``decode(encode(x))`` either returns a tensor of exactly the header's
shape and dtype or raises ``PayloadError`` (a ``ValueError``) naming the field;
no field is trusted before it is checked, and nothing is allocated from an
unchecked size: what a payload may make a receiver allocate is bounded by the receiver
(the tensor it expects, its output tensor, or ``decode_limit``: an explicit
``max_numel``, ``$HVDCOMPRESS_MAX_DECODE_NUMEL`` or ``DEFAULT_MAX_DECODE_NUMEL``), checked
(``framing.check_header``) before anything is allocated. A shape whose
non-zero dimensions multiply past 2**63 - 1 (not a torch shape, even when empty) fails at
the header.

The checksum (``checksum_numpy``, docs/wire-format.md) is a position-weighted byte sum
that a GPU computes as an order-independent reduction with the CPU's result; any single
changed byte changes it. A bucket's payloads travel in one frame per rank
(``frame_bucket``, ``scan_frame``).
"""

from __future__ import annotations

import math
import os
import struct
from typing import NamedTuple

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.backends.records import CHECKSUM_FIELD, FIXED_HEADER_BYTES, MAX_NDIM, SCAN, mix
from hvdcompress.errors import PayloadError  # noqa: F401 - also wire.PayloadError

MAGIC = b"HVDC"
VERSION = 1
FIXED_HEADER = struct.Struct("<4sBBBBBBHIQQ")  # 32 bytes, fields as in the table above
MAX_PARAMS = 256
MAX_HEADER = 32 + 8 * MAX_NDIM + MAX_PARAMS  # read this many bytes to parse any header
# The fixed header's fields: name -> (offset, size), as in the table above ("shape" is
# its first dimension; dimension i is at 32 + 8 * i).
HEADER_FIELDS = {
    "magic": (0, 4),
    "version": (4, 1),
    "codec": (5, 1),
    "flags": (6, 1),
    "dtype": (7, 1),
    "ndim": (8, 1),
    "reserved": (9, 1),
    "params_len": (10, 2),
    "checksum": (12, 4),
    "numel": (16, 8),
    "body_len": (24, 8),
    "shape": (32, 8),
}
CHECKSUM_OFFSET = HEADER_FIELDS["checksum"][0]
# the backends' kernels compile this layout in (hvdcompress.backends.records)
assert FIXED_HEADER.size == FIXED_HEADER_BYTES and CHECKSUM_OFFSET == CHECKSUM_FIELD
MAX_SHAPE_PRODUCT = 2**63 - 1  # the product of a shape's non-zero dims (torch's int64)

# The most elements the public ``decode`` allocates for a payload when the caller gives
# neither the tensor it expects (``expect``), an output tensor (``out``) nor an explicit
# ``max_numel``: 2**24 (64 MiB as float32). The environment variable overrides it.
DEFAULT_MAX_DECODE_NUMEL = 2**24
MAX_DECODE_NUMEL_ENV = "HVDCOMPRESS_MAX_DECODE_NUMEL"

FLAG_NONFINITE = 1
KNOWN_FLAGS = FLAG_NONFINITE

# Filled by the compressor registry (hvdcompress.compressors.registry.register, from
# each compressor's ``wire_id``). Fixed forever once released: a payload's codec id
# outlives the code that wrote it.
CODEC_IDS: dict[str, int] = {}
CODEC_NAMES: dict[int, str] = {}

DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPES = {v: k for k, v in DTYPE_IDS.items()}


def register_codec(name: str, codec_id: int) -> None:
    """Give codec ``name`` the header id ``codec_id`` (1..255, unique, never reused)."""
    if isinstance(codec_id, bool) or not isinstance(codec_id, int) or not 1 <= codec_id <= 255:
        raise ValueError(f"codec {name!r}: wire id must be an int in [1, 255], got {codec_id!r}")
    if CODEC_NAMES.get(codec_id, name) != name or CODEC_IDS.get(name, codec_id) != codec_id:
        raise ValueError(
            f"codec {name!r} wants wire id {codec_id}, taken by "
            f"{CODEC_NAMES.get(codec_id)!r} (ids are unique and fixed forever)"
        )
    CODEC_IDS[name] = codec_id
    CODEC_NAMES[codec_id] = name


def checksum_numpy(buf: np.ndarray, offset: int = 0) -> int:
    """Reference checksum of a uint8 array whose first byte sits at payload position ``offset``."""
    if buf.size == 0:
        return 0
    idx = np.arange(offset, offset + buf.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        terms = (buf.astype(np.uint64) + np.uint64(1)) * mix(idx)
    return int(np.bitwise_and(terms.sum(dtype=np.uint64), np.uint64(0xFFFFFFFF)))


class Header(NamedTuple):  # a NamedTuple: built once per payload on the hot path
    codec: str
    flags: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: bytes
    body_len: int
    checksum: int = 0
    raw: bytes = b""  # the header's bytes as received (parse), empty when built to send

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nonfinite(self) -> bool:
        return bool(self.flags & FLAG_NONFINITE)

    @property
    def size(self) -> int:
        return FIXED_HEADER.size + 8 * len(self.shape) + len(self.params)

    def pack(self) -> bytes:
        """The header's bytes, its checksum field zero (``assemble`` fills it in)."""
        if len(self.shape) > MAX_NDIM:
            raise ValueError(
                f"hvdcompress payloads hold tensors of at most {MAX_NDIM} dims, "
                f"got {len(self.shape)}"
            )
        codec, dtype, ndim = CODEC_IDS[self.codec], DTYPE_IDS[self.dtype], len(self.shape)
        sizes = (len(self.params), 0, self.numel, self.body_len)  # the checksum field is 0
        fixed = FIXED_HEADER.pack(MAGIC, VERSION, codec, self.flags, dtype, ndim, 0, *sizes)
        return fixed + struct.pack(f"<{ndim}Q", *self.shape) + self.params


def parse_header(raw: bytes | memoryview, total_len: int) -> Header:
    """Parse and check a header from the first bytes of a payload of ``total_len`` bytes.

    ``raw`` must hold at least the whole header (callers pass the first
    ``min(total_len, MAX_HEADER)`` bytes). Raises PayloadError.
    """
    if total_len < FIXED_HEADER.size or len(raw) < FIXED_HEADER.size:
        raise PayloadError(
            "length",
            f"{total_len} bytes is shorter than the "
            f"{FIXED_HEADER.size}-byte header (truncated payload)",
        )
    fixed = FIXED_HEADER.unpack_from(raw, 0)
    magic, version, codec_id, flags, dtype_id, ndim, reserved, params_len = fixed[:8]
    csum, numel, body_len = fixed[8:]
    if magic != MAGIC:
        raise PayloadError(
            "magic", f"expected {MAGIC!r}, got {bytes(magic)!r} (not an hvdcompress payload)"
        )
    if version != VERSION:
        raise PayloadError("version", f"expected format version {VERSION}, got {version}")
    if codec_id not in CODEC_NAMES:
        raise PayloadError("codec", f"unknown codec id {codec_id}")
    if flags & ~KNOWN_FLAGS:
        raise PayloadError("flags", f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:02x}")
    if dtype_id not in DTYPES:
        raise PayloadError("dtype", f"unknown dtype id {dtype_id}")
    if ndim > MAX_NDIM:
        raise PayloadError("ndim", f"{ndim} dims, at most {MAX_NDIM} allowed")
    if params_len > MAX_PARAMS:
        raise PayloadError("params_len", f"{params_len} bytes, at most {MAX_PARAMS} allowed")
    if reserved != 0:
        raise PayloadError("reserved", f"expected 0, got {reserved}")
    header_len = FIXED_HEADER.size + 8 * ndim + params_len
    if total_len < header_len or len(raw) < header_len:
        raise PayloadError(
            "length",
            f"{total_len} bytes cannot hold the {header_len}-byte "
            "header it announces (truncated payload)",
        )
    shape = struct.unpack_from(f"<{ndim}Q", raw, FIXED_HEADER.size)
    prod = nonzero = 1
    for d in shape:
        prod *= d
        nonzero *= max(d, 1)
    if nonzero > MAX_SHAPE_PRODUCT:
        # torch sizes are int64: even an empty tensor's shape must be one torch can hold
        raise PayloadError("shape", f"{shape} is not a tensor shape (dims multiply past 2**63 - 1)")
    if prod != numel:
        raise PayloadError(
            "numel", f"header says {numel} elements but its shape {shape} holds {prod}"
        )
    if body_len != total_len - header_len:
        raise PayloadError(
            "body_len", f"header says {body_len} body bytes, payload has {total_len - header_len}"
        )
    params = bytes(raw[FIXED_HEADER.size + 8 * ndim : header_len])
    codec, dtype = CODEC_NAMES[codec_id], DTYPES[dtype_id]
    return Header(
        codec, flags, dtype, tuple(shape), params, body_len, csum, bytes(raw[:header_len])
    )


def decode_limit(max_numel: int | None = None) -> int:
    """The element bound of a decode that has no expected tensor: ``max_numel`` when given,
    else ``$HVDCOMPRESS_MAX_DECODE_NUMEL``, else ``DEFAULT_MAX_DECODE_NUMEL``. A bad value
    is the caller's error (ValueError / TypeError), not the payload's."""
    if max_numel is None:
        env = os.environ.get(MAX_DECODE_NUMEL_ENV)
        if env is None:
            return DEFAULT_MAX_DECODE_NUMEL
        try:
            max_numel = int(env, 0)
        except ValueError:
            raise ValueError(f"${MAX_DECODE_NUMEL_ENV} must be an integer, got {env!r}") from None
    if isinstance(max_numel, bool) or not isinstance(max_numel, int | np.integer):
        raise TypeError(f"max_numel must be an int, got {type(max_numel).__name__}")
    if not 0 <= max_numel <= 2**60:
        raise ValueError(f"max_numel must be in [0, 2**60], got {max_numel}")
    return int(max_numel)


_FIELD_MIX = [int(w) for w in mix(np.arange(CHECKSUM_OFFSET, CHECKSUM_OFFSET + 4))]


def checksum_without_field(full: int, field_bytes: bytes) -> int:
    """The checksum with its own field zeroed, from the checksum of the whole payload.

    Lets every backend checksum a payload in one pass: zeroing the field removes
    b * mix(j) for each of its four bytes.
    """
    for b, w in zip(field_bytes, _FIELD_MIX, strict=True):
        full -= b * w
    return full & 0xFFFFFFFF


# ---- payloads on a device ---------------------------------------------------------------------
def parse(payload: torch.Tensor) -> Header:
    """The checked header of a payload tensor (1-D uint8, any device): one small
    device-to-host copy on a GPU, a view on the CPU. Raises PayloadError."""
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        got = getattr(payload, "dtype", type(payload).__name__)
        raise PayloadError("payload", f"expected a uint8 tensor, got {got}")
    if payload.dim() != 1:
        raise PayloadError("payload", f"expected a 1-D tensor, got shape {tuple(payload.shape)}")
    raw = payload.numpy() if payload.device.type == "cpu" else payload[:MAX_HEADER].cpu().numpy()
    return parse_header(raw, payload.numel())


def read_header(payload: torch.Tensor) -> tuple[Header, bytes]:
    """The parsed header and its raw bytes (see ``parse``)."""
    header = parse(payload)
    return header, header.raw


def bits_per_value(payload: torch.Tensor) -> float:
    """Bits on the wire per tensor element of a payload, header included."""
    return 8.0 * payload.numel() / max(parse(payload).numel, 1)


def assemble(header: Header, body: torch.Tensor) -> torch.Tensor:
    """Header + body in one tensor on the body's device; the checksum is one pass over the
    whole payload by the device's backend."""
    head = header.pack()
    size = len(head)
    payload = torch.empty(size + body.numel(), dtype=torch.uint8, device=body.device)
    payload[size:].copy_(body)
    payload[:size].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    csum = _payload_checksum(for_device(body.device), payload).to_bytes(4, "little")
    payload[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 4].copy_(
        torch.frombuffer(bytearray(csum), dtype=torch.uint8)
    )
    return payload


def _payload_checksum(backend, payload: torch.Tensor) -> int:
    """``checksum`` (offset 0) of the whole payload: the backend's checksums of a bucket of
    segments, with one segment."""
    return backend.checksum_segments(payload, [0], [payload.numel()])[0]


def verify_checksum(header: Header, payload: torch.Tensor) -> None:
    """Raise PayloadError unless the payload's bytes give the header's checksum."""
    field = header.raw[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 4]
    csum = checksum_without_field(_payload_checksum(for_device(payload.device), payload), field)
    if csum != header.checksum:
        raise PayloadError(
            "checksum", f"expected 0x{header.checksum:08x}, computed 0x{csum:08x} (corrupt payload)"
        )


# ---- frames: one rank's payloads of one bucket ---------------------------------------------
def frame(payloads: list[torch.Tensor]) -> torch.Tensor:
    """``n``, ``n`` payload lengths (uint64 little-endian), then the ``n`` payloads: the
    bytes one rank contributes to a bucket's allgather, on the payloads' device."""
    head = struct.pack(f"<Q{len(payloads)}Q", len(payloads), *(p.numel() for p in payloads))
    table = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    return torch.cat([table.to(payloads[0].device) if payloads else table, *payloads])


def unframe(frame: torch.Tensor, count: int, rank: int, names: list[str]) -> list[torch.Tensor]:
    """Split one rank's frame into its ``count`` payloads (views); a malformed frame raises
    PayloadError naming the rank."""
    head_len = 8 * (count + 1)
    if frame.numel() < head_len:
        raise PayloadError(
            "frame", f"{frame.numel()} bytes cannot hold a table of {count} lengths", rank=rank
        )
    table = np.frombuffer(frame[:head_len].cpu().numpy().tobytes(), dtype="<u8")  # any device
    if int(table[0]) != count:
        raise PayloadError(
            "frame", f"{int(table[0])} payloads in the bucket, expected {count}", rank=rank
        )
    lengths = [int(x) for x in table[1:]]
    if head_len + sum(lengths) != frame.numel():
        raise PayloadError(
            "frame",
            f"lengths add up to {head_len + sum(lengths)} bytes, frame has {frame.numel()}",
            rank=rank,
            tensor=names[0] if count == 1 else None,
        )
    return list(frame[head_len:].split(lengths))


def unframe_parsed(
    frame: torch.Tensor, rank: int, names: list[str], device: torch.device
) -> list[tuple[Header, torch.Tensor]]:
    """``unframe`` one rank's frame of the tensors ``names`` and ``parse`` each payload
    (moved to ``device`` first): the receive path parses every header exactly once, here.
    A PayloadError names the rank and, for a payload, its tensor."""
    out = []
    for payload, name in zip(unframe(frame, len(names), rank, names), names, strict=True):
        payload = payload.to(device)
        try:
            out.append((parse(payload), payload))
        except PayloadError as err:
            raise err.locate(rank=rank, tensor=name) from None
    return out


# ---- frames in one native call (kernels/frame.c, frame.cu section 3; docs/wire-format.md,
# "Bucket frame") ---------------------------------------------------------------------------------


class FrameLayout:
    """The per-tensor parts of a bucket's payloads that do not change from step to step:
    the codec, and each tensor's dtype and shape. Holds the packed header templates the
    sender's frame is written from (``frame_bucket``: flags, params and body are the
    step's) and the expectations a receiver checks a scanned frame against
    (``scan_frame``)."""

    def __init__(self, codec: str, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]):
        self.codec, self.count = codec, len(shapes)
        self.tensor_shapes = [tuple(sh) for sh in shapes]
        self.dtypes = list(dtypes)
        heads = [
            Header(codec, 0, dt, tuple(sh), b"", 0).pack()
            for sh, dt in zip(shapes, dtypes, strict=True)
        ]
        self.head_lens = np.fromiter(map(len, heads), dtype=np.int64, count=self.count)
        self.head_starts = np.zeros(self.count, dtype=np.int64)
        np.cumsum(self.head_lens[:-1], out=self.head_starts[1:])
        self.heads = np.frombuffer(b"".join(heads) or b"\0", dtype=np.uint8)
        self.codec_id = CODEC_IDS[codec]
        self.dtype_ids = np.array([DTYPE_IDS[dt] for dt in dtypes], dtype=np.int64)
        self.ndims = np.array([len(sh) for sh in shapes], dtype=np.int64)
        self.shapes = np.zeros((self.count, MAX_NDIM), dtype=np.uint64)
        for row, sh in zip(self.shapes, shapes, strict=True):
            row[: len(sh)] = sh


def frame_bucket(
    layout: FrameLayout, encoded: list[tuple[int, bytes, torch.Tensor]]
) -> torch.Tensor:
    """One rank's frame of a bucket: ``frame`` of the payloads ``assemble`` makes of each
    tensor's header (the layout's codec, dtype and shape) and its ``(flags, params,
    body)``, byte for byte. Bodies on the CPU (contiguous uint8): written by one native
    call; on a GPU: one buffer on the bodies' device (``device_frame``)."""
    bodies = [body for _, _, body in encoded]
    if all(b.device.type == "cpu" for b in bodies):
        from hvdcompress.backends import cpu

        params = [p for _, p, _ in encoded]
        params_lens = np.fromiter(map(len, params), dtype=np.int64, count=len(params))
        if params_lens.size and int(params_lens.max()) > MAX_PARAMS:
            raise ValueError(
                f"codec parameters of at most {MAX_PARAMS} bytes, got {params_lens.max()}"
            )
        flags = np.array([f for f, _, _ in encoded], dtype=np.uint8)
        templates = (layout.heads, layout.head_starts, layout.head_lens)
        return cpu.frame_write(*templates, flags, b"".join(params), params_lens, bodies)
    rows = zip(layout.tensor_shapes, layout.dtypes, encoded, strict=True)
    heads = [
        Header(layout.codec, flags, dtype, shape, params, body.numel()).pack()
        for shape, dtype, (flags, params, body) in rows
    ]
    return device_frame(heads, bodies)


def device_frame(heads: list[bytes], bodies: list[torch.Tensor]) -> torch.Tensor:
    """``frame`` of the payloads ``assemble`` makes of each packed header (checksum
    field zero) and body, built as one buffer on the bodies' device: the length table and
    the headers staged in one host buffer (one copy to the device), the frame one
    ``torch.cat`` of them and the bodies, then every payload's checksum written in place by
    one backend call (``store_checksums``; on CUDA without a host round trip)."""
    device = bodies[0].device if bodies else torch.device("cpu")
    lengths = [len(h) + b.numel() for h, b in zip(heads, bodies, strict=True)]
    table = struct.pack(f"<Q{len(lengths)}Q", len(lengths), *lengths)
    starts = np.cumsum([len(table), *lengths[:-1]]).tolist() if lengths else []
    staged = torch.frombuffer(bytearray(table + b"".join(heads)), dtype=torch.uint8).to(device)
    pieces, at = [staged[: len(table)]], len(table)
    for head, body in zip(heads, bodies, strict=True):
        pieces += [staged[at : at + len(head)], body.reshape(-1).to(device)]
        at += len(head)
    frame = torch.cat(pieces)
    for_device(device).store_checksums(frame, starts, lengths, CHECKSUM_OFFSET)
    return frame


def scan_frame(frame: torch.Tensor, layout: FrameLayout) -> tuple[np.ndarray, list[bytes]] | None:
    """The scanned fields (``records.SCAN_FIELDS`` columns, a row per payload) and codec parameters
    of one rank's frame when it holds ``layout.count`` payloads each of which ``parse``
    accepts (checksum included) and whose codec, dtype and shape are the layout's, and
    whose flags are known; else None (the caller then takes ``unframe_parsed``, whose
    errors name the field). The frame's own device scans it: a frame on a GPU is not
    copied to the host (kernels/frame.cu section 3). Codec parameters and bodies are the
    compressor's to check."""
    scanned = for_device(frame.device).frame_scan(frame, layout.count)
    if scanned is None:
        return None
    fields, shapes = scanned.fields, scanned.shapes
    good = (
        (fields[:, SCAN["ok"]] == 1)
        & (fields[:, SCAN["codec"]] == layout.codec_id)
        & (fields[:, SCAN["flags"]] & ~KNOWN_FLAGS == 0)
        & (fields[:, SCAN["dtype"]] == layout.dtype_ids)
        & (fields[:, SCAN["ndim"]] == layout.ndims)
        & (shapes == layout.shapes).all(axis=1)
    )
    return (fields, scanned.params) if bool(good.all()) else None
