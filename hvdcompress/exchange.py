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
import warnings
from dataclasses import dataclass, field

import torch

from hvdcompress import wire
from hvdcompress.buckets import Bucket
from hvdcompress.compressors import Compressor, Ctx, GatherCompressor, SummableCompressor
from hvdcompress.transports import Handle, Transport


@dataclass
class Collective:
    """One started collective: this rank's bytes and the ring-model bytes it sends."""

    handle: Handle
    payload_bytes: int
    wire_bytes: float


@dataclass
class InFlight:
    """A bucket whose collective has started; ``finish`` fills in the times."""

    ctxs: list[Ctx]
    collectives: list[Collective]
    sizes: list[int] = field(default_factory=list)  # summed: elements of each payload
    wait_s: float = 0.0
    decode_s: float = 0.0
    overflow: list[str] = field(default_factory=list)  # finite sums that overflowed p.grad
    nonfinite: list[str] = field(default_factory=list)  # sums that were not finite


LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Exchange:
    """What both exchanges share: ``start`` a bucket, ``finish`` it (see module doc)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        """Wait for the bucket's collective, then (unless ``decode`` is False: draining
        after an error) decode and write the gradients; times go into ``flight``."""
        t0 = time.perf_counter()
        result = flight.collectives[0].handle.wait()
        t1 = time.perf_counter()
        flight.wait_s += t1 - t0
        if decode:
            self._complete(bucket, comp, flight, result, scale)
            flight.decode_s += time.perf_counter() - t1

    def _complete(self, bucket, comp, flight, result, scale) -> None:
        raise NotImplementedError

    def _write(self, p, name: str, value: torch.Tensor, comp, scale: float, flight) -> None:
        """Write the sum ``value`` times ``scale`` into ``p.grad`` (docs/design.md,
        "Error feedback and low precision").

        Into a float16 / bfloat16 gradient: a finite float32 value that overflows the
        dtype becomes +-Inf as a cast would (so that GradScaler skips the step and backs
        off), and is reported: ``flight.overflow`` (``StepStats.overflow``) and a
        RuntimeWarning naming the tensor. For an error-feedback compressor the rounding
        of the cast (float32 value minus what was written), where finite, goes into this
        rank's residual, scaled so that over the ranks it adds up to the rounding: every
        rank adds ``rounding / (scale * size)`` (Average: the rounding; Sum: 1 / size of
        it), so the applied gradients plus the residuals keep tracking the true sum."""
        grad = p.grad
        if grad.dtype not in LOW_PRECISION:
            if scale != 1.0:
                value = value.to(torch.float32).mul_(scale)
            grad.copy_(value.view_as(grad))
            return
        value = value.to(torch.float32).reshape(grad.shape)
        if scale != 1.0:
            value = value.mul(scale)
        grad.copy_(value)
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            flight.nonfinite.append(name)  # a real non-finite gradient: stays as it is
            return
        written = grad.to(torch.float32)
        if not bool(torch.isfinite(written).all()):
            flight.overflow.append(name)
            warnings.warn(
                f"hvdcompress: the averaged gradient of {name!r} exceeds the range of "
                f"{grad.dtype} (max |value| {float(value.abs().max()):.6g}) and was written "
                "as Inf; a GradScaler skips this step and lowers its scale",
                RuntimeWarning,
                stacklevel=4,
            )
        if comp.error_feedback:
            rounding = value - written
            rounding = torch.where(torch.isfinite(rounding), rounding, torch.zeros_like(value))
            share = 1.0 / (scale * self.transport.size)
            comp.absorb(name, rounding if share == 1.0 else rounding * share)


class SummedExchange(_Exchange):
    """Allreduce of dense payloads, one per phase (see module doc)."""

    def start(
        self, bucket: Bucket, comp: SummableCompressor, grads: list[torch.Tensor]
    ) -> InFlight:
        payloads, ctxs = [], []
        for name, g in zip(bucket.names, grads, strict=True):
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.reshape(-1))
            ctxs.append(ctx)
        sizes = [p.numel() for p in payloads]
        return InFlight(ctxs, [self._allreduce(torch.cat(payloads))], sizes)

    def _allreduce(self, dense: torch.Tensor) -> Collective:
        payload_bytes = dense.numel() * dense.element_size()
        size = self.transport.size
        handle = self.transport.start_allreduce_sum(dense)
        return Collective(handle, payload_bytes, 2.0 * (size - 1) / size * payload_bytes)

    def _complete(
        self,
        bucket: Bucket,
        comp: SummableCompressor,
        flight: InFlight,
        summed: torch.Tensor,
        scale: float,
    ) -> None:
        summed = self._next_phases(comp, flight, summed)
        offset = 0
        for p, ctx, n in zip(bucket.params, flight.ctxs, flight.sizes, strict=True):
            value = comp.decompress_exact(summed[offset : offset + n], ctx)
            offset += n
            self._write(p, ctx.name, value, comp, scale, flight)

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
                t0 = time.perf_counter()
                collective = self._allreduce(dense)
                flight.collectives.append(collective)
                summed = collective.handle.wait()
                flight.wait_s += time.perf_counter() - t0
            else:
                summed = dense
        return summed


class GatheredExchange(_Exchange):
    """Allgather of self-describing byte payloads, decoded by every rank (module doc)."""

    def start(self, bucket: Bucket, comp: GatherCompressor, grads: list[torch.Tensor]) -> InFlight:
        payloads, ctxs = [], []
        for name, g in zip(bucket.names, grads, strict=True):
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.cpu())
            ctxs.append(ctx)
        frame = wire.frame(payloads)
        handle = self.transport.start_allgatherv(frame)
        wire_bytes = float((self.transport.size - 1) * frame.numel())
        return InFlight(ctxs, [Collective(handle, frame.numel(), wire_bytes)])

    def _complete(
        self,
        bucket: Bucket,
        comp: GatherCompressor,
        flight: InFlight,
        result: tuple[torch.Tensor, list[int]],
        scale: float,
    ) -> None:
        gathered, sizes = result
        device = bucket.params[0].device
        accs = [torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in bucket.params]
        offset = 0
        for rank, size in enumerate(sizes):
            frame = gathered[offset : offset + size]
            offset += size
            parsed = wire.unframe_parsed(frame, rank, bucket.names, device)
            for (header, payload), acc, ctx in zip(parsed, accs, flight.ctxs, strict=True):
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
        for p, acc, ctx in zip(bucket.params, accs, flight.ctxs, strict=True):
            self._write(p, ctx.name, acc, comp, scale, flight)


def exchange_for(compressor: Compressor, transport: Transport) -> _Exchange:
    """The exchange a compressor's payloads need."""
    if isinstance(compressor, SummableCompressor):
        return SummedExchange(transport)
    if isinstance(compressor, GatherCompressor):
        return GatheredExchange(transport)
    raise TypeError(
        f"{compressor!r} is neither a GatherCompressor nor a SummableCompressor "
        "(hvdcompress.compressors.base)"
    )
