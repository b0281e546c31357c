"""The allgather of one self-describing frame per rank, decoded by every rank in rank
order."""

from __future__ import annotations

import torch

from hvdcompress import framing
from hvdcompress.buckets import Bucket
from hvdcompress.compressors import GatherCompressor
from hvdcompress.exchange.base import Collective, InFlight, _Exchange, site


class GatheredExchange(_Exchange):
    """Allgather of self-describing byte payloads, decoded by every rank (module doc)."""

    kind = "allgather"

    def start(self, bucket: Bucket, comp: GatherCompressor, grads: list[torch.Tensor]) -> InFlight:
        frame, ctxs = framing.compress_bucket(comp, grads, list(bucket.names))
        if not self.transport.moves_on(frame.device):
            frame = frame.cpu()
        handle = self.transport.start_allgatherv(frame, key=site(bucket, self.kind))
        wire_bytes = float((self.transport.size - 1) * frame.numel())
        return InFlight(ctxs, [Collective(handle, frame.numel(), wire_bytes)], list(grads))

    def _complete(
        self,
        bucket: Bucket,
        comp: GatherCompressor,
        flight: InFlight,
        result: tuple[torch.Tensor, list[int]],
        scale: float,
    ) -> None:
        gathered, sizes = result
        device = flight.grads[0].device
        accs = [torch.zeros(g.numel(), dtype=torch.float32, device=device) for g in flight.grads]
        for rank, frame in enumerate(gathered.split(sizes)):
            # Rank order; NDQSG gets the mean of the lower ranks' tensors (decode_bucket).
            framing.decode_frame(comp, frame, accs, flight.ctxs, rank=rank)
        for grad, acc, ctx in zip(flight.grads, accs, flight.ctxs, strict=True):
            self._write(grad, ctx.name, acc, comp, scale, flight)
