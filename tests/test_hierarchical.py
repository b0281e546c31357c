"""The hierarchical exchange (hvdcompress.exchange.hierarchical) in the simulated world,
with the topology override playing nodes (HVDC_RANKS_PER_NODE): every rank ends with
bit-identical gradients, a lossless codec gives the exact average, M > 2 nodes take the
two-stage exchange across nodes, a corrupt cross-node payload fails every rank with a
PayloadError (no rank left waiting), and the configurations it cannot run are refused.
torchrun across namespaces: tests/test_bench_cluster.py."""

from __future__ import annotations

import hashlib

import pytest
import torch

import hvdcompress
from hvdcompress.errors import PayloadError
from hvdcompress.training.simulate import run_ranks, seeded
from tests.helpers import averaged_grads, small_model


def _model():
    """The same parameters on every simulated rank (ranks are threads: one seeded draw
    at a time)."""
    return seeded(0, small_model)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)


def _digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _train(compression, exchange, steps=3, **opt_kw):
    def rank(t):
        model = _model()
        comp = compression() if callable(compression) else compression  # one per rank
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            compression=comp, backend=t, exchange=exchange, **opt_kw,
        )  # fmt: skip
        grads = averaged_grads(model, opt, lambda step: _batch(t.rank, step), steps)
        kinds = sorted({opt.reducer.planned(b).kind for b in opt.buckets})
        return _digest(model), grads, kinds

    return rank


@pytest.fixture
def two_per_node(monkeypatch):
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "2")


def test_every_rank_ends_bit_identical_with_3lc_on_2_nodes_of_2(two_per_node):
    got = run_ranks(4, _train("3lc", "hierarchical"))
    assert len({d for d, _, _ in got}) == 1
    assert all(kinds == ["hierarchical"] for _, _, kinds in got)


def test_a_lossless_codec_gives_the_exact_average(two_per_node):
    """top-k keeping every value sends the gradient exactly: the hierarchical average
    equals the flat allgather's up to float32 rounding of the sums' order."""
    exact = lambda: hvdcompress.get_compressor("topk", ratio=1.0)  # noqa: E731
    flat = run_ranks(4, _train(exact, "allgather", 1))
    hier = run_ranks(4, _train(exact, "hierarchical", 1))
    for (_, gf, _), (_, gh, _) in zip(flat, hier, strict=True):
        for a, b in zip(gf[0], gh[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_three_nodes_take_the_two_stage_exchange_across_nodes(two_per_node):
    def rank(t):
        digest, _, _ = _train("3lc", "hierarchical", 2)(t)
        return digest

    assert len(set(run_ranks(6, rank))) == 1
    got = run_ranks(6, lambda t: hvdcompress.exchange.hierarchical_exchange(
        t, hvdcompress.get_compressor("3lc")).two_stage)  # fmt: skip
    assert got == [True] * 6


def test_a_corrupt_cross_node_payload_fails_every_rank(two_per_node):
    def rank(t):
        model = _model()
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            compression="3lc", backend=t, exchange="hierarchical",
        )  # fmt: skip
        (exchange,) = {opt.reducer.planned(b) for b in opt.buckets}
        cross = exchange.cross
        if t.rank == 3:  # local rank 1 of node 1 sends a frame whose length table is off
            start = cross.start_allgatherv

            def corrupt(frame, **kw):
                frame = frame.clone()
                frame[8:16].view(torch.int64).add_(1)
                return start(frame, **kw)

            cross.start_allgatherv = corrupt
        x, y = _batch(t.rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        with pytest.raises(PayloadError) as err:
            opt.synchronize()
        return err.value.rank, str(err.value)

    got = run_ranks(4, rank)
    # every rank names the sender by its global rank, 3: ranks 1 and 3 (local rank 1, the
    # cross-node group that got the bad frame) decode it ("from rank 1" of their group is
    # global rank 3); ranks 0 and 2 learn it from stage 3's status word
    assert [r for r, _ in got] == [3, 3, 3, 3]
    assert "payload from rank 3" in got[1][1] and "payload from rank 3" in got[3][1]
    assert "cross-node stage" in got[0][1] and "cross-node stage" in got[2][1]


def test_what_it_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "2")
    with pytest.raises(ValueError, match="gather-only compressors"):
        run_ranks(2, _train("fp16", "hierarchical", 1))
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "3")
    with pytest.raises(ValueError, match="does not divide the 4 ranks"):
        run_ranks(4, _train("3lc", "hierarchical", 1))


def _resume(monkeypatch, per_node_then: str):
    """Three steps on 2 x 2 nodes straight, against two steps, each rank's state saved,
    then a fresh optimizer on ``per_node_then`` ranks per node that loads it and steps."""
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "2")

    def straight(t):
        model = _model()
        opt = _opt(model, t)
        for step in range(3):
            _step(model, opt, t.rank, step)
        return _digest(model)

    saved = {}

    def first_two(t):
        model = _model()
        opt = _opt(model, t)
        for step in range(2):
            _step(model, opt, t.rank, step)
        saved[t.rank] = (model.state_dict(), opt.state_dict())

    reference = run_ranks(4, straight)
    run_ranks(4, first_two)
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", per_node_then)

    def resumed(t):
        model = _model()
        model.load_state_dict(saved[t.rank][0])
        opt = _opt(model, t)
        opt.load_state_dict(saved[t.rank][1])
        _step(model, opt, t.rank, 2)
        return _digest(model)

    return reference, resumed


def _opt(model, t):
    return hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        compression="3lc", backend=t, exchange="hierarchical",
    )  # fmt: skip


def _step(model, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def test_a_checkpoint_resumes_exactly_on_the_same_topology(monkeypatch):
    reference, resumed = _resume(monkeypatch, "2")
    assert run_ranks(4, resumed) == reference


def test_a_checkpoint_of_another_topology_is_refused(monkeypatch):
    _, resumed = _resume(monkeypatch, "4")
    with pytest.raises(hvdcompress.CheckpointError):
        run_ranks(4, resumed)


def test_auto_guesses_hierarchical_on_nodes_of_several_ranks(two_per_node):
    """On 2 nodes of 2, "auto" starts every gather bucket on the hierarchical exchange
    (fewest bytes across nodes) and keeps the flat ones and dense open for the tuner;
    on one node of 4 it does not (nothing to split). Bit-identical either way."""
    from hvdcompress.exchange import choose_exchanges

    got = run_ranks(4, _train("3lc", "auto"))
    assert len({d for d, _, _ in got}) == 1
    assert all(kinds == ["hierarchical"] for _, _, kinds in got)

    def options(t):
        model = _model()
        buckets = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
            compression="3lc", backend=t, exchange="allgather",
        ).buckets  # fmt: skip
        plan = choose_exchanges(hvdcompress.get_compressor("3lc"), t, buckets, "auto")
        return sorted(sorted(o) for o in plan.options.values())

    (first, *_) = run_ranks(4, options)
    assert first and all(o == ["allgather", "dense", "hierarchical", "twostage"] for o in first)


def test_auto_on_one_node_stays_flat(monkeypatch):
    monkeypatch.setenv("HVDC_RANKS_PER_NODE", "4")
    got = run_ranks(4, _train("3lc", "auto"))
    assert all("hierarchical" not in kinds for _, _, kinds in got)
