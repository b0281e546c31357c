"""What the exchanges share: a started bucket (``InFlight``), its collectives, and the
write of an averaged gradient (``_Exchange._write``); the package docstring has the rest."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from hvdcompress.buckets import Bucket
from hvdcompress.compressors import Ctx
from hvdcompress.transports import Handle, Transport


@dataclass
class Collective:
    """One started collective: this rank's bytes and the ring-model bytes it sends."""

    handle: Handle
    payload_bytes: int
    wire_bytes: float


@dataclass
class InFlight:
    """A bucket whose collective has started; ``finish`` writes ``grads`` in place and
    fills in the times. No future of its own: the adapter that drives the exchange makes
    the one future its caller waits on (the DDP hook's), so each hook call makes one."""

    ctxs: list[Ctx]
    collectives: list[Collective]
    grads: list[torch.Tensor]  # the gradients handed to start: averaged in place
    sizes: list[int] = field(default_factory=list)  # summed: elements of each payload
    wait_s: float = 0.0
    decode_s: float = 0.0
    overflow: list[str] = field(default_factory=list)  # finite sums that overflowed the gradient
    nonfinite: list[str] = field(default_factory=list)  # sums that were not finite
    shards: list = field(default_factory=list)  # two-stage: the plan_shards of this bucket
    stages: object = None  # hierarchical: what its later stages need (_Stages)


def waited(flight: InFlight, collective: Collective):
    """``collective``'s result, the time waited for it counted in ``flight.wait_s``."""
    t0 = time.perf_counter()
    result = collective.handle.wait()
    flight.wait_s += time.perf_counter() - t0
    return result


def site(bucket: Bucket, stage: str) -> tuple:
    """The key of a bucket's collective of ``stage`` (``Transport.start_allgatherv``): the
    same on every rank, and one per stream of payloads, so that the capacity of its slots
    (``transports.slots``) follows that bucket's payloads only: by the bucket's tensor
    names, which two optimizers sharing a transport do not share, unlike bucket indices."""
    return (tuple(bucket.names), stage)


LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Exchange:
    """What the exchanges share: ``start`` a bucket, ``finish`` it (see module doc)."""

    kind = ""  # "allreduce", "allgather" or "twostage"

    def __init__(self, transport: Transport, finish_transport: Transport | None = None) -> None:
        self.transport = transport
        # the collectives ``finish`` starts (two-stage's stage 2, PowerSGD's later
        # phases): on another transport when ``finish`` runs on another thread than
        # ``start`` (the DDP hook's finisher), so that each transport's collectives are
        # started from one thread, in one order on every rank
        self.finish_transport = finish_transport or transport

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Compressor state names this exchange adds beyond the tensors' own, with their
        shapes (checked when a checkpoint is loaded); none but for the two-stage one."""
        return {}

    def residual_keys(self, bucket: Bucket, comp) -> set:
        """The compressor state keys (error-feedback residuals) this exchange keeps for
        ``bucket``'s tensors on this rank: the tensors' own names (the allgather, the
        allreduce); the two-stage and hierarchical exchanges keep pieces instead."""
        return set(bucket.names)

    def finish(
        self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool
    ) -> list[torch.Tensor] | None:
        """Wait for the bucket's collectives, then (unless ``decode`` is False: draining
        after an error, nothing written) decode and write the gradients; times go into
        ``flight``. Returns the averaged gradients (``flight.grads``, the tensors ``start``
        was handed), None when draining; a decode error is raised (``PayloadError``)."""
        self._finish(bucket, comp, flight, scale, decode)
        return flight.grads if decode else None

    def _finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        result = waited(flight, flight.collectives[0])
        if decode:
            t0, waited_before = time.perf_counter(), flight.wait_s
            self._complete(bucket, comp, flight, result, scale)
            # the waits of later stages or phases inside _complete are wait, not decode
            flight.decode_s += time.perf_counter() - t0 - (flight.wait_s - waited_before)

    def _complete(self, bucket, comp, flight, result, scale) -> None:
        raise NotImplementedError

    def _write(
        self, grad: torch.Tensor, name: str, value: torch.Tensor, comp, scale: float, flight
    ) -> None:
        """Write the sum ``value`` times ``scale`` into ``grad``. Into a float16 / bfloat16
        gradient (docs/error-feedback.md): a finite value past the dtype's range becomes
        +-Inf as a cast would, reported in ``flight.overflow`` with a RuntimeWarning; the
        cast's finite rounding goes back into the residuals (``_absorb_rounding``)."""
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
            self._absorb_rounding(comp, name, rounding, scale, flight)

    def _absorb_rounding(
        self, comp, name: str, rounding: torch.Tensor, scale: float, flight
    ) -> None:
        """This rank's share of the rounding of a low-precision write (``_write``) into
        the residual that sends it again: every rank adds ``rounding / (scale * size)``
        to its residual of ``name``."""
        share = 1.0 / (scale * self.transport.size)
        comp.absorb(name, rounding if share == 1.0 else rounding * share)
