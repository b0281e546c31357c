"""``hvdcompress.Compression``: Horovod-style compression classes.

Horovod's optimizer calls ``compression.compress(tensor) -> (tensor, ctx)`` and
``compression.decompress(tensor, ctx)`` around an allreduce, so only summable codecs fit
it (``Compression.none / fp16 / bf16``). Every other entry is for
``hvdcompress.DistributedOptimizer`` (through ``make_compressor``); in the stock Horovod
optimizer its ``compress`` raises a ``TypeError`` that says what to use instead.
"""

from __future__ import annotations

import torch

from hvdcompress.compressors import Compressor, get_compressor, registry


class _CastCompression:
    """Horovod's Compressor protocol for a dtype cast (static methods, used as a class)."""

    wire_dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        if cls.wire_dtype is None or not tensor.is_floating_point():
            return tensor, tensor.dtype
        return tensor.to(cls.wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.to(ctx)

    @classmethod
    def make_compressor(cls) -> Compressor:
        return get_compressor(cls.name)


class NoneCompression(_CastCompression):
    name = "none"


class FP16Compression(_CastCompression):
    name = "fp16"
    wire_dtype = torch.float16


class BF16Compression(_CastCompression):
    """bfloat16 on the wire. Horovod 0.28.1 cannot allreduce bfloat16 CPU tensors (its MPI
    and Gloo ops lack the type), so stock hvd.DistributedOptimizer gets a TypeError for
    CPU gradients; hvdcompress.DistributedOptimizer sums them (mpi4py: a float32-accumulating
    MPI op; horovod backend: an allgather summed in rank order)."""

    name = "bf16"
    wire_dtype = torch.bfloat16

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        if tensor.is_floating_point() and not tensor.is_cuda:
            raise TypeError(
                "Compression.bf16: Horovod 0.28.1 cannot allreduce bfloat16 CPU tensors; use "
                "hvdcompress.DistributedOptimizer(..., compression=Compression.bf16) or "
                "Compression.fp16 with hvd.DistributedOptimizer"
            )
        return super().compress(tensor)


class GatherOnlyCompression:
    """A codec that only ``hvdcompress.DistributedOptimizer`` can run: the gather-only ones
    (3LC, top-k, ...) and PowerSGD, whose two allreduces (P, then Q) need its hooks."""

    def __init__(self, name: str, attribute: str, **params) -> None:
        self.name = name
        self.attribute = attribute  # its name in Compression, for messages
        self.params = params
        get_compressor(name, **params)  # validate the parameters now, not in backward

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Compression.{self.attribute}({args})"

    def make_compressor(self) -> Compressor:
        return get_compressor(self.name, **self.params)

    def compress(self, tensor):
        raise TypeError(
            f"{self!r} cannot run in hvd.DistributedOptimizer: its payloads are not summed by "
            "one allreduce (gather-only, or PowerSGD's two phases). Use "
            f"hvdcompress.DistributedOptimizer(optimizer, model.named_parameters(), "
            f"compression={self!r}, backend='horovod' or 'mpi4py') instead."
        )

    def decompress(self, tensor, ctx):
        self.compress(tensor)


class _CompressionNamespace(type):
    """Looks ``Compression.<attribute>`` up in the compressor registry, so that every
    registered compressor has an entry without being listed here."""

    def __getattr__(cls, attribute: str):
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        found = registry.by_attribute(attribute)
        if found is None:
            raise AttributeError(
                f"Compression has no {attribute!r}; available: {', '.join(dir(cls))}"
            )

        def make(**params) -> GatherOnlyCompression:
            return GatherOnlyCompression(found.name, attribute, **params)

        make.__name__ = attribute
        make.__doc__ = (
            f"``{found.name}``, with the parameters of ``get_compressor({found.name!r}, ...)``."
        )
        return make

    def __dir__(cls):
        own = [n for n in vars(cls) if not n.startswith("_")]
        return sorted(set(own) | {c.spec.compression_attribute for c in registry.REGISTRY.values()})


class Compression(metaclass=_CompressionNamespace):
    """Namespace like ``hvd.Compression``: ``none``, ``fp16``, ``bf16`` (summable, also for
    ``hvd.DistributedOptimizer``), and ``threelc(sparsity=...)``, ``topk(ratio=...)`` and
    every other registered compressor for ``hvdcompress.DistributedOptimizer``."""

    none = NoneCompression
    fp16 = FP16Compression
    bf16 = BF16Compression


def resolve_compressor(compression) -> Compressor:
    """A Compressor from a name, a Compressor, an ``hvdcompress.Compression`` entry, or
    Horovod's own ``hvd.Compression.none`` / ``fp16``."""
    if compression is None:
        return get_compressor("none")
    if isinstance(compression, str):
        return get_compressor(compression)
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, GatherOnlyCompression) or (
        isinstance(compression, type) and issubclass(compression, _CastCompression)
    ):
        return compression.make_compressor()
    horovod_names = {"NoneCompressor": "none", "FP16Compressor": "fp16"}
    cls_name = (compression if isinstance(compression, type) else type(compression)).__name__
    if cls_name in horovod_names:
        return get_compressor(horovod_names[cls_name])
    raise TypeError(
        f"compression={compression!r} is not a compressor: pass a name ('3lc'), "
        "hvdcompress.get_compressor(...) or hvdcompress.Compression.<name>"
    )
