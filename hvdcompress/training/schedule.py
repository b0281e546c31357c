"""Learning-rate schedules of scripts/train.py: constant, step and cosine, with linear warmup
(docs/training.md, "Learning-rate schedule and logs", for the defaults and the flags).

A schedule is a pure function of the global step (``LRSchedule.lr_at(step)``), so a run
resumed from a checkpoint at step s continues with exactly the rates of an uninterrupted
run; the checkpoint still carries the schedule (``state_dict()``) so that a resume with
different schedule flags is refused instead of silently training on another schedule.

* ``step``: ``lr * gamma ** k``, k the milestones (epochs, may be fractional) reached;
  milestone m takes effect at step ``round(m * steps_per_epoch)``.
* ``cosine``: ``lr * (1 + cos(pi * t / T)) / 2`` over the planned run (``epochs *
  steps_per_epoch`` steps), t counted after warmup.
* warmup (any kind; Goyal et al. 2017, "Accurate, Large Minibatch SGD"): for the first
  ``warmup_steps`` the rate is ``(step + 1) / warmup_steps`` times the scheduled one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

KINDS = ("constant", "step", "cosine")
DEFAULT_KIND = "step"
DEFAULT_GAMMA = 0.1
DEFAULT_MILESTONE_FRACTIONS = (0.5, 0.8)


def default_milestones(epochs: int) -> list[float]:
    """Milestones after 50% and 80% of ``epochs`` (whole epochs; those at epoch 0 or at
    the end of the run, where no step would feel them, are left out): 10 -> [5, 8],
    2 -> [1], 1 -> []."""
    out = []
    for fraction in DEFAULT_MILESTONE_FRACTIONS:
        m = round(fraction * epochs)
        if 0 < m < epochs and m not in out:
            out.append(float(m))
    return out


def parse_milestones(text: str) -> list[float]:
    """``"5,8"`` -> [5.0, 8.0]: comma-separated epochs, finite, > 0, strictly increasing;
    ValueError saying so otherwise ("" is no milestone)."""
    if not text.strip():
        return []
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated epochs such as 5,8, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"milestones must be finite epochs > 0, got {text!r}")
    if any(b <= a for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(f"milestones must increase strictly, got {text!r}")
    return values


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate at every step of a run (see the module docstring).

    ``steps_per_epoch`` converts epochs (milestones, warmup, the cosine horizon
    ``epochs``) to steps; ``lr`` is the peak (base) rate."""

    kind: str
    lr: float
    steps_per_epoch: int
    epochs: int
    milestones: tuple[float, ...] = field(default_factory=tuple)
    gamma: float = DEFAULT_GAMMA
    warmup_epochs: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}: one of {', '.join(KINDS)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and > 0, got {self.lr!r}")
        if self.steps_per_epoch < 1 or self.epochs < 1:
            raise ValueError("steps_per_epoch and epochs must be >= 1")
        if not (math.isfinite(self.gamma) and 0 < self.gamma <= 1):
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ValueError(f"warmup epochs must be finite and >= 0, got {self.warmup_epochs!r}")
        object.__setattr__(self, "milestones", tuple(float(m) for m in self.milestones))
        if self.kind != "step" and self.milestones:
            raise ValueError(f"milestones apply to the step schedule, not {self.kind!r}")

    @property
    def warmup_steps(self) -> int:
        return round(self.warmup_epochs * self.steps_per_epoch)

    @property
    def milestone_steps(self) -> list[int]:
        """The first step run at each reduced rate."""
        return [round(m * self.steps_per_epoch) for m in self.milestones]

    def lr_at(self, step: int) -> float:
        """The rate of the optimizer step that follows ``step`` completed steps (0-based)."""
        if self.kind == "constant":
            rate = self.lr
        elif self.kind == "step":
            drops = sum(step >= s for s in self.milestone_steps)
            rate = self.lr * self.gamma**drops
        else:
            horizon = max(self.epochs * self.steps_per_epoch - self.warmup_steps, 1)
            t = min(max(step - self.warmup_steps, 0), horizon)
            rate = self.lr * 0.5 * (1.0 + math.cos(math.pi * t / horizon))
        if step < self.warmup_steps:
            rate *= (step + 1) / self.warmup_steps
        return rate

    def apply(self, optimizer, step: int) -> float:
        """Set every param group's ``lr`` for the step after ``step``; the rate."""
        rate = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = rate
        return rate

    def state_dict(self) -> dict:
        """Plain values (checkpoints load no code): every field."""
        state = asdict(self)
        state["milestones"] = list(self.milestones)
        return state

    def check_resumable(self, saved: dict) -> None:
        """ValueError naming both when a checkpoint's schedule is not this one."""
        if saved != self.state_dict():
            raise ValueError(
                f"the checkpoint was trained with the schedule {saved}, this run asks for "
                f"{self.state_dict()}: resume with the same --lr, --lr-schedule, --milestones, "
                "--lr-gamma, --warmup-epochs, --epochs and --batch-size"
            )
