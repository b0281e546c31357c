"""Codec backends: the same tensor math on the CPU (C, via ctypes) and on CUDA (CuPy RawKernels).

Both backends implement ``hvdcompress.backends.protocol.Backend`` (every operation, with its
signature and contract) and must produce identical bytes for identical input
(docs/backends.md). ``for_device`` picks one by the tensor's device; the codecs in
``hvdcompress.codecs`` never branch on the device themselves. ``backends.cpu`` and
``backends.cuda`` are packages with a module per codec family; what they return and the
layout facts their kernels compile in are in ``backends.records``.
"""

from __future__ import annotations

import torch

from hvdcompress.backends.records import FrameScan, ThreeLCEncoded

__all__ = ["FrameScan", "ThreeLCEncoded", "for_device"]


_BACKENDS: dict[str, object] = {}


def for_device(device: torch.device):
    """Return the backend module for ``device`` (``cpu`` or ``cuda``)."""
    backend = _BACKENDS.get(device.type)
    if backend is not None:
        return backend
    if device.type == "cpu":
        from hvdcompress.backends import cpu as backend
    elif device.type == "cuda":
        from hvdcompress.backends import cuda as backend
    else:
        raise TypeError(f"hvdcompress has no backend for device type {device.type!r}")
    _BACKENDS[device.type] = backend
    return backend
