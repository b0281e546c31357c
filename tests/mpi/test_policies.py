"""Policies across real MPI ranks (4 ranks in CI): every rank decides the same level per
tensor (Accordion) and the same budget (CAT) although the local gradients differ.

    mpirun -np 4 --oversubscribe python -m pytest --with-mpi tests/mpi/test_policies.py -q
"""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.policies import CAT, Accordion, AffineCost
from tests.mpi.helpers import digest

pytestmark = pytest.mark.mpi(min_size=2)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
    )


def _step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    # Rank-dependent, step-dependent scale: local norm changes differ between ranks, so
    # decisions taken from local norms alone would differ.
    scale = 1.0 + 4.0 * rank * (step % 2)
    x = torch.randn(8, 12, generator=g) * scale
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize(
    "compression, low, high", [("3lc", 1.0, 1.9), ("topk", 0.5, 0.05), ("powersgd", 2, 1)]
)
def test_accordion_decisions_identical_on_every_rank(compression, low, high, comm):
    rank = comm.rank
    model = _model()
    pol = Accordion(low=low, high=high, eta=0.3, interval_steps=1)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        compression=compression,
        backend="mpi4py",
        policy=pol,
    )
    failures, records = [], []
    for step in range(6):
        try:
            _step(model, opt, rank, step)
        except Exception as err:  # noqa: BLE001 - gathered below, after the collectives
            failures.append(f"step {step}: {err!r}")
            break
        local_sums_were_used = dict(pol.current)
        records.append((local_sums_were_used, digest(p.grad for p in model.parameters())))
    everyone = comm.allgather((failures, records, [h["levels"] for h in pol.history]))
    assert all(not f for f, _, _ in everyone), [f for f, _, _ in everyone]
    assert all(e[1] == everyone[0][1] for e in everyone), "levels or gradients differ"
    assert all(e[2] == everyone[0][2] for e in everyone)
    seen = {v for levels in everyone[0][2] for v in levels.values()}
    assert seen == {low, high}, seen  # the run exercised both levels


@pytest.mark.parametrize(
    ("kind", "compression", "refresh"),
    [("topk", "topk", False), ("topk+q", "topkq", True), ("randomk", "gspar", True)],
)
def test_cat_budgets_identical_on_every_rank(kind, compression, refresh, comm):
    rank = comm.rank
    model = _model()
    pol = CAT(kind, cost_model=AffineCost(1e-5, 1e-9), recompute_every=2, refresh=refresh)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model.named_parameters(),
        compression=compression,
        backend="mpi4py",
        fusion_threshold=0,  # a collective per tensor: several sizes to refit from
        policy=pol,
    )
    budgets, failures = [], []
    for step in range(5):
        try:
            _step(model, opt, rank, step)
        except Exception as err:  # noqa: BLE001
            failures.append(f"step {step}: {err!r}")
            break
        # with refresh every rank refits the same pooled timings: the same model
        budgets.append(
            (
                dict(pol.budgets),
                digest(p.grad for p in model.parameters()),
                (pol.cost.c0, pol.cost.c1),
            )
        )
    everyone = comm.allgather((failures, budgets))
    assert all(not f for f, _ in everyone), [f for f, _ in everyone]
    assert all(b == everyone[0][1] for _, b in everyone)
    assert everyone[0][1][0][0], "no budget was chosen"
    if refresh:
        assert everyone[0][1][-1][2] != (1e-5, 1e-9), "the cost model was not refitted"
