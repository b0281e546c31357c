"""The simulated world (hvdcompress.transports.simulated, hvdcompress.training.simulate):
its collectives' results and numerics, failures that end instead of hanging, and every
registered compressor and both policies trained through it with the real optimizer.
(Equality with real mpirun runs: tests/mpi/test_simulated_digest.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

import hvdcompress
from hvdcompress.compressors.registry import examples, names
from hvdcompress.training.simulate import (
    RankMismatch,
    SimulatedAbort,
    SimulatedWorld,
    run_ranks,
    seeded,
)
from hvdcompress.transports.simulated import sum_in_rank_order
from tests.mpi.helpers import batch, digest, make_model

HANG_S = 60.0


def within(seconds: float, fn):
    """fn() in a thread; fails the test (instead of hanging it) if it takes longer."""
    box: dict = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below
            box["error"] = err

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"did not finish within {seconds} s (a rank waits forever)"
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---- collectives ---------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_allgatherv_concatenates_in_rank_order_with_sizes(size):
    def rank(t):
        mine = torch.full((t.rank + 1,), 10 + t.rank, dtype=torch.uint8)
        return t.start_allgatherv(mine).wait()

    results = within(HANG_S, lambda: run_ranks(size, rank))
    expected = torch.cat([torch.full((r + 1,), 10 + r, dtype=torch.uint8) for r in range(size)])
    for gathered, sizes in results:
        assert torch.equal(gathered, expected)
        assert sizes == [r + 1 for r in range(size)]
    if size > 1:  # every rank owns its copy
        results[0][0].zero_()
        assert torch.equal(results[1][0], expected)


def _parts(size: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    # magnitudes that differ (within float16's range), so the order of the additions
    # shows in the bits
    return [torch.randn(257, generator=g).mul(8.0**r).to(dtype) for r in range(size)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_allreduce_sums_in_rank_order_and_low_precision_rounds_each_add(dtype):
    size = 4
    parts = _parts(size, dtype)
    expected = parts[0].clone()
    for p in parts[1:]:
        if dtype in (torch.float16, torch.bfloat16):  # the MPI user op: float32, rounded back
            expected = (expected.float() + p.float()).to(dtype)
        else:
            expected = expected + p
    results = within(
        HANG_S, lambda: run_ranks(size, lambda t: t.start_allreduce_sum(parts[t.rank]).wait())
    )
    for r in results:
        assert r.dtype == dtype and torch.equal(r, expected)
    assert torch.equal(sum_in_rank_order(parts), expected)
    results[0].add_(1)  # in-place use of one rank's result leaves the others' alone
    assert torch.equal(results[1], expected)


def test_rank_order_is_not_any_order():
    """The check above can fail: another order gives other float32 bits here."""
    a, b, c = (torch.tensor([v], dtype=torch.float32) for v in (1e8, -1e8, 1.0 / 3.0))
    assert not torch.equal(sum_in_rank_order([a, b, c]), (a + (b + c)))


def test_allreduce_refuses_integer_tensors():
    def rank(t):
        return t.start_allreduce_sum(torch.ones(3, dtype=torch.int32))

    with pytest.raises(TypeError, match="cannot sum torch.int32"):
        within(HANG_S, lambda: run_ranks(2, rank))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_alltoallv_delivers_part_j_to_rank_j(size):
    def rank(t):
        parts = [torch.full((j + t.rank,), 16 * t.rank + j, dtype=torch.uint8) for j in range(size)]
        return t.start_alltoallv(parts).wait()

    results = within(HANG_S, lambda: run_ranks(size, rank))
    for me, received in enumerate(results):
        assert len(received) == size
        for src, got in enumerate(received):
            assert torch.equal(got, torch.full((me + src,), 16 * src + me, dtype=torch.uint8))


def test_alltoallv_refuses_a_wrong_number_of_parts():
    def rank(t):
        return t.start_alltoallv([torch.zeros(1, dtype=torch.uint8)])

    with pytest.raises(ValueError, match="one part per rank"):
        within(HANG_S, lambda: run_ranks(2, rank))


def test_blocking_helpers():
    def rank(t):
        objects = t.allgather_object({"rank": t.rank})
        if t.rank == 0:
            objects[0]["rank"] = 99  # a copy: the other ranks' lists are untouched
        x = torch.full((3,), float(t.rank + 1))
        t.broadcast_([x], root=1)
        total = t.sum_floats([t.rank, 1.5])
        t.barrier()
        return objects, x, total

    results = within(HANG_S, lambda: run_ranks(3, rank))
    for me, (objects, x, total) in enumerate(results):
        assert objects[1:] == [{"rank": 1}, {"rank": 2}]
        assert objects[0] == {"rank": 99 if me == 0 else 0}
        assert torch.equal(x, torch.full((3,), 2.0))
        assert total == [3.0, 4.5]
    assert all(r[0] is not results[0][0] for r in results[1:])


def test_started_collectives_overlap_the_callers_work():
    """Start two, wait in reverse order: matched by position, not by waiting order."""

    def rank(t):
        h1 = t.start_allgatherv(torch.tensor([t.rank], dtype=torch.uint8))
        h2 = t.start_allreduce_sum(torch.tensor([float(t.rank)]))
        return h2.wait(), h1.wait()

    for total, (gathered, _) in within(HANG_S, lambda: run_ranks(3, rank)):
        assert float(total) == 3.0 and gathered.tolist() == [0, 1, 2]


# ---- failures end instead of hanging -----------------------------------------------------
def test_a_failing_rank_aborts_the_others_and_its_error_is_raised():
    def rank(t):
        if t.rank == 1:
            raise ValueError("rank 1's own bug")
        return t.start_allgatherv(torch.zeros(2, dtype=torch.uint8)).wait()

    with pytest.raises(ValueError, match="rank 1's own bug"):
        within(HANG_S, lambda: run_ranks(3, rank))


def test_a_rank_that_returns_early_ends_the_collectives_it_never_starts():
    def rank(t):
        if t.rank == 0:
            return "done"
        return t.allgather_object(t.rank)

    with pytest.raises(SimulatedAbort, match="rank 0 returned after starting 0 blocking"):
        within(HANG_S, lambda: run_ranks(2, rank))


def test_ranks_starting_different_collectives_get_rank_mismatch():
    def rank(t):
        if t.rank == 0:
            return t.start_allgatherv(torch.zeros(1, dtype=torch.uint8)).wait()
        return t.start_allreduce_sum(torch.zeros(1)).wait()

    with pytest.raises(RankMismatch, match="every rank must start the same collectives"):
        within(HANG_S, lambda: run_ranks(2, rank))


def test_world_size_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="int size >= 1"):
            SimulatedWorld(bad)


# ---- the optimizer through the simulated world ---------------------------------------------
def _train(compression, params=None, policy=None, steps=4, size=2, momentum=0.9):
    """Each rank: DistributedOptimizer over its simulated transport, ``steps`` steps on its
    own batches; (parameter digest, last stats) per rank."""

    def rank(t):
        model = seeded(0, make_model)
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
            model.named_parameters(),
            compression=hvdcompress.get_compressor(compression, **(params or {})),
            backend=t,
            policy=policy() if policy else None,
        )
        for step in range(steps):
            x, y = batch(t.rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return digest(model.parameters()), opt.last_stats

    return within(HANG_S, lambda: run_ranks(size, rank))


FIRST_EXAMPLES = {name: params for name, params in reversed(examples())}


@pytest.mark.parametrize("name", names())
def test_every_compressor_trains_and_ranks_agree(name):
    momentum = 0.0 if name == "dgc" else 0.9  # DGC applies momentum itself
    results = _train(name, FIRST_EXAMPLES[name], momentum=momentum)
    digests = {d for d, _ in results}
    assert len(digests) == 1, f"{name}: ranks hold different parameters"
    assert digests != {digest(seeded(0, make_model).parameters())}, "nothing was trained"
    assert all(stats.payload_bytes > 0 for _, stats in results)


def test_none_equals_a_hand_computed_data_parallel_step():
    size, lr = 2, 0.1
    got = _train("none", size=size, steps=1)[0][0]
    model = seeded(0, make_model)
    grads = []
    for r in range(size):
        model.zero_grad()
        x, y = batch(r, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_((grads[0][i] + grads[1][i]) * (1.0 / size), alpha=-lr)  # as SGD
    assert got == digest(model.parameters())


def test_accordion_and_cat_run_through_the_simulated_world():
    acc = _train(
        "3lc", {"sparsity": 1.0}, lambda: hvdcompress.Accordion(1.0, 1.75, interval_steps=2)
    )
    assert len({d for d, _ in acc}) == 1
    assert all(any(k.startswith("level/") for k in s.metrics) for _, s in acc)
    cat = _train(
        "topk",
        {"ratio": 0.05},
        lambda: hvdcompress.CAT(
            "topk", cost_model=hvdcompress.AffineCost(1e-4, 1e-9), recompute_every=2
        ),
    )
    assert len({d for d, _ in cat}) == 1
    assert all(any(k.startswith("T/") for k in s.metrics) for _, s in cat)


def test_seeded_serialises_the_global_generator():
    """Ranks building models at once get rank 0's parameters, as after a broadcast."""
    models = within(HANG_S, lambda: run_ranks(4, lambda t: seeded(3, make_model)))
    assert len({digest(m.parameters()) for m in models}) == 1
