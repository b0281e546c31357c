"""Compressors by name: ``get_compressor("3lc", sparsity=1.75)``.

Every module of this package is imported here, and each compressor class registers
itself (``@register``, hvdcompress.compressors.registry): adding a compressor is adding a module.
"""

from __future__ import annotations

import importlib
import pkgutil

from hvdcompress.compressors.base import (
    Compressor,
    Ctx,
    Encoded,
    GatherCompressor,
    SummableCompressor,
)
from hvdcompress.compressors.registry import REGISTRY, available, get_compressor
from hvdcompress.compressors.spec import CompressorSpec

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "Compressor",
    "CompressorSpec",
    "Ctx",
    "Encoded",
    "GatherCompressor",
    "SummableCompressor",
    "REGISTRY",
    "available",
    "get_compressor",
]
