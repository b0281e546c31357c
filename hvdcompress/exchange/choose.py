"""Which exchange each bucket takes (``exchange=`` "auto", "allgather", "twostage"),
from a measured payload model and either the bytes per rank each exchange moves or, with
a ``LinkCost``, the seconds it takes (docs/exchanges.md, "Choosing the exchange")."""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from hvdcompress import checks, wire
from hvdcompress.buckets import Bucket
from hvdcompress.compressors import Compressor, GatherCompressor, SummableCompressor
from hvdcompress.exchange.allgather import GatheredExchange
from hvdcompress.exchange.base import _Exchange
from hvdcompress.exchange.hierarchical import hierarchical_exchange, hierarchical_open
from hvdcompress.exchange.summed import SummedExchange
from hvdcompress.exchange.twostage import Piece, TwoStageExchange
from hvdcompress.stats import ring_allreduce_bytes
from hvdcompress.transports import Transport
from hvdcompress.transports.cost import LinkCost, calibrate_link

EXCHANGES = ("auto", "allgather", "twostage", "hierarchical")
LINK_COSTS = (None, "measure")  # or a LinkCost
PROBE_NUMEL = 1 << 16  # elements of the cost model's probe payload


@dataclass(frozen=True)
class PayloadEstimate:
    """A compressor's payload size model: a header per payload plus bits per value."""

    header_bytes: int
    bits_per_value: float

    def bytes(self, numel: int) -> int:
        return self.header_bytes + math.ceil(numel * self.bits_per_value / 8)


def estimate_payload(compressor: GatherCompressor, size: int) -> PayloadEstimate:
    """Measure the compressor on a probe: a copy of it (bound as rank 0, so that every
    rank measures the same bytes) compresses ``PROBE_NUMEL`` seeded normal values. The
    compressor itself is not touched."""
    probe = copy.deepcopy(compressor)
    probe.bind(0, size)
    x = torch.randn(PROBE_NUMEL, generator=torch.Generator().manual_seed(0))
    payload, _ = probe.compress(x, "hvdcompress.exchange.probe")
    header = wire.parse(payload)
    return PayloadEstimate(header.size, 8.0 * (payload.numel() - header.size) / PROBE_NUMEL)


def allgather_bytes(size: int, numels: list[int], est: PayloadEstimate) -> float:
    """Bytes one rank sends for a bucket on the allgather: its frame to N - 1 ranks."""
    frame = 8 * (len(numels) + 1) + sum(est.bytes(n) for n in numels)
    return float((size - 1) * frame)


def twostage_bytes(size: int, shards: list[list[Piece]], est: PayloadEstimate) -> float:
    """Bytes one rank sends for a bucket on the two-stage exchange, averaged over ranks:
    stage 1 sends the N - 1 shards of the others, stage 2 its own shard to N - 1 ranks;
    both move every shard's frame (N - 1) / N times per rank on average."""
    frames = sum(8 * (len(p) + 1) + sum(est.bytes(pc.numel) for pc in p) for p in shards)
    # stage 1 and stage 2 together move what a ring allreduce of the frames moves
    return ring_allreduce_bytes(size, frames) + (size - 1)  # + the status byte


@dataclass(frozen=True)
class ComputeCost:
    """Seconds per value of a compressor's encode and of one decode (of one rank's
    payload), measured on the probe of ``estimate_payload`` and averaged over ranks."""

    encode: float
    decode: float


def measure_compute(compressor: GatherCompressor, transport: Transport) -> ComputeCost:
    """Time a copy of the compressor on the probe (median of 3 after a warm-up);
    collective: the ranks' timings are averaged, so every rank gets the same numbers."""
    probe = copy.deepcopy(compressor)
    probe.bind(0, transport.size)
    x = torch.randn(PROBE_NUMEL, generator=torch.Generator().manual_seed(0))
    enc, dec = [], []
    for _ in range(4):
        t0 = time.perf_counter()
        payload, ctx = probe.compress(x, "hvdcompress.exchange.probe")
        t1 = time.perf_counter()
        probe.decompress(payload, ctx)
        enc.append(t1 - t0)
        dec.append(time.perf_counter() - t1)
    mine = [statistics.median(enc[1:]) / PROBE_NUMEL, statistics.median(dec[1:]) / PROBE_NUMEL]
    encode, decode = transport.sum_floats(mine)
    return ComputeCost(encode / transport.size, decode / transport.size)


def predicted_seconds(
    link: LinkCost, compute: ComputeCost, size: int, numel: int, frames: list[float]
) -> float:
    """Seconds of a gather exchange of ``numel`` values: one frame per rank
    (``frames == [frame]``: encode, one allgatherv, decode N payloads) or the two-stage
    exchange's shard frames (encode, the alltoallv of the shards, decode N payloads of a
    shard, re-encode it, the allgatherv of the shards, decode N shards)."""
    if len(frames) == 1:
        return (compute.encode + size * compute.decode) * numel + link.seconds(
            "allgatherv", frames[0]
        )
    shard = sum(frames) / len(frames)
    return (
        compute.encode * numel * (1 + 1 / size)
        + 2 * compute.decode * numel
        + link.seconds("alltoallv", sum(frames))
        + link.seconds("allgatherv", shard)
    )


