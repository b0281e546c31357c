"""Helpers shared by the MPI tests: the ManySmall model, per-rank batches with learnable
labels, training steps, bit-level digests, DistributedOptimizer over mpi4py, and
checkpoint-resume runs.

Deadlock rule of every MPI test: a rank that fails before a collective would leave the
others waiting in it forever, so every rank runs the same collectives and per-rank
failures are gathered and reported after the last one.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util

import pytest
import torch

import hvdcompress

# the mark of a test that needs horovod.torch (the hvd fixture of conftest.py)
NEEDS_HOROVOD = pytest.mark.skipif(
    importlib.util.find_spec("horovod") is None, reason="horovod is not installed"
)


class ManySmall(torch.nn.Module):
    """Several layers of different shapes (some tiny) so buckets hold several tensors."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(4 * 6 * 6 if i == 0 else width, width) for i in range(depth)]
        )
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def make_model(seed: int = 0, **kw) -> ManySmall:
    torch.manual_seed(seed)
    return ManySmall(**kw)


_TEACHER = torch.randn(64, 3, generator=torch.Generator().manual_seed(7))


def batch(rank: int, step: int, n: int = 16):
    """Per-rank, per-step inputs with learnable labels (a fixed linear teacher)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return x, (x.flatten(1) @ _TEACHER).argmax(1)


def digest(tensors) -> str:
    """Bit-level identity of a sequence of tensors: dtypes, shapes and raw bytes."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(model, opt, rank: int, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def wrap(model, compression, *, backend="mpi4py", momentum=0.9, tuning=None, **kw):
    """SGD (lr 0.1) wrapped in hvdcompress.DistributedOptimizer; ``exchange="auto"``
    keeps its first guess unless given a ``tuning`` (tests/mpi/test_tuning.py), so that
    the numerics and resumes these tests check do not depend on timings."""
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
        model.named_parameters(),
        compression=compression,
        backend=backend,
        tuning=tuning,
        **kw,
    )


def resume_run(rank, make_compression, split, steps, *, momentum=0.9, load_compressor=True):
    """Train ``steps`` steps. With ``split``: after ``split`` steps save a checkpoint, load
    it into a differently initialised model and a new optimizer (the compressor state left
    out unless ``load_compressor``), and train the rest. ``make_compression()`` gives each
    optimizer its compression."""
    model = make_model()
    opt = wrap(model, make_compression(), momentum=momentum)
    if split is None:
        train(model, opt, rank, steps)
        return model, opt
    train(model, opt, rank, split)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    del model, opt
    model = make_model(seed=123)  # different init: everything must come from the checkpoint
    opt = wrap(model, make_compression(), momentum=momentum)
    model.load_state_dict(saved["model"])
    if not load_compressor:
        saved["opt"].pop("hvdcompress")
    opt.load_state_dict(saved["opt"])
    train(model, opt, rank, steps - split, start=split)
    return model, opt
