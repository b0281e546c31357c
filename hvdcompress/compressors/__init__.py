"""Compressors by name: ``get_compressor("3lc", sparsity=1.75)``."""

from __future__ import annotations

import inspect

from hvdcompress.compressors.base import Compressor, Ctx
from hvdcompress.compressors.cast import BF16, FP16, NoCompression
from hvdcompress.compressors.dgc import DGC
from hvdcompress.compressors.dqsg import DQSG
from hvdcompress.compressors.ndqsg import NDQSG
from hvdcompress.compressors.powersgd import PowerSGD
from hvdcompress.compressors.quant import QSGD, TernGrad
from hvdcompress.compressors.sign import EFSignSGD, SignSGD
from hvdcompress.compressors.sparse import GSpar, RandomK, TopK, TopKSign
from hvdcompress.compressors.threelc import ThreeLC

REGISTRY: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (NoCompression, FP16, BF16, ThreeLC)
}
# Gather-only baselines (shared/SPEC.md sections 3 and 4).
REGISTRY.update(
    {cls.name: cls for cls in (TopK, RandomK, QSGD, TernGrad, SignSGD, EFSignSGD, DQSG)}
)
# NDQSG (section 3), DGC (gather-only) and PowerSGD (summable, two allreduces) (section 4).
REGISTRY.update({cls.name: cls for cls in (NDQSG, DGC, PowerSGD)})
# The compressors CAT tunes besides top-k (section 6).
REGISTRY.update({cls.name: cls for cls in (TopKSign, GSpar)})


def _signature(cls: type[Compressor]) -> str:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return ", ".join(f"{p.name}={p.default!r}" for p in params)


def available() -> str:
    """One line per compressor: its name and parameters with defaults."""
    return "\n".join(f"  {name}({_signature(cls)})" for name, cls in sorted(REGISTRY.items()))


def get_compressor(name: str, **params) -> Compressor:
    """A new compressor (own state) by name; a wrong name or parameter lists the valid ones."""
    cls = REGISTRY.get(name.lower())
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; available:\n{available()}")
    try:
        inspect.signature(cls.__init__).bind(None, **params)
    except TypeError:
        raise TypeError(
            f"compressor {name!r} takes ({_signature(cls)}), got {sorted(params)}"
        ) from None
    return cls(**params)


__all__ = [
    "Compressor",
    "Ctx",
    "ThreeLC",
    "TopK",
    "RandomK",
    "TopKSign",
    "GSpar",
    "QSGD",
    "TernGrad",
    "SignSGD",
    "EFSignSGD",
    "DQSG",
    "NDQSG",
    "DGC",
    "PowerSGD",
    "REGISTRY",
    "available",
    "get_compressor",
]
