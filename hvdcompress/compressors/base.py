"""The compressor interface: a codec plus per-tensor state, speaking the wire format.

``compress(tensor, name) -> (payload, ctx)`` turns a gradient into a self-describing
uint8 payload (hvdcompress.wire) on the tensor's device; ``decode(payload)`` turns
any rank's payload back into a tensor, validating every header field first;
``decompress(payload, ctx)`` is decode plus a check that the payload is the one the
caller expects (shape, dtype, codec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hvdcompress import wire
from hvdcompress.backends import for_device
from hvdcompress.wire import PayloadError


def empty_body(device) -> torch.Tensor:
    """The body of a non-finite payload (the flag says it all)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def check_scale(header, scale: float) -> None:
    """A payload's scale parameter: 0 when the input was non-finite, else finite >= 0."""
    if header.nonfinite:
        if scale != 0.0:
            raise PayloadError("scale", f"a non-finite payload has scale 0, got {scale}")
    elif not (math.isfinite(scale) and scale >= 0.0):
        raise PayloadError("scale", f"expected a finite scale >= 0, got {scale}")


@dataclass(frozen=True)
class Ctx:
    """What the sender knows about a tensor that the payload must match."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class Compressor:
    """Base class. Subclasses set ``name`` and implement ``_encode`` and ``_decode_body``."""

    name: str = ""
    summable: bool = False  # True: payloads may be summed by an allreduce (fp16, PowerSGD)
    error_feedback: bool = False

    # ---- public API ---------------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Ctx]:
        if tensor.dtype not in wire.DTYPE_IDS:
            raise TypeError(
                f"{self.name}: tensor {name!r} has dtype {tensor.dtype}; "
                "supported: float32, float16, bfloat16"
            )
        ctx = Ctx(name, tuple(tensor.shape), tensor.dtype, tensor.device)
        flags, params, body = self._encode(tensor, name)
        header = wire.Header(self.name, flags, tensor.dtype, ctx.shape, params, body.numel())
        return self._assemble(header, body), ctx

    def decompress(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        return self.decode(payload, expect=ctx)

    def decode(
        self,
        payload: torch.Tensor,
        *,
        expect: Ctx | None = None,
        rank: int | None = None,
        name: str | None = None,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """Decode any rank's payload into a new tensor of the header's shape and dtype.

        With ``out`` (contiguous float32 of numel elements) the values are written into
        it, or with ``accumulate`` added to it in float32, and ``out`` is returned: this
        is how the gather path sums the payloads of all ranks in rank order. Raises
        PayloadError naming the field, and ``rank`` / ``name`` when given; ``out`` is
        untouched when it raises.
        """
        tensor_name = name if name is not None else (expect.name if expect else None)
        try:
            return self._decode_checked(payload, expect, out, accumulate)
        except PayloadError as err:
            raise err.locate(rank=rank, tensor=tensor_name) from None

    def bind(self, rank: int, size: int) -> None:
        """Told by the optimizer which rank this is, out of how many. Compressors that
        draw random numbers key them by rank; the others ignore it."""

    def bits_per_value(self, payload: torch.Tensor) -> float:
        """Bits on the wire per tensor element, header included."""
        header, _ = self.read_header(payload)
        return 8.0 * payload.numel() / max(header.numel, 1)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{self.name} keeps no state, got keys {sorted(state)}")

    # ---- to implement -------------------------------------------------------------------
    def _encode(self, tensor: torch.Tensor, name: str) -> tuple[int, bytes, torch.Tensor]:
        """Return (flags, packed codec params, body bytes on the tensor's device)."""
        raise NotImplementedError

    def _check_params(self, header: wire.Header) -> None:
        """Validate the codec parameters of a received header (raise PayloadError)."""
        raise NotImplementedError

    def _decode_body(
        self, header: wire.Header, body: torch.Tensor, out: torch.Tensor, accumulate: bool
    ) -> None:
        """Write (or add) the decoded float32 values into flat ``out``."""
        raise NotImplementedError

    def _max_numel(self, body_len: int) -> int:
        """The most elements a body of this many bytes can describe (guards allocation)."""
        raise NotImplementedError

    # ---- wire format --------------------------------------------------------------------
    def _assemble(self, header: wire.Header, body: torch.Tensor) -> torch.Tensor:
        """Header + body in one tensor; the checksum is one pass over the whole payload."""
        head = header.pack()  # checksum field zero
        size = len(head)
        payload = torch.empty(size + body.numel(), dtype=torch.uint8, device=body.device)
        backend = for_device(body.device)
        if body.device.type == "cpu":
            view = payload.numpy()
            view[:size] = np.frombuffer(head, dtype=np.uint8)
            view[size:] = body.numpy()
            view[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = np.frombuffer(
                backend.checksum(payload, 0).to_bytes(4, "little"), dtype=np.uint8
            )
        else:
            payload[size:].copy_(body)
            payload[:size].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
            csum = backend.checksum(payload, 0).to_bytes(4, "little")
            payload[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4].copy_(
                torch.frombuffer(bytearray(csum), dtype=torch.uint8)
            )
        return payload

    def read_header(self, payload: torch.Tensor) -> tuple[wire.Header, bytes]:
        """Parse the header (one small device-to-host copy); returns it and its raw bytes."""
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise PayloadError(
                "payload",
                f"expected a uint8 tensor, got {getattr(payload, 'dtype', type(payload).__name__)}",
            )
        if payload.dim() != 1:
            raise PayloadError(
                "payload", f"expected a 1-D tensor, got shape {tuple(payload.shape)}"
            )
        # a view on the CPU; one small device-to-host copy on a GPU
        raw = (
            payload.numpy()
            if payload.device.type == "cpu"
            else payload[: wire.MAX_HEADER].cpu().numpy()
        )
        header = wire.parse_header(raw, payload.numel())
        return header, raw[: header.size].tobytes()

    def _decode_checked(
        self,
        payload: torch.Tensor,
        expect: Ctx | None,
        out: torch.Tensor | None,
        accumulate: bool,
    ) -> torch.Tensor:
        header, raw_head = self.read_header(payload)
        if header.codec != self.name:
            raise PayloadError("codec", f"expected {self.name!r}, got {header.codec!r}")
        if expect is not None:
            if header.shape != tuple(expect.shape):
                raise PayloadError("shape", f"expected {tuple(expect.shape)}, got {header.shape}")
            if header.dtype != expect.dtype:
                raise PayloadError("dtype", f"expected {expect.dtype}, got {header.dtype}")
        self._check_params(header)
        if header.nonfinite and header.body_len != 0:
            raise PayloadError(
                "body_len", f"a non-finite payload carries no body, got {header.body_len} bytes"
            )
        if not header.nonfinite and header.numel > self._max_numel(header.body_len):
            raise PayloadError(
                "numel", f"{header.numel} elements cannot come from {header.body_len} body bytes"
            )
        head_len = header.size
        body = payload[head_len:]
        backend = for_device(payload.device)
        field = raw_head[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4]
        csum = wire.checksum_without_field(backend.checksum(payload, 0), field)
        if csum != header.checksum:
            raise PayloadError(
                "checksum",
                f"expected 0x{header.checksum:08x}, computed 0x{csum:08x} (corrupt payload)",
            )
        if out is not None:
            if out.dtype != torch.float32 or out.numel() != header.numel or not out.is_contiguous():
                raise ValueError(
                    f"out must be a contiguous float32 tensor of {header.numel} "
                    f"elements, got {out.dtype} with {out.numel()}"
                )
            if header.nonfinite:
                out.fill_(float("nan"))
            else:
                self._decode_body(header, body, out.view(-1), accumulate)
            return out
        if header.nonfinite:
            return torch.full(header.shape, float("nan"), dtype=header.dtype, device=payload.device)
        flat = torch.empty(header.numel, dtype=torch.float32, device=payload.device)
        self._decode_body(header, body, flat, False)
        return flat.view(header.shape).to(header.dtype)


def as_float32(value: float) -> float:
    """Round a Python float to the nearest float32 (as the wire stores it)."""
    return float(np.float32(value))
