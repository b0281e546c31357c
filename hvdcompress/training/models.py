"""The models the scripts train and benchmark.

``MODELS``: name -> class, each built as ``MODELS[name](width)`` (or with its default
width); ``INPUT_SHAPES``: the shape of one example. ``IMAGE_MODELS`` are the Fashion-MNIST
classifiers (1x28x28 -> 10 classes: scripts/train.py ``--model``); ``light`` is the MLP
of scripts/bench_network.py (little compute per parameter, on random features).

``width`` is each model's one size knob, and 16 (train.py's default ``--width``) is its
reference size: the CNN's first channels, the ViT's embedding / 8 (128), the wide MLP's
hidden layers / 128 (2048).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SmallCNN(torch.nn.Module):
    """Two 3x3 convolutions with max-pooling, two linear layers (206,922 parameters at
    width 16)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = torch.nn.Linear(2 * width * 7 * 7, 8 * width)
        self.fc2 = torch.nn.Linear(8 * width, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class BasicBlock(torch.nn.Module):
    """ResNet basic block with GroupNorm (no running buffers to drift apart across ranks)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = torch.nn.GroupNorm(4, cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = torch.nn.GroupNorm(4, cout)
        self.skip = (
            torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False))
            if stride != 1 or cin != cout
            else torch.nn.Identity()
        )

    def forward(self, x):
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.skip(x))


class SmallResNet(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.blocks = torch.nn.Sequential(
            BasicBlock(width, width, 1),
            BasicBlock(width, 2 * width, 2),
            BasicBlock(2 * width, 4 * width, 2),
        )
        self.fc = torch.nn.Linear(4 * width, 10)

    def forward(self, x):
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class LightMLP(torch.nn.Sequential):
    """1024 features -> ``width`` -> ``width`` -> 10, ReLU between (2.1 M parameters at the
    default width 1024; tensors named 0.weight, 0.bias, 2.weight, ...)."""

    def __init__(self, width: int = 1024, features: int = 1024, classes: int = 10) -> None:
        super().__init__(
            torch.nn.Linear(features, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, classes),
        )


class WideMLP(torch.nn.Sequential):
    """784 -> 3 hidden layers of ``128 * width`` -> 10, ReLU between: at width 16,
    784-2048-2048-2048-10, 10.0 M parameters, the peer benchmark's ``mlp10m`` (little
    compute per byte of gradient: the model that needs compression most)."""

    def __init__(self, width: int = 16) -> None:
        hidden = 128 * width
        super().__init__(
            torch.nn.Flatten(),
            torch.nn.Linear(784, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )


class SmallViT(torch.nn.Module):
    """A vision transformer (Dosovitskiy et al., ICLR 2021) for 28x28 images: 7x7 patches
    (16 tokens and a class token), embedding ``8 * width``, 4 pre-norm encoder layers of
    4 heads with an MLP of twice the embedding, GELU, no dropout; the class token's
    output classifies. At width 16: embedding 128, 0.54 M parameters, the attention
    (``in_proj_weight`` 384x128) and MLP matrices are the low-rank methods' case.
    LayerNorm only: no running buffers to drift apart across ranks."""

    patch = 7

    def __init__(self, width: int = 16, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        dim = 8 * width
        tokens = (28 // self.patch) ** 2
        self.embed = torch.nn.Conv2d(1, dim, self.patch, stride=self.patch)
        self.cls = torch.nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = torch.nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(
            dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
            norm_first=True,
        )  # fmt: skip
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, 10)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)  # (batch, tokens, dim)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x)[:, 0]))


MODELS: dict[str, type[torch.nn.Module]] = {
    "cnn": SmallCNN,
    "resnet": SmallResNet,
    "vit": SmallViT,
    "mlp10m": WideMLP,
    "light": LightMLP,
}
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "cnn": (1, 28, 28),
    "resnet": (1, 28, 28),
    "vit": (1, 28, 28),
    "mlp10m": (1, 28, 28),
    "light": (1024,),
}
IMAGE_MODELS = tuple(name for name, shape in INPUT_SHAPES.items() if shape == (1, 28, 28))


def build_model(name: str, width: int | None = None) -> torch.nn.Module:
    """``MODELS[name]`` at ``width`` (None: the model's default width)."""
    try:
        cls = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}") from None
    return cls() if width is None else cls(width)
