"""Which exchange each bucket takes (``exchange=`` "auto", "allgather", "twostage"),
from a measured payload model and the bytes per rank each exchange moves."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from hvdcompress import wire
from hvdcompress.buckets import Bucket
from hvdcompress.compressors import Compressor, GatherCompressor, SummableCompressor
from hvdcompress.exchange.allgather import GatheredExchange
from hvdcompress.exchange.base import _Exchange
from hvdcompress.exchange.summed import SummedExchange
from hvdcompress.exchange.twostage import Piece, TwoStageExchange
from hvdcompress.transports import Transport

EXCHANGES = ("auto", "allgather", "twostage")
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
    return 2.0 * (size - 1) / size * frames + (size - 1)  # + the status byte


def choose_exchanges(
    compressor: Compressor,
    uncompressed: SummableCompressor,
    transport: Transport,
    buckets: list[Bucket],
    mode: str = "auto",
    finish_transport: Transport | None = None,
    per_tensor: bool = False,
) -> dict[int, _Exchange]:
    """The exchange of every bucket (by ``Bucket.index``), for ``exchange=mode``.

    Uncompressed buckets and summable compressors: the allreduce. Gather-only ones:
    "allgather"; "twostage" (ValueError if the compressor is not ``recompressible``, or
    is summable); "auto": the two-stage exchange where its modelled bytes per rank
    (``twostage_bytes``) are fewer than the allgather's (``allgather_bytes``), which needs
    N >= 3 (at N = 2 both move the payload once) and a bucket whose payload outweighs the
    extra headers; compressors that cannot re-compress stay on the allgather. The choice
    depends only on the buckets, N and the compressor's configuration: the same on every
    rank. ``finish_transport``: where the exchanges' ``finish`` starts its collectives
    (``_Exchange.finish_transport``; default ``transport``); ``per_tensor``: two-stage
    shards planned per tensor (``plan_shards_per_tensor``, the DDP hook's)."""
    if mode not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}, got {mode!r}")
    size = transport.size
    if isinstance(compressor, SummableCompressor):
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
    estimate = None
    chosen: dict[int, _Exchange] = {}
    for b in buckets:
        if not b.compressed or isinstance(compressor, SummableCompressor):
            chosen[b.index] = SummedExchange(transport, finish_transport)
            continue
        if mode == "twostage" or (mode == "auto" and compressor.recompressible and size >= 3):
            twostage = TwoStageExchange(
                transport, b, compressor.shard_alignment(), finish_transport, per_tensor
            )
            if mode == "twostage":
                chosen[b.index] = twostage
                continue
            estimate = estimate or estimate_payload(compressor, size)
            numels = [p.numel() for p in b.params]
            if twostage_bytes(size, twostage.plan(b), estimate) < allgather_bytes(
                size, numels, estimate
            ):
                chosen[b.index] = twostage
                continue
        chosen[b.index] = GatheredExchange(transport, finish_transport)
    return chosen
