"""What the scripts share: Fashion-MNIST (``data``), the models (``models``), the table
of named compression methods (``methods``), learning-rate schedules (``schedule``) and
the simulated world that plays N ranks in one process (``simulate``).

scripts/train.py, scripts/bench_*.py and their worker processes import it from the
installed package (``pip install -e .``); none of them imports another script. The
distributed side (rank, size, local size, broadcast of parameters, a sum of a few
floats, barrier) is the transport's: ``hvdcompress.transports.make_transport``.
"""

from hvdcompress.training.data import (
    DATA_DIR,
    DatasetNotFound,
    load_fashion_mnist,
    read_fashion_mnist,
    read_idx,
    synthetic,
)
from hvdcompress.training.methods import METHODS, Method, get_method, parse_case
from hvdcompress.training.models import (
    IMAGE_MODELS,
    INPUT_SHAPES,
    MODELS,
    LightMLP,
    SmallCNN,
    SmallResNet,
    build_model,
)
from hvdcompress.training.schedule import LRSchedule
from hvdcompress.training.simulate import run_ranks

__all__ = [
    "DATA_DIR",
    "DatasetNotFound",
    "IMAGE_MODELS",
    "INPUT_SHAPES",
    "METHODS",
    "MODELS",
    "LightMLP",
    "LRSchedule",
    "Method",
    "SmallCNN",
    "SmallResNet",
    "build_model",
    "get_method",
    "load_fashion_mnist",
    "parse_case",
    "read_fashion_mnist",
    "read_idx",
    "run_ranks",
    "synthetic",
]
