"""Summable compressors: send the gradient as is (``none``) or cast to 16 bits.

A cast commutes with summation up to rounding, so these payloads ride an allreduce
(docs/design.md, "Concepts and where they live") instead of the allgather the byte-coded codecs
need. The payload is a dense tensor, not the byte wire format: an allreduce cannot sum
headers. Values beyond float16's range become Inf, which GradScaler then sees.
"""

from __future__ import annotations

import math

import torch

from hvdcompress.compressors.base import Ctx, SummableCompressor
from hvdcompress.compressors.registry import register
from hvdcompress.compressors.spec import CompressorSpec


class Cast(SummableCompressor):
    """Cast to ``wire_dtype`` for the allreduce and back to the gradient's dtype after."""

    wire_dtype: torch.dtype | None = None  # None: keep the gradient's own dtype

    def __init__(self) -> None:
        pass

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Ctx]:
        ctx = Ctx(name, tuple(tensor.shape), tensor.dtype, tensor.device)
        wire = self.wire_dtype or tensor.dtype
        return tensor.detach().reshape(-1).to(wire), ctx

    def decompress(self, payload: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        if payload.numel() != math.prod(ctx.shape):
            raise ValueError(
                f"{self.name}: tensor {ctx.name!r} expects {math.prod(ctx.shape)} "
                f"values, got {payload.numel()}"
            )
        return payload.view(ctx.shape).to(ctx.dtype)


@register(CompressorSpec(name="none"))
class NoCompression(Cast):
    """The gradient as it is."""


@register(CompressorSpec(name="fp16"))
class FP16(Cast):
    wire_dtype = torch.float16


@register(CompressorSpec(name="bf16"))
class BF16(Cast):
    wire_dtype = torch.bfloat16
