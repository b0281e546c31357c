"""What a scripts/train.py rank sent, summed over its steps: the bytes of the ring model
(docs/exchanges.md) against an uncompressed allreduce, the bytes the transport counted,
and the payload bits per gradient value, per evaluation and over every rank and the run.

Every rank keeps its own counts; the sums over ranks are small collectives that every
rank enters at the same points (each evaluation, the end), so that no rank waits alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hvdcompress.stats import StepStats


@dataclass
class RunTraffic:
    """This rank's counts; ``bits`` / ``values``: since the last evaluation;
    ``bits_ranks`` / ``values_ranks``: every rank's, from the start to the last one."""

    size: int  # ranks
    wire: float = 0.0  # the ring model's bytes this rank sends
    raw: float = 0.0  # what an uncompressed ring allreduce would send
    sent: float = 0.0  # what the transport counted
    received: float = 0.0
    bits: float = 0.0
    values: float = 0.0
    bits_ranks: float = 0.0
    values_ranks: float = 0.0
    # bucket-steps per exchange option ("allgather", "twostage", "dense", ...), the
    # steps exchange="auto" spent timing its options left out: what trained the model
    exchanges: Counter = field(default_factory=Counter)

    def add(self, stats: StepStats) -> None:
        """One step's statistics."""
        if not stats.tuning:
            self.exchanges.update(stats.exchanges.values())
        self.wire += stats.wire_bytes
        self.sent += stats.sent_bytes
        self.received += stats.received_bytes
        self.raw += 2.0 * (self.size - 1) / self.size * stats.raw_bytes
        self.bits += 8.0 * stats.payload_bytes
        self.values += stats.numel

    def end_evaluation(self, dist) -> tuple[float, float]:
        """Every rank: (payload bits, gradient values) of every rank since the last
        evaluation, one small sum."""
        bits, values = dist.sum_floats([self.bits, self.values])
        self.bits = self.values = 0.0
        self.bits_ranks += bits
        self.values_ranks += values
        return bits, values

    def transport_means(self, dist) -> tuple[float, float]:
        """Every rank: (sent, received) bytes as the transport counted, mean over ranks."""
        sent, received = dist.sum_floats([self.sent, self.received])
        return sent / self.size, received / self.size

    @property
    def traffic_saved(self) -> float:
        """The fraction of an uncompressed allreduce's bytes not sent."""
        return 1.0 - self.wire / self.raw if self.raw else 0.0

    @property
    def bits_per_value_ranks(self) -> float:
        return self.bits_ranks / max(self.values_ranks, 1.0)
