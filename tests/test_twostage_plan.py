"""The two-stage exchange's shard planner, byte cost model and exchange choice, and the
traffic counting every transport inherits (no MPI needed; the exchange itself runs on
real ranks in tests/mpi/test_twostage.py)."""

from __future__ import annotations

import pytest
import torch

import hvdcompress
from hvdcompress.buckets import make_buckets
from hvdcompress.exchange import (
    PayloadEstimate,
    allgather_bytes,
    choose_exchanges,
    estimate_payload,
    plan_shards,
    plan_shards_per_tensor,
    twostage_bytes,
)
from hvdcompress.transports import Handle, Transport


def _covered(shards, numels):
    seen = [[0] * n for n in numels]
    for owner, pieces in enumerate(shards):
        for pc in pieces:
            assert pc.owner == owner and 0 <= pc.start < pc.stop <= numels[pc.tensor]
            for i in range(pc.start, pc.stop):
                seen[pc.tensor][i] += 1
    return seen


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("alignment", [1, 5, 512])
@pytest.mark.parametrize("numels", [[1], [4], [0, 3], [7, 3], [37, 1, 640], [2000]])
def test_shards_cover_every_element_once_in_order_on_aligned_cuts(numels, alignment, size):
    names = [f"t{i}" for i in range(len(numels))]
    shards = plan_shards(names, numels, size, alignment)
    assert len(shards) == size
    assert all(c == 1 for tensor in _covered(shards, numels) for c in tensor)
    flat = [(pc.tensor, pc.start) for pieces in shards for pc in pieces]
    assert flat == sorted(flat)  # contiguous shards, in rank order
    for pieces in shards:
        for pc in pieces:
            assert pc.start % alignment == 0  # a cut inside a tensor is on a group


def test_shards_of_zero_one_and_four_values():
    assert [[pc.numel for pc in s] for s in plan_shards(["a"], [1], 2, 1)] == [[], [1]]
    assert [[pc.numel for pc in s] for s in plan_shards(["a"], [4], 3, 5)] == [[], [], [4]]
    assert [[pc.numel for pc in s] for s in plan_shards(["a"], [4], 4, 1)] == [[1]] * 4
    # a tensor smaller than the number of ranks
    sizes = [sum(pc.numel for pc in s) for s in plan_shards(["a"], [3], 5, 1)]
    assert sorted(sizes) == [0, 0, 1, 1, 1]


def test_cuts_balance_the_shards_up_to_the_alignment():
    shards = plan_shards(["a", "b"], [1000, 3000], 4, 5)
    sizes = [sum(pc.numel for pc in s) for s in shards]
    assert sizes == [1000, 1000, 1000, 1000]
    shards = plan_shards(["a"], [1001], 3, 5)  # ideal cuts 333, 667 -> 335, 665
    assert [sum(pc.numel for pc in s) for s in shards] == [335, 330, 336]
    assert [str(pc.sender_key) for pc in shards[1]] == ["a[335:665]"]
    assert [str(pc.owner_key) for pc in shards[1]] == ["a[335:665]@owner"]


def test_per_tensor_shards_do_not_depend_on_the_bucket_and_spread_small_tensors():
    """The DDP hook's plan: a tensor's pieces are the same whichever tensors share its
    bucket (DDP rebuilds buckets), every element is in one piece, and many small tensors
    spread over the owners instead of piling onto one."""
    size, alignment = 4, 5
    names = [f"layer{i}.bias" for i in range(40)] + ["big.weight"]
    numels = [3] * 40 + [1000]
    shards = plan_shards_per_tensor(names, numels, size, alignment)
    alone = plan_shards_per_tensor(["big.weight"], [1000], size, alignment)
    assert sorted(
        (pc.owner, pc.start, pc.stop) for sh in shards for pc in sh if pc.name == "big.weight"
    ) == sorted((pc.owner, pc.start, pc.stop) for sh in alone for pc in sh)
    for t, (name, n) in enumerate(zip(names, numels, strict=True)):
        pieces = sorted((pc.start, pc.stop) for sh in shards for pc in sh if pc.tensor == t)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False)), name
    owners_of_biases = {pc.owner for sh in shards for pc in sh if pc.name.endswith(".bias")}
    assert owners_of_biases == set(range(size))
    assert all(pc.owner == owner for owner, sh in enumerate(shards) for pc in sh)


def test_plan_refuses_nonsense():
    with pytest.raises(ValueError):
        plan_shards(["a"], [3], 0, 1)
    with pytest.raises(ValueError):
        plan_shards(["a"], [3], 2, 0)


def test_byte_model_allgather_grows_with_n_twostage_stays_flat():
    est = PayloadEstimate(header_bytes=40, bits_per_value=1.6)
    n = 1_000_000
    payload = est.bytes(n)
    for size in (2, 4, 8, 16):
        ag = allgather_bytes(size, [n], est)
        ts = twostage_bytes(size, plan_shards(["w"], [n], size, 5), est)
        assert ag == (size - 1) * (16 + payload)
        assert abs(ts / (2 * (size - 1) / size * payload) - 1) < 0.01
    # N = 2: both move the payload once, the two-stage exchange plus a header and status
    assert twostage_bytes(2, plan_shards(["w"], [n], 2, 5), est) > allgather_bytes(2, [n], est)


