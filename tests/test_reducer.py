"""hvdcompress.reducer: the one step protocol under both adapters (docs/design.md, "The
reducer"): routing that never touches the bucket handed in, one residual per tensor when
a bucket's route changes (the residuals the new route does not keep go into the gradient
it sends, an owner's times 1 / scale), the start-up check before any collective that
depends on the settings, and the layout a checkpoint was made on."""

from __future__ import annotations

import os

import pytest
import torch

import hvdcompress
from hvdcompress.buckets import Bucket, PieceKey
from hvdcompress.errors import RankAgreementError
from hvdcompress.exchange import GatheredExchange
from hvdcompress.reducer import Reducer, Route, check_start_up
from hvdcompress.training.simulate import run_ranks

NUMELS = {"a": 300, "b": 90}


def _bucket() -> Bucket:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in NUMELS.values()]
    return Bucket(0, params, list(NUMELS))


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(n, generator=g) for n in NUMELS.values()]


def _step(reducer: Reducer, bucket: Bucket, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    reducer.begin_step()
    started = reducer.start(reducer.route(bucket), grads)
    error = reducer.finish(started, reducer.scale)
    reducer.end_step()
    assert error is None
    return grads


def test_a_bucket_sent_dense_travels_as_a_new_uncompressed_bucket():
    def rank(t):
        reducer = Reducer(hvdcompress.get_compressor("3lc"), t, exchange="allgather")
        bucket = _bucket()
        reducer.plan([bucket])
        object.__setattr__(reducer._plans[("a", "b")], "dense", True)  # as "auto" may plan
        route = reducer.route(bucket)
        return route.label, route.bucket.compressed, bucket.compressed, route.bucket is bucket

    assert run_ranks(2, rank) == [("dense", False, True, False)] * 2


def test_a_route_change_moves_every_residual_it_does_not_keep_into_the_gradient():
    """Two steps on the two-stage exchange leave sender and owner residuals; the allgather
    keeps one residual per tensor, so the pieces' residuals go into the next gradient
    (an owner's times 1 / scale = the number of ranks) and no piece key is left."""

    def rank(t):
        comp = hvdcompress.get_compressor("3lc")
        reducer = Reducer(comp, t, exchange="twostage")
        bucket = _bucket()
        for step in range(2):
            _step(reducer, bucket, _grads(t.rank, step))
        residuals = dict(comp.memory.residuals)
        assert any(isinstance(k, PieceKey) and k.owner for k in residuals)
        expected = [g.clone() for g in _grads(t.rank, 2)]
        for key, e in residuals.items():
            i = list(NUMELS).index(key.name)
            weight = t.size if key.owner else 1.0
            expected[i][key.start : key.stop] += e * weight
        grads = _grads(t.rank, 2)
        flat = Route(bucket, comp, GatheredExchange(t), "allgather")
        reducer.enter(flat, grads)
        left = sorted(map(str, comp.memory.residuals))
        same = all(
            torch.allclose(g, x, rtol=0, atol=1e-6) for g, x in zip(grads, expected, strict=True)
        )
        before = sum(e.numel() for e in residuals.values())
        return left, same, before

    for left, same, before in run_ranks(3, rank):
        assert left == [] and same
        assert before > sum(NUMELS.values())  # the two-stage exchange's owner pieces on top


def test_after_the_route_change_one_residual_per_tensor_remains():
    """Memory: after a step on the new route only its residuals exist, the model's size."""

    def rank(t):
        comp = hvdcompress.get_compressor("3lc")
        reducer = Reducer(comp, t, exchange="twostage")
        bucket = _bucket()
        _step(reducer, bucket, _grads(t.rank, 0))
        reducer._plans[("a", "b")] = type(reducer._plans[("a", "b")])(
            GatheredExchange(t), False, None
        )  # as a tuner that moves the bucket to the allgather
        _step(reducer, bucket, _grads(t.rank, 1))
        return {str(k): e.numel() for k, e in comp.memory.residuals.items()}

    assert run_ranks(3, rank) == [NUMELS] * 3


def test_the_same_route_changes_nothing_so_a_resume_stays_exact():
    def rank(t):
        comp = hvdcompress.get_compressor("3lc")
        reducer = Reducer(comp, t, exchange="twostage")
        bucket = _bucket()
        _step(reducer, bucket, _grads(t.rank, 0))
        keys = set(comp.memory.residuals)
        grads = _grads(t.rank, 1)
        reducer.enter(reducer.route(bucket), grads)
        return keys == set(comp.memory.residuals), torch.equal(grads[0], _grads(t.rank, 1)[0])

    assert run_ranks(3, rank) == [(True, True)] * 3


@pytest.mark.parametrize("what", ["exchange", "compressor", "override"])
def test_ranks_that_would_reduce_differently_are_stopped_before_any_collective(what):
    errors = []

    def rank(t):
        odd = t.rank == 2
        exchange = "allgather" if odd and what == "exchange" else "twostage"
        comp = hvdcompress.get_compressor(
            "3lc", sparsity=1.5 if odd and what == "compressor" else 1.0
        )
        env = {"HVDC_RANKS_PER_NODE": "abc"} if odd and what == "override" else {}
        try:
            with _environ(env):
                check_start_up(t, comp, exchange=exchange, tuning=None, link_cost=None, lines=[])
        except RankAgreementError as err:
            errors.append(str(err))
            return "raised"
        return "went on"

    assert run_ranks(3, rank) == ["raised"] * 3
    assert len(set(errors)) == 1 and "ranks [2] differ from rank 0" in errors[0], errors


class _environ:
    """Set variables for one simulated rank (threads share ``os.environ``: the check reads
    it before its one collective)."""

    def __init__(self, env: dict) -> None:
        self.env = env

    def __enter__(self):
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for key in self.env:
            os.environ.pop(key, None)


def test_a_state_with_pieces_loads_only_on_the_layout_it_was_made_on():
    saved = {}

    def save(t):
        comp = hvdcompress.get_compressor("3lc")
        reducer = Reducer(comp, t, exchange="twostage")
        _step(reducer, _bucket(), _grads(t.rank, 0))
        saved[t.rank] = reducer.state_dict()
        return saved[t.rank]["layout"]

    assert run_ranks(3, save) == [{"exchange": "twostage", "nodes": None}] * 3

    def load(exchange):
        def rank(t):
            reducer = Reducer(hvdcompress.get_compressor("3lc"), t, exchange=exchange)
            try:
                reducer.load_state_dict(saved[t.rank], NUMELS_SHAPES)
            except hvdcompress.CheckpointError as err:
                return str(err)
            return "loaded"

        return rank

    assert run_ranks(3, load("twostage")) == ["loaded"] * 3
    refused = run_ranks(3, load("allgather"))
    assert all("saved with exchange='twostage'" in r for r in refused), refused
    legacy = {r: {k: v for k, v in s.items() if k != "layout"} for r, s in saved.items()}
    saved.update(legacy)  # a state from before layouts were recorded: as before
    assert run_ranks(3, load("twostage")) == ["loaded"] * 3


NUMELS_SHAPES = {name: (n,) for name, n in NUMELS.items()}


def test_a_crafted_layout_is_refused():
    def rank(t):
        reducer = Reducer(hvdcompress.get_compressor("3lc"), t, exchange="allgather")
        state = reducer.state_dict()
        state["layout"] = {"exchange": "allgather", "nodes": [["0"]]}
        with pytest.raises(hvdcompress.CheckpointError, match="layout"):
            reducer.load_state_dict(state, NUMELS_SHAPES)
        return True

    assert run_ranks(2, rank) == [True, True]


def test_the_16_bit_option_is_a_bf16_allreduce_timed_beside_the_others():
    """With a tuner, every compressed bucket's options include "bf16" (Tuning.half); taken,
    it sends each value in 2 bytes over the allreduce, every rank gets the same average,
    its label is in the step's stats, and the codec's residuals go into that step."""
    from hvdcompress.exchange.tuning import ExchangeTuner

    def rank(t):
        comp = hvdcompress.get_compressor("3lc")
        reducer = Reducer(comp, t, exchange="auto")
        reducer.tuner = ExchangeTuner(hvdcompress.Tuning(), t.size)  # simulated: none
        bucket = _bucket()
        reducer.plan([bucket])
        key = ("a", "b")
        options = reducer.tuner.options[key]
        reducer.tuner.current[key] = "allgather"
        _step(reducer, bucket, _grads(t.rank, 0))  # leaves residuals
        residuals = {k: e.clone() for k, e in comp.memory.residuals.items()}
        reducer.tuner.current[key] = "bf16"
        grads = _grads(t.rank, 1)
        sent = [g + residuals[n] for g, n in zip(grads, NUMELS, strict=True)]
        _step(reducer, bucket, grads)
        stats = reducer.account.last
        return options, stats.exchanges, stats.payload_bytes, grads, sent, comp.memory.residuals

    results = run_ranks(3, rank)
    for options, labels, payload, grads, _, left in results:
        assert "bf16" in options and "dense" in options
        assert labels == {0: "bf16"} and payload == 2 * sum(NUMELS.values())
        assert left == {}
        for g, g0 in zip(grads, results[0][3], strict=True):
            assert torch.equal(g, g0)  # rank-identical
    exact = [sum(r[4][i] for r in results) / 3 for i in range(len(NUMELS))]
    for g, x in zip(results[0][3], exact, strict=True):
        assert torch.allclose(g, x, rtol=2e-2, atol=2e-2)  # bf16's 8 bits of mantissa


def test_half_none_keeps_float32_the_only_dense_option():
    from hvdcompress.exchange.tuning import ExchangeTuner

    def rank(t):
        reducer = Reducer(hvdcompress.get_compressor("3lc"), t, exchange="auto")
        reducer.tuner = ExchangeTuner(hvdcompress.Tuning(half=None), t.size)
        reducer.plan([_bucket()])
        return reducer.tuner.options[("a", "b")]

    assert all("bf16" not in o and "fp16" not in o for o in run_ranks(3, rank))
