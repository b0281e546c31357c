"""Seconds a transport's collectives take, as affine models fitted to timings made on
the transport itself at start (docs/exchanges.md, "Choosing the exchange"; CAT's model:
docs/policies.md, "CAT"). Every rank fits the same numbers: the timings are pooled with
one ``allgather_object`` and averaged in rank order.

``calibrate`` fits the seconds of one allgatherv by the bits each rank sends (CAT's
cost of a payload); ``calibrate_link`` fits all three collectives the exchanges use, by
the bytes each rank hands them, for ``exchange="auto"`` with ``link_cost="measure"``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch


class CostModel:
    """Seconds to send a payload of ``bits``; ``observe`` / ``refit`` refresh c0, c1."""

    def __init__(self, c0: float, c1: float) -> None:
        self.c0, self.c1 = float(c0), float(c1)
        self.observations: list[tuple[float, float]] = []

    def units(self, bits):
        return np.asarray(bits, dtype=np.float64)

    def __call__(self, bits):
        return self.c0 + self.c1 * self.units(bits)

    def observe(self, bits: float, seconds: float, keep: int = 1000) -> None:
        self.observations.append((float(bits), float(seconds)))
        del self.observations[:-keep]

    def refit(self) -> bool:
        """Least squares on the observations; False (unchanged) with too few distinct sizes."""
        if len({b for b, _ in self.observations}) < 2:
            return False
        bits, secs = zip(*self.observations, strict=True)
        self.c0, self.c1 = fit_affine(self.units(bits), secs)
        return True


class AffineCost(CostModel):
    """C = c0 + c1 * bits."""

    def __repr__(self) -> str:
        return f"AffineCost(c0={self.c0:.3g}, c1={self.c1:.3g})"


class PacketCost(CostModel):
    """C = c0 + c1 * ceil(bits / packet_bits)."""

    def __init__(self, c0: float, c1: float, packet_bits: int) -> None:
        super().__init__(c0, c1)
        if packet_bits < 1:
            raise ValueError(f"packet_bits must be >= 1, got {packet_bits!r}")
        self.packet_bits = int(packet_bits)

    def units(self, bits):
        return np.ceil(np.asarray(bits, dtype=np.float64) / self.packet_bits)

    def __repr__(self) -> str:
        return f"PacketCost(c0={self.c0:.3g}, c1={self.c1:.3g}, packet_bits={self.packet_bits})"


def fit_affine(x, y) -> tuple[float, float]:
    """(c0, c1) minimising sum (c0 + c1 x - y)^2, kept physical: noisy timings can fit a
    negative c0 (which would make CAT pick T = 1), so then c0 = the smallest measured time
    (the fixed cost of the smallest payload) and c1 is refitted without intercept; c1 >= 0.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)
    (c0, c1), *_ = np.linalg.lstsq(design, y, rcond=None)
    if c0 < 0:
        c0 = float(y.min())
        denom = float((x * x).sum())
        c1 = float((x * (y - c0)).sum()) / denom if denom > 0 else 0.0
    return float(c0), max(float(c1), 0.0)


def calibrate(
    transport,
    sizes=(1, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22),
    repeats: int = 5,
    clock=time.perf_counter,
    packet_bits: int | None = None,
) -> CostModel:
    """Time the transport's allgatherv over payload ``sizes`` (bytes; every rank must call
    it with the same arguments) and fit an affine (or, with ``packet_bits``, a packet) model.
    """
    medians = []
    for size in sizes:
        local = torch.zeros(int(size), dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            t0 = clock()
            transport.start_allgatherv(local).wait()
            times.append(clock() - t0)
        medians.append(statistics.median(times))
    everyone = transport.allgather_object(medians)  # every rank fits the same numbers
    mean = [sum(r[i] for r in everyone) / len(everyone) for i in range(len(sizes))]
    model = AffineCost(0.0, 0.0) if packet_bits is None else PacketCost(0.0, 0.0, packet_bits)
    for size, t in zip(sizes, mean, strict=True):
        model.observe(8.0 * size, t)
    model.refit()
    return model


COLLECTIVES = ("allgatherv", "allreduce", "alltoallv")


@dataclass(frozen=True)
class LinkCost:
    """Seconds ``c0 + c1 * bytes`` of each collective, by the bytes one rank hands it:
    ``allgatherv`` its part (every rank receives every part), ``allreduce`` the dense
    tensor, ``alltoallv`` all its parts together. Each field is ``(c0, c1)``."""

    allgatherv: tuple[float, float]
    allreduce: tuple[float, float]
    alltoallv: tuple[float, float]

    def seconds(self, collective: str, nbytes: float) -> float:
        c0, c1 = getattr(self, collective)
        return c0 + c1 * float(nbytes)


def _collective(transport, kind: str, nbytes: int):
    if kind == "allgatherv":
        return transport.start_allgatherv(torch.zeros(nbytes, dtype=torch.uint8))
    if kind == "allreduce":
        return transport.start_allreduce_sum(torch.zeros(max(nbytes // 4, 1)))
    part = torch.zeros(nbytes // transport.size, dtype=torch.uint8)
    return transport.start_alltoallv([part.clone() for _ in range(transport.size)])


def calibrate_link(
    transport, sizes=(1 << 10, 1 << 15, 1 << 18), repeats: int = 3, clock=time.perf_counter
) -> LinkCost:
    """Time each collective of ``COLLECTIVES`` at every size (bytes per rank; the median
    of ``repeats`` after one untimed warm-up) and fit ``LinkCost``. Collective: every
    rank calls it with the same arguments; each rank sends about ``4 (size + 2)
    sum(sizes)`` bytes (6 MB at 4 ranks)."""
    medians = []
    for kind in COLLECTIVES:
        for nbytes in sizes:
            _collective(transport, kind, int(nbytes)).wait()
            times = []
            for _ in range(repeats):
                t0 = clock()
                _collective(transport, kind, int(nbytes)).wait()
                times.append(clock() - t0)
            medians.append(statistics.median(times))
    everyone = transport.allgather_object(medians)
    mean = [sum(r[i] for r in everyone) / len(everyone) for i in range(len(medians))]
    fits = {}
    for k, kind in enumerate(COLLECTIVES):
        fits[kind] = fit_affine(list(sizes), mean[k * len(sizes) : (k + 1) * len(sizes)])
    return LinkCost(**fits)
