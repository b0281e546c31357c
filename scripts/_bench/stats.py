"""Timing statistics of the benchmarks: the median of repeated calls (CUDA events on a
GPU), how many repeats fill a measurement, the slowest rank's figure, and the spread of
a figure over repeats or seeds."""

from __future__ import annotations

import statistics
import time


def timer(device):
    """``run(fn, reps)``: the median seconds of ``reps`` calls of ``fn`` on ``device`` (a
    torch.device; on a GPU timed with CUDA events)."""
    if device.type == "cuda":
        import torch

        def run(fn, reps):
            times = []
            for _ in range(reps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)

    else:

        def run(fn, reps):
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

    return run


def repeats(run, fn, min_time: float, most: int) -> int:
    """Calls of ``fn`` that take about ``min_time`` seconds (one timed call tells), at
    least 3 and at most ``most``."""
    probe = max(run(fn, 1), 1e-6)
    return int(min(max(min_time / probe, 3), most))


def slowest_rank(allgather, value: float) -> float:
    """The largest of every rank's ``value`` (``allgather``: the ranks' collective that
    returns the list of them): the slowest rank decides a step time."""
    return max(allgather(value))


def stdev(values) -> float:
    """The sample standard deviation; 0 for a single value."""
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 else 0.0


def spread(values) -> dict:
    """Mean, standard deviation (0 for one value), minimum and maximum."""
    values = list(values)
    return {"mean": statistics.fmean(values), "std": stdev(values), "min": min(values),
            "max": max(values)}  # fmt: skip