def check_exchange(mode, link_cost) -> None:
    """The ``exchange`` and ``link_cost`` arguments of both adapters, checked once."""
    checks.choice("exchange", mode, EXCHANGES)
    if not (
        link_cost is None
        or (isinstance(link_cost, str) and link_cost == "measure")
        or isinstance(link_cost, LinkCost)
    ):
        raise TypeError(f"link_cost must be None, 'measure' or a LinkCost, got {link_cost!r}")


@dataclass(frozen=True)
class ExchangePlan:
    """``choose_exchanges``'s decision: ``exchanges``, the exchange of every bucket (by
    ``Bucket.index``; ``plan[index]``), and ``dense``, the indices of the compressed
    buckets that "auto" sends dense (their exchange is a ``SummedExchange``: the caller
    sends them with its uncompressed compressor). The buckets themselves are not touched."""

    exchanges: dict[int, _Exchange]
    dense: frozenset[int] = frozenset()
    # "auto": every option open to a compressed bucket, by label ("dense": sent with the
    # caller's uncompressed compressor), for the tuner to time (exchange.tuning)
    options: dict[int, dict[str, _Exchange]] = field(default_factory=dict)

    def __getitem__(self, index: int) -> _Exchange:
        return self.exchanges[index]

    def label(self, index: int) -> str:
        """The label of the bucket's chosen option (its exchange's kind, or "dense")."""
        return "dense" if index in self.dense else self.exchanges[index].kind


def choose_exchanges(
    compressor: Compressor,
    transport: Transport,
    buckets: list[Bucket],
    mode: str = "auto",
    finish_transport: Transport | None = None,
    per_tensor: bool = False,
    link_cost: LinkCost | str | None = None,
) -> ExchangePlan:
    """The exchange of every bucket (by ``Bucket.index``), for ``exchange=mode``.

    Uncompressed buckets and summable compressors: the allreduce. Gather-only ones:
    "allgather"; "twostage" (ValueError if the compressor is not ``recompressible``, or
    is summable); "auto": the two-stage exchange where its modelled bytes per rank
    (``twostage_bytes``) are fewer than the allgather's (``allgather_bytes``), which needs
    N >= 3 (at N = 2 both move the payload once) and a bucket whose payload outweighs the
    extra headers; compressors that cannot re-compress stay on the allgather. The choice
    depends only on the buckets, N and the compressor's configuration: the same on every
    rank. In "auto", a gather-only bucket whose payload headers alone would move more
    bytes per rank than its dense allreduce goes dense: it gets a ``SummedExchange`` and
    its index is in the plan's ``dense`` (the caller sends it with its uncompressed
    compressor); the buckets are left as they are.

    ``link_cost`` (``LinkCost``, or "measure" to ``calibrate_link`` the transport now,
    collectively): "auto" picks, among the dense allreduce, the allgather and the
    two-stage exchange, the least ``predicted_seconds`` on that link with the encode and
    decode seconds ``measure_compute`` times (the same on every rank; timings vary from
    run to run, so two runs may choose differently: pass a ``LinkCost`` to fix it).
    ``finish_transport``: where the exchanges' ``finish`` starts its collectives
    (``_Exchange.finish_transport``; default ``transport``); ``per_tensor``: two-stage
    shards planned per tensor (``plan_shards_per_tensor``, the DDP hook's)."""
    check_exchange(mode, link_cost)
    check_mode(compressor, mode)
    size = transport.size
    if link_cost == "measure" and mode == "auto":
        link_cost = calibrate_link(transport)
    costing = _Costing(compressor, transport, link_cost)
    chosen: dict[int, _Exchange] = {}
    dense_indices: set[int] = set()
    options: dict[int, dict[str, _Exchange]] = {}
    hierarchical = (
        mode == "auto" and isinstance(compressor, GatherCompressor) and hierarchical_open(transport)
    )
    for b in buckets:
        if not b.compressed or isinstance(compressor, SummableCompressor):
            chosen[b.index] = SummedExchange(transport, finish_transport)
            if b.compressed and mode == "auto":
                dense = SummedExchange(transport, finish_transport)
                options[b.index] = {"allreduce": chosen[b.index], "dense": dense}
            continue
        if mode == "hierarchical":
            chosen[b.index] = hierarchical_exchange(transport, compressor, finish_transport)
            chosen[b.index].plan(b, compressor)  # its state names, before the first step
            continue
        gathered = GatheredExchange(transport, finish_transport)
        twostage = None
        if mode == "twostage" or (mode == "auto" and compressor.recompressible and size >= 3):
            twostage = TwoStageExchange(
                transport, b, compressor.shard_alignment(), finish_transport, per_tensor
            )
        if mode != "auto":
            chosen[b.index] = twostage or gathered
            continue
        open_ = {"allgather": gathered, "twostage": twostage}
        if hierarchical:  # fewer bytes across nodes than any flat exchange (docs/exchanges.md)
            open_["hierarchical"] = hierarchical_exchange(transport, compressor, finish_transport)
            open_["hierarchical"].plan(b, compressor)
        open_["dense"] = SummedExchange(transport, finish_transport)
        options[b.index] = {k: e for k, e in open_.items() if e is not None}
        if hierarchical:
            chosen[b.index] = open_["hierarchical"]
            continue
        chosen[b.index] = costing.cheapest(b, gathered, twostage, open_["dense"])
        if chosen[b.index] is open_["dense"]:
            dense_indices.add(b.index)
    return ExchangePlan(chosen, frozenset(dense_indices), options)


