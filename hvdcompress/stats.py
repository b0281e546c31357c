"""What one step moved: the record ``synchronize()`` fills and policies read.

``DistributedOptimizer.last_stats`` is the ``StepStats`` of the last step; a policy's
``after_step(stats)`` gets the current step's (CAT fits its cost model to
``stats.timings``, one ``CollectiveTiming`` per collective). ``StepAccount`` fills them
for the reducer (``hvdcompress.reducer``); ``ring_allreduce_bytes`` is the one ring
model of an allreduce's bytes.

Invariant: a step's stats count every gradient element handed to an exchange once and
every finished exchange's collectives once, whichever adapter drove it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


def ring_allreduce_bytes(size: int, nbytes: float) -> float:
    """Bytes one rank sends (and receives) in a ring allreduce of ``nbytes`` over
    ``size`` ranks: ``2 (size - 1) / size * nbytes`` (a reduce-scatter, then an
    allgather, each moving ``(size - 1) / size`` of the buffer)."""
    return 2 * (size - 1) * nbytes / size


@dataclass
class Traffic:
    """Running totals of one transport (``Transport.traffic``): bytes this rank sent and
    received in collectives, counted by the transport base class (hvdcompress.transports)."""

    sent: int = 0
    received: int = 0
    collectives: int = 0
    rounds: int = 0  # the underlying collectives (rounds) of the waited-for ones


class CollectiveTiming(NamedTuple):
    """One collective of a step: the bytes this rank handed to the transport and how long
    the collective took (``transports.Handle.seconds``; None when it is not known)."""

    payload_bytes: int
    seconds: float | None


@dataclass
class StepStats:
    """Bytes, bits per value and time of one ``synchronize()``."""

    numel: int = 0  # gradient elements
    raw_bytes: int = 0  # uncompressed gradient bytes
    payload_bytes: int = 0  # bytes this rank handed to the transport
    wire_bytes: float = 0.0  # bytes this rank sends (ring model, docs/exchanges.md)
    # bytes this rank sent / received, as the transport counted them (Handle.sent_bytes)
    sent_bytes: int = 0
    received_bytes: int = 0
    collectives: int = 0
    rounds: int = 0  # underlying collectives of those (a size round counts: Handle.rounds)
    compress_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0
    metrics: dict = field(default_factory=dict)  # compressor's and policy's pop_metrics()
    timings: list[CollectiveTiming] = field(default_factory=list)
    # tensors whose finite averaged gradient overflowed their float16 / bfloat16 p.grad
    # (written as Inf, with a RuntimeWarning), and those whose sum was not finite
    overflow: list[str] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    # the option each bucket took (by bucket index: "allgather", "twostage",
    # "hierarchical", "allreduce" or "dense"), and whether exchange="auto" was timing
    # its options in this step (exchange.tuning)
    exchanges: dict = field(default_factory=dict)
    tuning: bool = False

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.payload_bytes / max(self.numel, 1)

    def add(self, flight) -> None:
        """A finished bucket (``exchange.InFlight``): its collectives and times."""
        for c in flight.collectives:
            self.payload_bytes += c.payload_bytes
            self.wire_bytes += c.wire_bytes
            self.collectives += 1
            self.sent_bytes += c.handle.sent_bytes
            self.received_bytes += c.handle.received_bytes or 0
            self.rounds += c.handle.rounds or 0
            if c.handle.ended is not None:  # waited for
                self.timings.append(CollectiveTiming(c.payload_bytes, c.handle.seconds))
        self.wait_s += flight.wait_s
        self.decode_s += flight.decode_s
        self.overflow += flight.overflow
        self.nonfinite += flight.nonfinite


class StepAccount:
    """The ``StepStats`` of the step in progress (``current``) and of the last one ended
    (``last``). The reducer reports what it hands to an exchange (``started``), what the
    exchange moved (``finished``) and ends the step (``end``)."""

    def __init__(self) -> None:
        self.current = StepStats()
        self.last = StepStats()

    def started(self, grads: list[torch.Tensor], seconds: float) -> None:
        """Gradients handed to an exchange, and the seconds their encode (inline: their
        collectives too) took."""
        stats = self.current
        stats.numel += sum(g.numel() for g in grads)
        stats.raw_bytes += sum(g.numel() * g.element_size() for g in grads)
        stats.compress_s += seconds

    def finished(self, flight) -> None:
        """A finished exchange's ``InFlight``: its collectives and times."""
        self.current.add(flight)

    def sent_sparse(self, nbytes: int) -> None:
        """One sparse gradient's own collective (the optimizer's, as in Horovod)."""
        self.current.collectives += 1
        self.current.payload_bytes += nbytes

    def allreduced(self, buffer: torch.Tensor, size: int, sent: torch.Tensor | None = None) -> None:
        """A buffer summed by one ring allreduce outside any exchange (the DDP hook's
        bucket with nothing to compress; ``sent``: the buffer as sent, cast to 16 bits):
        its bytes by the ring model."""
        stats = self.current
        sent = buffer if sent is None else sent
        nbytes = sent.numel() * sent.element_size()
        ring = ring_allreduce_bytes(size, nbytes)
        stats.numel += buffer.numel()
        stats.raw_bytes += buffer.numel() * buffer.element_size()
        stats.payload_bytes += nbytes
        stats.wire_bytes += ring
        stats.sent_bytes += int(ring)
        stats.collectives += 1
        stats.rounds += 1

    def end(self, compressor, policy=None) -> None:
        """End the step: its metrics are the compressor's (and ``policy``'s, which first
        sees the step's stats: ``Policy.after_step``); it becomes ``last``."""
        stats = self.current
        stats.metrics = compressor.pop_metrics()
        if policy is not None:
            policy.after_step(stats)  # every collective of the step is done
            stats.metrics = {**stats.metrics, **policy.pop_metrics()}
        self.last, self.current = stats, StepStats()
