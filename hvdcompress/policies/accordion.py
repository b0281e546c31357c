"""Accordion (Agarwal et al., MLSys 2021, arXiv 2010.16248; docs/policies.md, "Accordion",
for the intervals, the learning-rate override and the level pairs).

Per tensor, the norm of the uncompressed local gradient summed over an interval (the sum
of the gradients, then its norm: the paper's accumulated gradient, in which the steps'
noise largely cancels; a sum of the steps' norms is mostly noise and hardly moves) is
averaged over ranks (one small collective, in rank order, so every rank decides the same)
and compared with the previous interval's:

    ratio = |n_prev - n_cur| / n_prev       (n_prev == 0 counts as critical)
    ratio >= eta  -> critical -> ``low`` (the level of low compression)
    otherwise     -> ``high``

The first interval uses ``low``, and every tensor does after a learning-rate drop.
"""

from __future__ import annotations

import math

import torch

from hvdcompress import checks
from hvdcompress.checkpoint import (
    CheckpointError,
    check_dict,
    check_finite_number,
    check_keys,
    check_names,
    check_tensor_map,
)
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.policies.base import Policy, checked_levels


def accordion_critical(prev, cur, eta: float = 0.5) -> list[bool]:
    """Per tensor, True when the regime is critical (use low compression)."""
    out = []
    for p, c in zip(prev, cur, strict=True):
        p, c = float(p), float(c)
        out.append(p == 0.0 or not math.isfinite(p) or abs(p - c) / p >= eta)
    return out


