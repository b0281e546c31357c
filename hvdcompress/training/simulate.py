"""Train N ranks in one process: N threads on a ``transports.simulated.SimulatedWorld``
(docs/horovod-parity.md, "The simulated world", for why threads and why the digests
equal a real run's).

``run_ranks(size, fn)`` calls ``fn(transport)`` once per rank, each in its own thread with
that rank's ``SimulatedTransport``, and returns the results in rank order; ``fn`` is the
per-rank program of a real run. Determinism: ``seeded`` serialises the one use of torch's
process-wide random generator (building the initial model), and each rank should get the
intra-op thread count a real rank would have (some CPU kernels sum in an order that
depends on it). A rank that raises aborts the world (the others raise ``SimulatedAbort``
at their next collective) and ``run_ranks`` re-raises the first root cause, lowest rank
first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from hvdcompress.transports.simulated import (
    RankMismatch,
    SimulatedAbort,
    SimulatedTransport,
    SimulatedWorld,
)

T = TypeVar("T")
_GLOBAL_RNG = threading.Lock()

__all__ = [
    "RankMismatch",
    "SimulatedAbort",
    "SimulatedTransport",
    "SimulatedWorld",
    "run_ranks",
    "seeded",
]


def seeded(seed: int, build: Callable[[], T]) -> T:
    """``build()`` right after ``torch.manual_seed(seed)``, one thread at a time: torch's
    default generator is per process, so simulated ranks building their models at once
    would interleave their draws. In a real run (one thread) it is exactly
    ``torch.manual_seed(seed); build()``."""
    with _GLOBAL_RNG:
        torch.manual_seed(seed)
        return build()


def run_ranks(size: int, fn: Callable[[SimulatedTransport], T]) -> list[T]:
    """``[fn(rank 0's transport), ..., fn(rank size-1's)]``, the ranks running in threads
    of this process on one ``SimulatedWorld`` (see the module doc)."""
    world = SimulatedWorld(size)
    results: list = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(world.transport(rank))
        except BaseException as err:  # noqa: BLE001 - re-raised by run_ranks
            errors[rank] = err
            world.abort(f"rank {rank} failed: {type(err).__name__}: {err}")
        finally:
            world.returned(rank)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"hvdcompress-sim-rank{r}", daemon=True)
        for r in range(size)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException as err:  # Ctrl-C: stop every rank at its next collective
        world.abort(f"the runner was interrupted: {type(err).__name__}")
        raise
    failed = [e for e in errors if e is not None]
    if failed:
        causes = [e for e in failed if not isinstance(e, SimulatedAbort)]
        raise (causes or failed)[0]
    return results