def test_byte_model_small_tensors_favour_the_allgather_at_three_ranks():
    est = PayloadEstimate(header_bytes=40, bits_per_value=1.6)
    small, large = 640, 20000
    shards = plan_shards(["w"], [small], 3, 5)
    assert twostage_bytes(3, shards, est) > allgather_bytes(3, [small], est)
    shards = plan_shards(["w"], [large], 3, 5)
    assert twostage_bytes(3, shards, est) < 0.8 * allgather_bytes(3, [large], est)


def test_estimate_is_rank_independent_and_leaves_the_compressor_alone():
    for name in ("3lc", "qsgd", "randomk"):
        a, b = hvdcompress.get_compressor(name), hvdcompress.get_compressor(name)
        a.bind(0, 4)
        b.bind(3, 4)
        before = repr(a.state_dict())
        ea, eb = estimate_payload(a, 4), estimate_payload(b, 4)
        assert ea == eb and ea.bits_per_value > 0
        assert repr(a.state_dict()) == before  # the probe ran on a copy
    three = estimate_payload(hvdcompress.get_compressor("3lc"), 4)
    assert 0.0 < three.bits_per_value < 1.6  # below quartic's 1.6 bits: ZRE of zero runs


class _Fake(Transport):
    """A transport of ``size`` ranks that only returns fabricated results (no peers)."""

    name = "fake"
    tunable = False  # no link to time

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def _done(self, result) -> Handle:
        handle = Handle()
        handle._finish(result)
        return handle

    def start_allgatherv(self, local, *, key=None):
        sizes = [local.numel() + r for r in range(self.size)]
        return self._done((torch.zeros(sum(sizes), dtype=torch.uint8), sizes))

    def start_alltoallv(self, parts, *, key=None):
        return self._done([torch.zeros(10 * (i + 1), dtype=torch.uint8) for i in range(self.size)])

    def start_allreduce_sum(self, dense):
        return self._done(dense.clone())


def _buckets(model, threshold=0):
    return make_buckets(list(model.named_parameters()), threshold)


def test_every_transport_counts_its_traffic_in_the_base_class():
    t = _Fake(rank=1, size=4)
    h = t.start_allgatherv(torch.zeros(100, dtype=torch.uint8))
    assert h.sent_bytes == 300 and h.received_bytes is None
    h.wait()
    assert h.received_bytes == (100 + 102 + 103)  # the others' bytes
    parts = [torch.zeros(n, dtype=torch.uint8) for n in (5, 6, 7, 8)]
    h = t.start_alltoallv(parts)
    h.wait()
    assert h.sent_bytes == 5 + 7 + 8 and h.received_bytes == 10 + 30 + 40
    h = t.start_allreduce_sum(torch.zeros(100, dtype=torch.float32))
    h.wait()
    assert h.sent_bytes == h.received_bytes == 2 * 3 * 400 // 4
    assert (t.traffic.sent, t.traffic.received, t.traffic.collectives) == (
        300 + 20 + 600,
        305 + 80 + 600,
        3,
    )
    h.wait()  # a second wait counts nothing again
    assert t.traffic.received == 305 + 80 + 600


def test_choose_exchanges_by_mode():
    model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.Linear(200, 1))
    t = _Fake(rank=0, size=4)
    buckets = _buckets(model)
    sizes = [sum(p.numel() for p in b.params) for b in buckets]

    def kinds(comp, transport, mode, **kw):
        fresh = _buckets(model)
        chosen = choose_exchanges(comp, transport, fresh, mode, **kw)
        return [chosen[b.index].kind for b in fresh]

    three = hvdcompress.get_compressor("3lc")
    assert set(kinds(three, t, "allgather")) == {"allgather"}
    assert set(kinds(three, t, "twostage")) == {"twostage"}
    auto = kinds(three, t, "auto")
    # 20000 values gain; 200 values (shards of 50) lose to the extra headers; one value
    # is smaller dense (4 bytes) than its header, so it goes dense
    assert auto[sizes.index(20000)] == "twostage" and auto[sizes.index(200)] == "allgather"
    assert auto[sizes.index(1)] == "allreduce"
    two = _Fake(rank=0, size=2)
    assert kinds(three, two, "auto") == ["allgather" if n > 1 else "allreduce" for n in sizes]
    fp16 = hvdcompress.get_compressor("fp16")
    assert set(kinds(fp16, t, "auto")) == {"allreduce"}
    for name in ("ndqsg", "dgc"):
        comp = hvdcompress.get_compressor(name)
        with pytest.raises(ValueError, match=f"{name} cannot"):
            choose_exchanges(comp, t, buckets, "twostage")
        assert set(kinds(comp, t, "auto")) == {"allgather", "allreduce"}
    with pytest.raises(ValueError, match="summable"):
        choose_exchanges(fp16, t, buckets, "twostage")
    with pytest.raises(ValueError, match="exchange must be one of"):
        choose_exchanges(three, t, buckets, "ring")
