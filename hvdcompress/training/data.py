"""Fashion-MNIST from its idx files, and a learnable synthetic stand-in.

The idx files are those of Debian's ``dataset-fashion-mnist`` in
/usr/share/datasets/fashion-mnist (``DATA_DIR``; the environment variable
``HVDC_DATA_DIR`` overrides it): 60,000 training and 10,000 test images of 28x28 uint8
pixels with labels 0-9, gzip-compressed (plain idx files are read too).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch

DATA_DIR = os.environ.get("HVDC_DATA_DIR", "/usr/share/datasets/fashion-mnist")
FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}
MEAN, STD = 0.2860, 0.3530  # of the Fashion-MNIST training pixels, scaled to [0, 1]
CLASSES = 10
_GZIP_MAGIC = b"\x1f\x8b"


class DatasetNotFound(FileNotFoundError):
    """Fashion-MNIST's files are not in the directory; the message says how to get them."""


def read_idx(path: str | Path) -> np.ndarray:
    """An idx file of uint8 values, gzip-compressed or not: big-endian magic 0x00000803
    (images, 3 dimensions) or 0x00000801 (labels, 1 dimension), the dimensions as
    big-endian uint32, then the values. Anything else raises ValueError naming the file."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as err:  # BadGzipFile, truncated stream
            raise ValueError(f"{path}: corrupt gzip data ({err})") from None
    if len(raw) < 4:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an idx header")
    zero, dtype, ndim = struct.unpack_from(">HBB", raw, 0)
    if zero != 0 or dtype != 0x08 or ndim not in (1, 3):
        raise ValueError(f"{path}: not a uint8 idx file (magic {raw[:4].hex()})")
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: header cut short ({len(raw)} bytes for {ndim} dimensions)")
    dims = struct.unpack_from(f">{ndim}I", raw, 4)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} values")
    return data.reshape(dims)


def read_fashion_mnist(data_dir: str | Path = DATA_DIR) -> dict[str, np.ndarray]:
    """The four raw arrays (``FILES`` keys): uint8 images (n, 28, 28) and labels (n,).
    Raises DatasetNotFound when a file is missing, ValueError when one is malformed or
    the images and labels disagree."""
    d = Path(data_dir)
    missing = [name for name in FILES.values() if not (d / name).is_file()]
    if missing:
        raise DatasetNotFound(
            f"Fashion-MNIST not found: {', '.join(missing)} missing in {d}. Install the "
            "Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist), "
            "pass --data-dir, or use --dataset synthetic."
        )
    arrays = {k: read_idx(d / v) for k, v in FILES.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(
                f"{d}: {split} images {x.shape} and labels {y.shape} do not match "
                "(want (n, rows, cols) and (n,))"
            )
        if y.size and int(y.max()) >= CLASSES:
            raise ValueError(f"{d}: {split} label {int(y.max())} is not a class 0-{CLASSES - 1}")
    return arrays


def load_fashion_mnist(data_dir: str | Path = DATA_DIR):
    """((train images, train labels), (test images, test labels)) as tensors: images
    float32 (n, 1, 28, 28) normalised with the training mean and std, labels int64."""
    arrays = read_fashion_mnist(data_dir)
    splits = []
    for split in ("train", "test"):
        x = torch.from_numpy(arrays[f"{split}_x"].astype(np.float32) / 255.0).unsqueeze(1)
        splits.append(((x - MEAN) / STD, torch.from_numpy(arrays[f"{split}_y"].astype(np.int64))))
    return tuple(splits)


def synthetic(n_train: int, n_test: int, seed: int = 1234):
    """Learnable 28x28 data: one random prototype image per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(CLASSES, 1, 28, 28, generator=g)
    y = torch.randint(0, CLASSES, (n_train + n_test,), generator=g)
    x = prototypes[y] + 2.0 * torch.randn(n_train + n_test, 1, 28, 28, generator=g)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
