"""A diverged run stops: ``DistributedOptimizer(raise_on_nonfinite=True)`` raises
``NonFiniteGradientError`` on every rank alike, before the inner optimizer steps, and
``scripts/train.py`` ends with an error naming the step and the codec instead of its
success summary. Without the flag a non-finite average is written as it is (GradScaler's
contract), which the rest of the suite checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hvdcompress
from hvdcompress.training.simulate import run_ranks
from tests.test_simulated import HANG_S, within

TRAIN = Path(__file__).parents[1] / "scripts" / "train.py"


def _step(size: int, compression: str, poison_rank: int | None, raise_on_nonfinite=True):
    """One step on ``size`` simulated ranks; rank ``poison_rank``'s gradient of ``b`` gets a
    NaN. Per rank: (the error raised or None, whether the parameters changed)."""

    def rank(t):
        torch.manual_seed(0)
        a = torch.nn.Parameter(torch.randn(300))
        b = torch.nn.Parameter(torch.randn(40))
        before = [a.detach().clone(), b.detach().clone()]
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD([a, b], lr=0.1),
            [("a", a), ("b", b)],
            compression=compression,
            backend=t,
            raise_on_nonfinite=raise_on_nonfinite,
        )
        if t.rank == poison_rank:  # before the post-accumulate hook sends the bucket
            b.register_hook(lambda g: g.index_fill(0, torch.tensor([7]), float("nan")))
        opt.zero_grad()
        loss = (a * (t.rank + 1)).sum() + (b * b).sum()
        loss.backward()
        try:
            opt.step()
            error = None
        except hvdcompress.NonFiniteGradientError as err:
            error = err
        moved = not (torch.equal(a, before[0]) and torch.equal(b, before[1]))
        return error, moved

    return within(HANG_S, lambda: run_ranks(size, rank))


@pytest.mark.parametrize("compression", ["none", "3lc", "topk", "qsgd"])
@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_raises_naming_the_tensor_and_no_rank_steps(compression, size):
    for error, moved in _step(size, compression, poison_rank=size - 1):
        assert isinstance(error, hvdcompress.NonFiniteGradientError)
        assert isinstance(error, FloatingPointError)
        assert error.tensors == ["b"]
        assert "'b'" in str(error) and "did not step" in str(error)
        assert not moved


@pytest.mark.parametrize("compression", ["none", "3lc"])
def test_finite_gradients_step_as_without_the_check(compression):
    checked = _step(3, compression, poison_rank=None)
    assert all(error is None and moved for error, moved in checked)


def test_without_the_flag_the_nonfinite_average_is_written_and_stepped():
    for error, moved in _step(2, "3lc", poison_rank=0, raise_on_nonfinite=False):
        assert error is None and moved


def test_the_flag_must_be_a_bool():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(TypeError, match="raise_on_nonfinite must be a bool"):
        hvdcompress.DistributedOptimizer(
            torch.optim.SGD([p], lr=0.1), [("p", p)], backend="mpi4py", raise_on_nonfinite=1
        )


def test_train_py_stops_a_diverged_run_with_the_step_and_codec():
    cmd = [sys.executable, str(TRAIN), "--simulate-ranks", "2", "--dataset", "synthetic",
           "--synthetic-size", "512", "--batch-size", "32", "--steps", "40", "--no-progress",
           "--compression", "3lc", "--lr", "1e6", "--momentum", "0.9"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "summary:" not in done.stdout
    assert "train: stopped at step " in done.stderr
    assert "compression 3lc" in done.stderr and "are not finite" in done.stderr
