"""The exchange: who sends what to whom, per bucket (docs/design.md, "The gradient walk").

Two exchanges, chosen by the compressor's kind:

* ``SummedExchange`` (summable compressors: none, fp16, bf16, PowerSGD): the bucket's
  dense payloads are concatenated and summed by one allreduce per phase; phase p + 1's
  payloads are made from phase p's sums (``next_phase``), then ``decompress`` gives each
  tensor's sum.
* ``GatheredExchange`` (gather-only compressors: 3LC and every byte-coded codec): each
  rank sends one frame per bucket (``wire.frame``: its payloads behind a length table);
  one allgather moves every rank's frame; every rank parses each payload's header once
  and decodes all payloads in rank order into one float32 accumulator per tensor.
  Compressors that decode with side information (NDQSG) get the mean of the lower
  ranks' decoded tensors.

Both scale the sum by ``scale`` (1 / size for an average) and write it into ``p.grad``.
Invariants: every rank starts the same collectives in the same order (bucket order,
phase order); on the gather path every rank decodes the same bytes in the same order,
so all ranks hold bit-identical gradients; a payload that fails to decode raises
``PayloadError`` naming the sending rank and the tensor, on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hvdcompress import wire
from hvdcompress.buckets import Bucket
from hvdcompress.compressors import Compressor, Ctx, GatherCompressor, SummableCompressor
from hvdcompress.stats import CollectiveTiming, StepStats
from hvdcompress.transports import Handle, Transport


@dataclass
class InFlight:
    """A bucket whose collective has started."""

    handle: Handle
    ctxs: list[Ctx]
    payload_bytes: int
    sizes: list[int] = field(default_factory=list)  # summed: elements of each payload


class SummedExchange:
    """Allreduce of dense payloads, one per phase (see module doc)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def start(
        self, bucket: Bucket, comp: SummableCompressor, grads: list[torch.Tensor], stats
    ) -> InFlight:
        payloads, ctxs = [], []
        for name, g in zip(bucket.names, grads, strict=True):
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.reshape(-1))
            ctxs.append(ctx)
        sizes = [p.numel() for p in payloads]
        handle, payload_bytes = self._allreduce(torch.cat(payloads), stats)
        return InFlight(handle, ctxs, payload_bytes, sizes)

    def _allreduce(self, dense: torch.Tensor, stats: StepStats) -> tuple[Handle, int]:
        payload_bytes = dense.numel() * dense.element_size()
        handle = self.transport.start_allreduce_sum(dense)
        size = self.transport.size
        stats.count(payload_bytes, 2.0 * (size - 1) / size * payload_bytes)
        return handle, payload_bytes

    def complete(
        self,
        bucket: Bucket,
        comp: SummableCompressor,
        flight: InFlight,
        summed: torch.Tensor,
        scale: float,
        stats: StepStats,
    ) -> None:
        summed = self._next_phases(comp, flight, summed, stats)
        offset = 0
        for p, ctx, n in zip(bucket.params, flight.ctxs, flight.sizes, strict=True):
            value = comp.decompress(summed[offset : offset + n], ctx)
            offset += n
            if scale != 1.0:
                value = value.to(torch.float32).mul_(scale)
            p.grad.copy_(value.view_as(p.grad))

    def _next_phases(self, comp, flight: InFlight, summed: torch.Tensor, stats) -> torch.Tensor:
        """Phases 2.. of a multi-phase compressor (PowerSGD: P, then Q): every rank runs
        the same phases of the buckets in bucket order, so the collectives match. A phase
        whose payloads are all empty is not sent."""
        for phase in range(1, comp.phases):
            parts = summed.split(flight.sizes)
            nxt = [
                comp.next_phase(part, ctx, phase).reshape(-1)
                for part, ctx in zip(parts, flight.ctxs, strict=True)
            ]
            flight.sizes = [t.numel() for t in nxt]
            dense = torch.cat(nxt)
            if dense.numel():
                t0 = time.perf_counter()
                handle, payload_bytes = self._allreduce(dense, stats)
                summed = handle.wait()
                stats.wait_s += time.perf_counter() - t0
                stats.timings.append(CollectiveTiming(payload_bytes, handle.seconds))
            else:
                summed = dense
        return summed


class GatheredExchange:
    """Allgather of self-describing byte payloads, decoded by every rank (module doc)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def start(
        self, bucket: Bucket, comp: GatherCompressor, grads: list[torch.Tensor], stats
    ) -> InFlight:
        payloads, ctxs = [], []
        for name, g in zip(bucket.names, grads, strict=True):
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.cpu())
            ctxs.append(ctx)
        frame = wire.frame(payloads)
        handle = self.transport.start_allgatherv(frame)
        stats.count(frame.numel(), float((self.transport.size - 1) * frame.numel()))
        return InFlight(handle, ctxs, frame.numel())

    def complete(
        self,
        bucket: Bucket,
        comp: GatherCompressor,
        flight: InFlight,
        result: tuple[torch.Tensor, list[int]],
        scale: float,
        stats: StepStats,
    ) -> None:
        gathered, sizes = result
        device = bucket.device
        accs = [torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in bucket.params]
        offset = 0
        for rank, size in enumerate(sizes):
            frame = gathered[offset : offset + size]
            offset += size
            payloads = wire.unframe(frame, len(bucket.params), rank, bucket.names)
            for payload, acc, ctx in zip(payloads, accs, flight.ctxs, strict=True):
                payload = payload.to(device)
                try:
                    header = wire.parse(payload)
                except wire.PayloadError as err:
                    raise err.locate(rank=rank, tensor=ctx.name) from None
                # NDQSG: the mean of the tensors already decoded (lower ranks), the same on
                # every rank, which decodes the same bytes in the same order.
                side = acc / rank if comp.uses_side_info and rank else None
                comp.decode_parsed(
                    header,
                    payload,
                    expect=ctx,
                    name=ctx.name,
                    rank=rank,
                    out=acc,
                    accumulate=True,
                    side_info=side,
                )
        for p, acc in zip(bucket.params, accs, strict=True):
            if scale != 1.0:
                acc.mul_(scale)
            p.grad.copy_(acc.view_as(p.grad))


def exchange_for(compressor: Compressor, transport: Transport):
    """The exchange a compressor's payloads need."""
    if isinstance(compressor, SummableCompressor):
        return SummedExchange(transport)
    if isinstance(compressor, GatherCompressor):
        return GatheredExchange(transport)
    raise TypeError(
        f"{compressor!r} is neither a GatherCompressor nor a SummableCompressor "
        "(hvdcompress.compressors.base)"
    )