def check_mode(compressor: Compressor, mode: str) -> None:
    """ValueError where ``exchange=mode`` cannot carry ``compressor``'s payloads, TypeError
    for what is no compressor of either kind (the reducer checks it when it is made)."""
    if isinstance(compressor, SummableCompressor):
        if mode == "hierarchical":
            raise ValueError(
                f"exchange='hierarchical' is for gather-only compressors; {compressor.name} "
                "is summable and its buckets are allreduced: use exchange='auto'"
            )
        if mode == "twostage":
            raise ValueError(
                f"exchange='twostage' is for gather-only compressors; {compressor.name} is "
                "summable and its buckets are allreduced (already 2 (N - 1) / N x payload "
                "per rank): use exchange='auto'"
            )
    elif not isinstance(compressor, GatherCompressor):
        raise TypeError(
            f"{compressor!r} is neither a GatherCompressor nor a SummableCompressor "
            "(hvdcompress.compressors.base)"
        )
    elif mode == "twostage" and not compressor.recompressible:
        raise ValueError(
            f"exchange='twostage' needs a compressor whose averaged shards can be "
            f"re-compressed; {compressor.name} cannot (GatherCompressor.recompressible: "
            "it decodes with other ranks' payloads or its compress does more than encode): "
            "use exchange='allgather' or 'auto'"
        )


class _Costing:
    """ "auto"'s first guess for one gather-only bucket (``choose_exchanges``): the payload
    model measured once (``estimate_payload``; with a ``LinkCost`` the codec's seconds
    too, ``measure_compute``, collectively, at the first bucket that needs them)."""

    def __init__(self, compressor: GatherCompressor, transport: Transport, link_cost) -> None:
        self.compressor, self.transport, self.link_cost = compressor, transport, link_cost
        self.estimate: PayloadEstimate | None = None
        self.compute: ComputeCost | None = None

    def cheapest(self, b: Bucket, gathered, twostage, dense):
        """The exchange of least modelled cost among ``gathered``, ``twostage`` (None:
        not open) and ``dense`` (by bytes: only where the headers alone outweigh the ring
        allreduce's bytes, since the bodies' bytes change during training: DGC's warm-up,
        a policy's levels). A tie keeps the allgather."""
        size = self.transport.size
        self.estimate = self.estimate or estimate_payload(self.compressor, size)
        estimate = self.estimate
        numels = [p.numel() for p in b.params]
        raw = sum(p.numel() * p.element_size() for p in b.params)
        shards = list(twostage.plan(b)) if twostage is not None else None
        if isinstance(self.link_cost, LinkCost):
            self.compute = self.compute or measure_compute(self.compressor, self.transport)
            frames = {gathered: [8 * (len(numels) + 1) + sum(estimate.bytes(n) for n in numels)]}
            if shards is not None:
                frames[twostage] = [
                    8 * (len(p) + 1) + sum(estimate.bytes(pc.numel) for pc in p) for p in shards
                ]
            costs = {
                e: predicted_seconds(self.link_cost, self.compute, size, sum(numels), f)
                for e, f in frames.items()
            }
            dense_cost = self.link_cost.seconds("allreduce", raw)
        else:
            costs = {gathered: allgather_bytes(size, numels, estimate)}
            headers = PayloadEstimate(estimate.header_bytes, 0.0)
            floor = allgather_bytes(size, numels, headers)
            if shards is not None:
                costs[twostage] = twostage_bytes(size, shards, estimate)
                floor = min(floor, twostage_bytes(size, shards, headers))
            ring = ring_allreduce_bytes(size, raw)
            dense_cost = ring if ring < floor else math.inf
        best = min(costs, key=costs.get)  # a tie keeps the allgather (inserted first)
        return dense if dense_cost < costs[best] else best
