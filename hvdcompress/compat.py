"""``hvdcompress.Compression``: Horovod-style compression classes.

Horovod's optimizer calls ``compression.compress(tensor) -> (tensor, ctx)`` and
``compression.decompress(tensor, ctx)`` around an allreduce, so only summable codecs fit
it. ``Compression.none / fp16 / bf16`` follow that protocol and therefore work in stock
``hvd.DistributedOptimizer`` as well as in ``hvdcompress.DistributedOptimizer``.
``Compression.threelc(sparsity=...)`` is gather-only: ``hvdcompress.DistributedOptimizer``
accepts it (through ``make_compressor``), and the stock Horovod optimizer gets a
``TypeError`` from ``compress`` that says what to use instead.
"""

from __future__ import annotations

import torch

from hvdcompress.compressors import Compressor, get_compressor


class _CastCompression:
    """Horovod's Compressor protocol for a dtype cast (static methods, used as a class)."""

    name = "none"
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


def _entry(name: str, attribute: str):
    def make(**params) -> GatherOnlyCompression:
        return GatherOnlyCompression(name, attribute, **params)

    make.__name__ = attribute
    make.__doc__ = f"``{name}``, with the parameters of ``get_compressor({name!r}, ...)``."
    return staticmethod(make)


class Compression:
    """Namespace like ``hvd.Compression``: ``none``, ``fp16``, ``bf16`` (summable, also for
    ``hvd.DistributedOptimizer``), and ``threelc(sparsity=...)``, ``topk(ratio=...)`` and
    the other codecs for ``hvdcompress.DistributedOptimizer``."""

    none = NoneCompression
    fp16 = FP16Compression
    bf16 = BF16Compression

    threelc = _entry("3lc", "threelc")
    dqsg = _entry("dqsg", "dqsg")
    ndqsg = _entry("ndqsg", "ndqsg")
    topk = _entry("topk", "topk")
    randomk = _entry("randomk", "randomk")
    topkq = _entry("topkq", "topkq")
    gspar = _entry("gspar", "gspar")
    dgc = _entry("dgc", "dgc")
    qsgd = _entry("qsgd", "qsgd")
    terngrad = _entry("terngrad", "terngrad")
    signsgd = _entry("signsgd", "signsgd")
    efsignsgd = _entry("efsignsgd", "efsignsgd")
    powersgd = _entry("powersgd", "powersgd")
