"""hvdcompress: gradient compression for Horovod and MPI data-parallel PyTorch training.

Four concepts, four places: ``codecs`` are pure tensor math, ``compressors`` add
per-tensor state (error feedback), transports move bytes, policies choose
parameters. The wire format every rank and backend shares is in ``wire``.
"""

from hvdcompress import checkpoint, wire
from hvdcompress.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hvdcompress.compression import Compression
from hvdcompress.compressors import Compressor, Ctx, available, get_compressor
from hvdcompress.ddp import DDPHookState, ddp_hook
from hvdcompress.errors import PayloadError, payload_error
from hvdcompress.exchange.tuning import Tuning
from hvdcompress.optimizer import (
    Adasum,
    Average,
    DistributedOptimizer,
    NonFiniteGradientError,
    RankAgreementError,
    Sum,
)
from hvdcompress.optimizer.hooked import hooked_optimizer
from hvdcompress.policies import CAT, Accordion
from hvdcompress.transports.cost import AffineCost, LinkCost, PacketCost, calibrate, calibrate_link

__version__ = "0.1.0"

__all__ = [
    "Tuning",
    "CAT",
    "Accordion",
    "Adasum",
    "AffineCost",
    "PacketCost",
    "calibrate",
    "calibrate_link",
    "LinkCost",
    "Average",
    "CheckpointError",
    "Compression",
    "Compressor",
    "DDPHookState",
    "Ctx",
    "DistributedOptimizer",
    "NonFiniteGradientError",
    "PayloadError",
    "payload_error",
    "RankAgreementError",
    "Sum",
    "available",
    "checkpoint",
    "ddp_hook",
    "get_compressor",
    "hooked_optimizer",
    "load_checkpoint",
    "save_checkpoint",
    "wire",
]
