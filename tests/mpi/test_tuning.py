"""``exchange="auto"`` tunes the optimizer's buckets under real Open MPI, on the mpi4py
and Horovod transports (docs/exchanges.md, "Measured while training"):

    mpirun -np 3 --oversubscribe python -m pytest --with-mpi tests/mpi/test_tuning.py -q

* 3LC whose encode costs 60 ms more than it does (a codec that costs more than it saves)
  ends on a dense allreduce (float32 or bf16) on every bucket, every rank with the same
  decisions and options at every step and bit-identical parameters;
* the options each bucket took are in ``last_stats.exchanges`` and the trial steps in
  ``last_stats.tuning``; ``tuning=None`` keeps the first guess for good;
* the 16-bit option held in force (bf16, fp16): the ranks' average within its rounding,
  two bytes a value, bit-identical parameters on every rank, and a resume from a
  checkpoint taken with it in force equal to the uninterrupted run.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import hvdcompress
from tests.mpi.helpers import digest, make_model, train, wrap
from tests.torchrun.tuning_worker import slowed

pytestmark = pytest.mark.mpi(min_size=2)

TUNING = hvdcompress.Tuning(warmup_steps=2, steps_per_option=2, recheck_every=0)
BACKENDS = [
    "mpi4py",
    pytest.param(
        "horovod",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("horovod") is None, reason="horovod is not installed"
        ),
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_codec_that_costs_more_than_it_saves_ends_dense_on_every_rank(backend, comm):
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()
    model = make_model()
    compressor = slowed(hvdcompress.get_compressor("3lc"), 0.06)
    opt = wrap(model, compressor, backend=backend, tuning=TUNING)
    options, trials = [], []
    for step in range(14):
        train(model, opt, comm.rank, 1, start=step)
        options.append(sorted(opt.last_stats.exchanges.items()))
        trials.append(opt.last_stats.tuning)
    tuner = opt.exchange_tuner
    mine = ([str(d) for d in tuner.decisions], options, trials, digest(model.parameters()))
    everyone = comm.allgather(mine)
    assert all(theirs == everyone[0] for theirs in everyone)
    # dense: float32 or the 16-bit allreduce, whichever the round timed faster
    (kept,) = set(tuner.current.values())
    assert kept in ("dense", "bf16"), tuner.decisions
    assert {o for _, o in options[-1]} == {kept} and not any(trials[10:])
    assert trials[:2] == [False, False] and any(trials)


def test_tuning_none_keeps_the_first_guess(comm):
    model = make_model()
    opt = wrap(model, slowed(hvdcompress.get_compressor("3lc"), 0.06), tuning=None)
    train(model, opt, comm.rank, 8)
    assert opt.exchange_tuner is None
    assert "dense" not in {o for o in opt.last_stats.exchanges.values()}


def _held(backend: str, half: str, seed: int = 0):
    """A model and its optimizer with every bucket held on ``half`` (no round ever
    starts), as a round that timed it fastest leaves it."""
    model = make_model(seed)
    opt = wrap(model, "3lc", backend=backend,
               tuning=hvdcompress.Tuning(warmup_steps=10**6, half=half))  # fmt: skip
    tuner = opt.exchange_tuner
    for key in tuner.current:
        tuner.current[key] = half
    return model, opt


@pytest.mark.parametrize("half", ["bf16", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_16_bit_option_in_force_sums_counts_and_resumes(backend, half, comm):
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()
    numel = sum(p.numel() for p in make_model().parameters())
    dense = make_model()
    dense_opt = wrap(dense, "none", backend=backend)
    train(dense, dense_opt, comm.rank, 1)
    model, opt = _held(backend, half)
    train(model, opt, comm.rank, 1)
    assert set(opt.last_stats.exchanges.values()) == {half}
    assert opt.last_stats.payload_bytes == 2 * numel and opt.last_stats.sent_bytes > 0
    for ours, exact in zip(model.parameters(), dense.parameters(), strict=True):
        assert torch.allclose(ours, exact, atol=2e-3), (ours - exact).abs().max()
    train(model, opt, comm.rank, 5, start=1)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, comm.rank, 4, start=6)
    resumed, resumed_opt = _held(backend, half, seed=123)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    train(resumed, resumed_opt, comm.rank, 4, start=6)
    mine = (digest(model.parameters()), digest(resumed.parameters()))
    everyone = comm.allgather(mine)
    assert all(theirs == everyone[0] for theirs in everyone)  # the same on every rank
    assert mine[0] == mine[1]  # the resume is the uninterrupted run
