"""hvdcompress: gradient compression for Horovod and MPI data-parallel PyTorch training.

Four concepts, four places: ``codecs`` are pure tensor math, ``compressors`` add
per-tensor state (error feedback), transports move bytes, policies choose
parameters. The wire format every rank and backend shares is in ``wire``.
"""

from hvdcompress import wire
from hvdcompress.compressors import Compressor, Ctx, available, get_compressor
from hvdcompress.wire import PayloadError

__version__ = "0.1.0"

__all__ = ["Compressor", "Ctx", "PayloadError", "available", "get_compressor", "wire"]
