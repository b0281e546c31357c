"""The allreduce of summable compressors' dense payloads, one per phase."""

from __future__ import annotations

import torch

from hvdcompress.buckets import Bucket
from hvdcompress.compressors import SummableCompressor
from hvdcompress.exchange.base import Collective, InFlight, _Exchange, waited
from hvdcompress.stats import ring_allreduce_bytes


class SummedExchange(_Exchange):
    """Allreduce of dense payloads, one per phase (see module doc)."""

    kind = "allreduce"

    def start(
        self, bucket: Bucket, comp: SummableCompressor, grads: list[torch.Tensor]
    ) -> InFlight:
        payloads, ctxs = [], []
        for name, g in zip(bucket.names, grads, strict=True):
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.reshape(-1))
            ctxs.append(ctx)
        sizes = [p.numel() for p in payloads]
        return InFlight(ctxs, [self._allreduce(torch.cat(payloads))], list(grads), sizes)

    def _allreduce(self, dense: torch.Tensor, transport=None) -> Collective:
        payload_bytes = dense.numel() * dense.element_size()
        size = self.transport.size
        handle = (transport or self.transport).start_allreduce_sum(dense)
        return Collective(handle, payload_bytes, ring_allreduce_bytes(size, payload_bytes))

    def _complete(
        self,
        bucket: Bucket,
        comp: SummableCompressor,
        flight: InFlight,
        summed: torch.Tensor,
        scale: float,
    ) -> None:
        summed = self._next_phases(comp, flight, summed)
        parts = summed.split(flight.sizes)
        for grad, ctx, part in zip(flight.grads, flight.ctxs, parts, strict=True):
            if grad.dtype == torch.float32 and comp.decompress_into(part, ctx, grad, scale):
                continue
            self._write(grad, ctx.name, comp.decompress_exact(part, ctx), comp, scale, flight)

    def _next_phases(self, comp, flight: InFlight, summed: torch.Tensor) -> torch.Tensor:
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
                collective = self._allreduce(dense, self.finish_transport)
                flight.collectives.append(collective)
                summed = waited(flight, collective)
            else:
                summed = dense
        return summed
