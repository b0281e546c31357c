"""The simulated world reproduces the real run: scripts/train.py trained on N real ranks
(mpi4py, this mpirun's world) and on N simulated ranks (``--simulate-ranks N``, threads of
rank 0's process) with the same seed ends with the same parameter digest, bit for bit,
for 3LC, top-k, DQSG, NDQSG and Accordion over 3LC (the gather path: every rank decodes
the same bytes in the same order, so the equality holds at any world size).

A few steps of a narrow CNN on synthetic data, under a step schedule whose milestone falls
inside the run (so the rate drop is part of what must match), at whatever size mpirun
gives (2 and 4 in CI).
"""

from __future__ import annotations

import importlib.util
import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COMMON = [
    "--dataset", "synthetic", "--synthetic-size", "512", "--width", "2", "--batch-size", "8",
    "--epochs", "2", "--steps", "5", "--lr-schedule", "step", "--milestones", "0.5",
    "--threads", "1", "--no-progress", "--seed", "7",
]  # fmt: skip

METHODS = {
    "3lc": ["--compression", "3lc"],
    "topk": ["--compression", "topk", "--compression-param", "ratio=0.05"],
    "dqsg": ["--compression", "dqsg"],
    "ndqsg": ["--compression", "ndqsg"],
    "accordion-3lc": [
        "--compression", "3lc", "--accordion", "1.0", "1.75", "--accordion-interval", "2",
    ],
}  # fmt: skip


def _train_module():
    spec = importlib.util.spec_from_file_location(
        "_script_train_sim", ROOT / "scripts" / "train.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi
@pytest.mark.parametrize("method", sorted(METHODS))
def test_simulated_run_ends_with_the_real_runs_digest(method, comm):
    train = _train_module()
    argv = [*COMMON, *METHODS[method], "--backend", "mpi4py"]
    size = comm.Get_size()
    # Deadlock rule (tests/mpi/helpers.py): every rank reaches the same collectives; per
    # rank failures are gathered and reported after the last one.
    real = error = None
    try:
        with redirect_stdout(io.StringIO()):
            real = train.train_rank(train.parse_args(argv), train.make_transport("mpi4py"))
    except Exception as err:  # noqa: BLE001 - reported after the collective below
        error = f"real run: {err!r}"
    simulated = None
    if comm.Get_rank() == 0 and error is None:
        try:
            args = train.parse_args([*argv, "--simulate-ranks", str(size)])
            with redirect_stdout(io.StringIO()):
                simulated = train.run_ranks(
                    size, lambda dist: train.train_rank(args, dist, train.load_data(args))
                )
        except Exception as err:  # noqa: BLE001 - reported after the collective below
            error = f"simulated run: {err!r}"
    everyone = comm.allgather((real, simulated, error))
    errors = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(everyone) if e]
    assert not errors, errors
    reals = [d for d, _, _ in everyone]
    assert len(set(reals)) == 1, f"the real ranks disagree: {reals}"
    assert everyone[0][1] == reals, (
        f"{method} at {size} ranks: simulated {everyone[0][1]}, real (mpi4py) {reals}"
    )
