"""Helpers shared by the test modules: compressor factories, a Transport of world size 1,
the small seeded model of the optimizer and policy tests, and PowerSGD's step on one
rank. tests/conftest.py wraps the model and the transport in fixtures."""

from __future__ import annotations

import torch

import hvdcompress
from hvdcompress.transports import Handle, Transport


def comp(name: str, **params):
    """A compressor by registry name (``hvdcompress.get_compressor``)."""
    return hvdcompress.get_compressor(name, **params)


def bound(name: str, rank: int, size: int, **params):
    """A compressor bound to ``rank`` of ``size`` ranks, as the optimizer binds it."""
    c = comp(name, **params)
    c.bind(rank, size)
    return c


def assert_error_feedback_invariant(c, n: int, steps: int, seed: int, name: str = "w") -> None:
    """Over ``steps`` seeded gradients of ``n`` values, everything decoded plus the residual
    is everything computed (the error-feedback invariant)."""
    torch.manual_seed(seed)
    total_g, total_dec = torch.zeros(n), torch.zeros(n)
    for _ in range(steps):
        x = torch.randn(n)
        total_g += x
        total_dec += c.decompress(*c.compress(x, name))
    torch.testing.assert_close(total_dec + c.memory.residuals[name], total_g)


def powersgd_one_rank(c, g: torch.Tensor, name: str = "m") -> torch.Tensor:
    """One PowerSGD step in a world of one rank: the summed P is the local P."""
    p, ctx = c.compress(g, name)
    q = c.next_phase(p, ctx, 1)
    return c.decompress(q, ctx)


def small_model(seed: int = 0) -> torch.nn.Module:
    """Linear(10, 20), ReLU, Linear(20, 3), initialised from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3))


class LocalTransport(Transport):
    """World size 1: a gather returns the local bytes, a sum the tensor itself; ``calls``
    counts the collectives started. For optimizer and policy tests in one process."""

    name = "local"
    tunable = False  # no link: exchange="auto" keeps its first guess (exchange.tuning)

    def __init__(self) -> None:
        self.calls = 0

    def _done(self, value) -> Handle:
        self.calls += 1
        h = Handle()
        h._finish(value)
        return h

    def start_allgatherv(self, local, *, key=None):
        return self._done((local.clone(), [local.numel()]))

    def start_allreduce_sum(self, dense):
        return self._done(dense.clone())

    def allgather_object(self, obj):
        return [obj]


def averaged_grads(model, opt, batch, steps: int) -> list[list[torch.Tensor]]:
    """``steps`` steps of ``opt`` (a ``DistributedOptimizer``) on ``batch(step)``'s
    (x, y): each step's averaged gradients, taken after ``synchronize()``."""
    grads = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        grads.append([p.grad.clone() for p in model.parameters()])
        with opt.skip_synchronize():
            opt.step()
    return grads


def needs_netns(skip_reason: str | None):
    """The module mark of a test that needs network namespaces: skipped with
    ``skip_reason`` where they cannot be made, except in CI (``CI`` set: root, iproute2
    from scripts/setup.sh), where every test of the module fails with that reason
    (the fixture ``_ci_must_run_netns`` of tests/conftest.py reads the module's ``_SKIP``)."""
    import os

    import pytest

    if skip_reason is None:
        return []
    if os.environ.get("CI"):
        return pytest.mark.usefixtures("_ci_must_run_netns")
    return pytest.mark.skipif(True, reason=skip_reason)
