"""What both adapters (``DistributedOptimizer`` and the DDP hook) do alike, written once:
the accounting of a step's ``StepStats`` from the buckets they finish, and the checkpoint
envelope of a rank's compressor state (docs/checkpoints-and-faults.md).

Invariants: a step's stats count every gradient element handed to an exchange once and
every finished exchange's collectives once, whichever adapter drove it; a state saved by
either adapter loads into either, by one rule for another rank's state
(``checkpoint.without_other_ranks_state``: it loads without that rank's residuals, with a
warning) and one check (``checkpoint.check_optimizer_state``).
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch

from hvdcompress.buckets import PieceKey
from hvdcompress.checkpoint import check_optimizer_state, without_other_ranks_state
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.stats import StepStats

__all__ = ["StepAccount", "check_rank_state", "load_rank_state", "piece_shapes", "rank_state"]


class StepAccount:
    """The ``StepStats`` of the step in progress (``current``) and of the last one ended
    (``last``). An adapter reports what it hands to an exchange (``started``), what the
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

    def allreduced(self, buffer: torch.Tensor, size: int) -> None:
        """A buffer summed by one ring allreduce outside any exchange (the DDP hook's
        bucket with nothing to compress): its bytes by the ring model."""
        stats = self.current
        nbytes = buffer.numel() * buffer.element_size()
        stats.numel += buffer.numel()
        stats.raw_bytes += nbytes
        stats.payload_bytes += nbytes
        stats.wire_bytes += 2.0 * (size - 1) / size * nbytes
        stats.sent_bytes += (2 * (size - 1) * nbytes) // size
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


def rank_state(transport, compressor) -> dict:
    """The envelope of this rank's compressor state (its residuals among it), tagged with
    the rank, the job size and the compressor's configuration."""
    return {
        "rank": transport.rank,
        "size": transport.size,
        "compressor": repr(compressor),
        "compressor_state": compressor.state_dict(),
    }


def check_rank_state(state, transport, compressor, shapes) -> dict:
    """``state`` (a ``rank_state``, maybe another rank's) as this rank loads it: another
    rank's of the same job size without that rank's residuals (with a warning), then
    checked against this rank, job size, compressor and the tensors' ``shapes`` (a
    callable of the state where the shapes depend on it); ``CheckpointError`` naming the
    entry otherwise."""
    if isinstance(state, dict):
        state = without_other_ranks_state(dict(state), transport.rank, transport.size)
    check_optimizer_state(
        state,
        rank=transport.rank,
        size=transport.size,
        compressor=repr(compressor),
        shapes=shapes(state) if callable(shapes) else shapes,
    )
    return state


def load_rank_state(state: dict, compressor, policy=None, then=None):
    """Load a checked ``state`` (``check_rank_state``): the compressor's part, the
    policy's where both exist, then ``then()`` (the inner optimizer's state), whose value
    is returned. On any error nothing stays loaded: the compressor's state, its per-tensor
    levels and the policy's are put back as they were, and the cause is raised."""
    # a policy's per-tensor levels (DQSG's and QSGD's ``levels`` is their int parameter)
    levels = compressor.levels if isinstance(compressor, PerTensorLevels) else None
    before = (
        compressor.state_dict(),
        dict(levels) if levels is not None else None,
        copy.deepcopy(policy.state_dict()) if policy is not None else None,
    )
    try:
        compressor.load_state_dict(state["compressor_state"])
        if "policy" in state and policy is not None:
            policy.load_state_dict(state["policy"])
        return then() if then is not None else None
    except BaseException:
        with contextlib.suppress(Exception):  # put back what was there; raise the cause
            compressor.load_state_dict(before[0])
            if policy is not None:
                policy.load_state_dict(before[2])
            if levels is not None:
                levels.clear()
                levels.update(before[1])
        raise


def piece_shapes(state: dict, shapes: dict, guess: bool) -> dict:
    """``shapes`` (the tensors' names and shapes known so far) with those of ``state``'s
    two-stage pieces: where the buckets, and so the pieces, are known only once they are
    handed over (DDP's), a piece of a known tensor is accepted where it lies within that
    tensor. With ``guess`` (no names met yet: before the first bucket), the residuals' own
    sizes too, which the compressor checks when it first uses them."""
    shapes = dict(shapes)
    comp = state.get("compressor_state") if isinstance(state, dict) else None
    entries = (
        {k: v for k, v in comp.items() if isinstance(v, dict)} if isinstance(comp, dict) else {}
    )
    if guess:
        for key in ("residuals", "velocity"):
            for name, t in entries.get(key, {}).items():
                if isinstance(t, torch.Tensor) and not PieceKey.parse(name):
                    shapes.setdefault(name, (int(t.numel()),))
    tensors = dict(shapes)  # a piece lies within one of these, not within another piece
    for name in {n for entry in entries.values() for n in entry if isinstance(n, str)}:
        piece = PieceKey.parse(name)
        if piece and piece.name in tensors:
            if piece.start < piece.stop <= math.prod(tensors[piece.name]):
                shapes[name] = (piece.stop - piece.start,)
    return shapes
