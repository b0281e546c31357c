"""Compression warm-up: every tensor at a denser level for the first steps of training.

DGC (Lin et al., ICLR 2018) and torch's PowerSGD documentation start training at low
compression (about the first 10% of it) because the early, critical regime is where a
compressed run loses accuracy it does not win back (issue 61). ``Warmup(warm, steps)``
sets the compressor's per-tensor level (``PerTensorLevels``) to ``warm`` for the first
``steps`` optimizer steps and then to ``level`` (default: the compressor's own default
level). The decision depends on the step count only, so every rank makes the same one
with no collective; the step count is the policy's checkpoint state.
"""

from __future__ import annotations

from hvdcompress import checks
from hvdcompress.checkpoint import CheckpointError, check_keys
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.policies.base import Policy


class Warmup(Policy):
    """Level ``warm`` for the first ``steps`` steps, then ``level`` (see module doc)."""

    def __init__(self, warm, steps: int, level=None) -> None:
        self.warm, self.level = warm, level
        self.steps = checks.integer("steps", steps, 0)
        self.names: list[str] = []
        self.current = None  # the level in force
        self._steps = 0
        self._metrics: dict = {}
        self._compressor = None

    def __repr__(self) -> str:
        return f"Warmup(warm={self.warm}, steps={self.steps}, level={self.level})"

    def bind(self, optimizer, compressor, transport, names: list[str]) -> None:
        if not isinstance(compressor, PerTensorLevels):
            raise TypeError(
                f"Warmup needs a compressor with per-tensor levels (3lc, block3lc, topk, "
                f"powersgd), got {compressor!r}"
            )
        if self.level is None:
            self.level = compressor.levels.default
        self.warm = compressor.levels.check(self.warm)  # refuse a wrong level now
        self.level = compressor.levels.check(self.level)
        self._compressor = compressor
        self.names = list(names)
        self._apply()

    def level_at(self, steps_done: int):
        """The level in force after ``steps_done`` steps."""
        return self.warm if steps_done < self.steps else self.level

    def after_step(self, stats) -> None:
        self._steps += 1
        if self.level_at(self._steps) != self.current:
            self._apply()
        self._metrics = {"level/all": self.current}  # policy.csv keeps level/*

    def _apply(self) -> None:
        self.current = self.level_at(self._steps)
        for name in self.names:
            self._compressor.set_level(name, self.current)

    def state_dict(self) -> dict:
        return {"steps": self._steps}

    def load_state_dict(self, state: dict) -> None:
        check_keys("warmup state", state, required=("steps",))
        steps = state["steps"]
        if type(steps) is not int or steps < 0:
            raise CheckpointError(f"warmup steps: expected an int >= 0, got {steps!r}")
        self._steps = steps
        if self._compressor is not None:
            self._apply()