class Accordion(Policy):
    """Switch every tensor between the levels ``low`` and ``high`` (see module doc)."""

    def __init__(self, low, high, eta: float = 0.5, interval_steps: int | None = None) -> None:
        self.low, self.high = low, high
        self.eta = checks.number("eta", eta, 0.0, open_low=True)
        self.interval_steps = (
            None if interval_steps is None else checks.integer("interval_steps", interval_steps, 1)
        )
        self.names: list[str] = []
        self.current: dict[str, object] = {}  # level in force per tensor
        self.history: list[dict] = []  # one record per decision
        self._sums: dict[str, torch.Tensor] = {}  # the interval's gradient sum per tensor
        self._prev: list[float] | None = None
        self._steps = 0
        self._lr_at_decision: list[float] | None = None
        self._fresh_interval = True
        self._metrics: dict = {}
        self._compressor = self._transport = self._optimizer = None

    def __repr__(self) -> str:
        return (
            f"Accordion(low={self.low}, high={self.high}, eta={self.eta}, "
            f"interval_steps={self.interval_steps})"
        )

    # ---- called by the optimizer ------------------------------------------------------------
    def bind(self, optimizer, compressor, transport, names: list[str]) -> None:
        if not isinstance(compressor, PerTensorLevels):
            raise TypeError(
                f"Accordion needs a compressor with per-tensor levels (3lc, topk, powersgd), "
                f"got {compressor!r}"
            )
        for value in (self.low, self.high):
            compressor.levels.check(value)  # refuse a wrong level now, not mid-training
        self._optimizer, self._compressor, self._transport = optimizer, compressor, transport
        self.names = list(names)
        self._sums = {}
        self._apply(dict.fromkeys(self.names, True), reason="first")

    def observe(self, name: str, grad) -> None:
        if self._fresh_interval:
            self._fresh_interval = False
            if self._lr_dropped():  # the scheduler stepped after the decision
                self._apply(dict.fromkeys(self.names, True), reason="lr_drop")
        # summed in float32 where the gradient is read for compression
        g = grad.detach().reshape(-1)
        total = self._sums.get(name)
        if total is None or total.numel() != g.numel():  # a sum of another size: not kept
            self._sums[name] = g.to(torch.float32, copy=True)
        else:
            if total.device != g.device:  # a checkpoint's sum, loaded on the CPU
                total = self._sums[name] = total.to(g.device)
            total.add_(g)

    def after_step(self, stats) -> None:
        self._steps += 1
        self._metrics = {f"level/{n}": v for n, v in self.current.items()}
        if self.interval_steps is not None and self._steps % self.interval_steps == 0:
            self.end_interval()

    # ---- called by the training loop -------------------------------------------------------
    def end_epoch(self) -> None:
        """Interval end when ``interval_steps`` is None (every rank must call it)."""
        if self.interval_steps is None:
            self.end_interval()

    def end_interval(self) -> None:
        local = [float(self._sums[n].norm()) if n in self._sums else 0.0 for n in self.names]
        gathered = self._transport.allgather_object(local)  # one small collective
        size = len(gathered)
        cur = [sum(g[i] for g in gathered) / size for i in range(len(self.names))]
        if self._lr_dropped():
            critical, reason = [True] * len(cur), "lr_drop"
        elif self._prev is None:
            critical, reason = [True] * len(cur), "first"
        else:
            critical, reason = accordion_critical(self._prev, cur, self.eta), "norms"
        self._prev = cur
        for total in self._sums.values():
            total.zero_()
        self._fresh_interval = True
        self._apply(dict(zip(self.names, critical, strict=True)), reason=reason, norms=cur)

    # ---- helpers -----------------------------------------------------------------------------
    def _lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self._optimizer.param_groups]

    def _lr_dropped(self) -> bool:
        now = self._lrs()
        return self._lr_at_decision is not None and any(
            a < b for a, b in zip(now, self._lr_at_decision, strict=False)
        )

    def _apply(self, critical: dict[str, bool], reason: str, norms=None) -> None:
        self._lr_at_decision = self._lrs()
        for name, crit in critical.items():
            level = self.low if crit else self.high
            self.current[name] = level
            self._compressor.set_level(name, level)
        self.history.append(
            {"step": self._steps, "reason": reason, "levels": dict(self.current), "norms": norms}
        )

    def state_dict(self) -> dict:
        return {
            "prev": self._prev,
            "sums": {name: total.clone() for name, total in self._sums.items()},
            "steps": self._steps,
            "current": dict(self.current),
            "lr": self._lr_at_decision,
        }

    def load_state_dict(self, state: dict) -> None:
        """Everything is checked before anything changes: ``CheckpointError`` naming the
        entry for unknown tensor names, non-finite norms or sums, or levels the compressor
        refuses. A state whose sums are numbers (from when Accordion summed the steps'
        norms) loads with the interval's sum started again from zero."""
        check_keys("accordion state", state, required=("prev", "sums", "steps", "current", "lr"))
        names = set(self.names)
        prev = state["prev"]
        if prev is not None:
            if not isinstance(prev, (list, tuple)) or len(prev) != len(self.names):
                raise CheckpointError(
                    f"accordion state 'prev': expected None or {len(self.names)} norms, "
                    f"got {prev!r:.80}"
                )
            prev = [check_finite_number(f"accordion prev[{i}]", v) for i, v in enumerate(prev)]
        sums = check_dict("accordion sums", state["sums"])
        check_names("accordion sums", sums, names)
        if all(isinstance(v, torch.Tensor) for v in sums.values()):
            sums = check_tensor_map("accordion sums", sums, dim=1)
        else:  # the steps' norms of an older state: checked, not kept
            for n, v in sums.items():
                check_finite_number(f"accordion sums[{n!r}]", v)
            sums = {}
        steps = state["steps"]
        if type(steps) is not int or steps < 0:
            raise CheckpointError(f"accordion steps: expected an int >= 0, got {steps!r}")
        current = check_dict("accordion current", state["current"])
        check_names("accordion current", current, names)
        levels = checked_levels("accordion current", current, self._compressor)
        lr = state["lr"]
        if lr is not None:
            if not isinstance(lr, (list, tuple)):
                raise CheckpointError(f"accordion lr: expected a list, got {lr!r:.80}")
            lr = [check_finite_number(f"accordion lr[{i}]", v) for i, v in enumerate(lr)]
        self._prev = prev
        self._sums = {n: total.detach().clone() for n, total in sums.items()}
        self._steps = steps
        self._lr_at_decision = lr
        for name, level in levels.items():
            self.current[name] = level
            self._compressor.set_level(name, level)
