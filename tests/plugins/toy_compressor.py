"""A pure-torch gather-only compressor registered from outside the package: the proof
that registration alone makes a compressor part of the project (tests/test_registry.py
loads this module into pytest, bench_codec and MPI runs with ``-p`` / an import, and
checks that the fuzz tests, the MPI bit-identity test and bench_codec pick it up).

``toyint8``: per-tensor max-abs scaling to int8 (round to nearest even), one byte per
value plus a float32 scale. Wire id 255 is kept for tests and never given to a real
codec.
"""

from __future__ import annotations

import struct

import torch

from hvdcompress import wire
from hvdcompress.compressors.base import Encoded, GatherCompressor, check_scale, empty_body
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec
from hvdcompress.wire import PayloadError

PARAMS = struct.Struct("<f")  # scale


@register(CompressorSpec(name="toyint8", wire_id=255))
class ToyInt8(GatherCompressor):
    def __init__(self) -> None:
        pass

    def __repr__(self) -> str:
        return "ToyInt8()"

    def encode(self, tensor, name):
        x = tensor.detach().reshape(-1).to(torch.float32)
        if not bool(torch.isfinite(x).all()):
            return Encoded(wire.FLAG_NONFINITE, PARAMS.pack(0.0), empty_body(x.device))
        top = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
        scale = top / 127.0
        if float(scale) == 0.0 or not bool(torch.isfinite(x / scale).all()):
            scale = torch.zeros((), device=x.device)
            q = torch.zeros_like(x)
        else:
            q = torch.round(x / scale).clamp_(-127, 127)
        return Encoded(0, PARAMS.pack(float(scale)), q.to(torch.int8).view(torch.uint8))

    def check_params(self, header, name):
        if len(header.params) != PARAMS.size:
            raise PayloadError("params_len", f"toyint8 has 4 bytes, got {len(header.params)}")
        check_scale(header, PARAMS.unpack(header.params)[0])

    def max_numel(self, body_len, name):
        return body_len

    def decode_into(self, header, body, out, accumulate, side_info):
        if body.numel() != header.numel:
            raise PayloadError("body", f"{header.numel} values need {header.numel} bytes")
        (scale,) = PARAMS.unpack(header.params)
        values = body.view(torch.int8).to(torch.float32) * scale
        if accumulate:
            out += values
        else:
            out.copy_(values)
