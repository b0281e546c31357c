"""The policy interface: choose each tensor's compression level during training.

A policy is given to ``hvdcompress.DistributedOptimizer(..., policy=...)``, which calls

* ``bind(optimizer, compressor, transport, names)`` once, at construction (``names``: the
  compressed tensors, in parameter order);
* ``observe(name, grad)`` for every uncompressed local gradient just before its bucket
  is compressed;
* ``after_step(stats)`` once every rank has the step's averaged gradients, with the
  step's ``hvdcompress.stats.StepStats`` (bytes, per-collective timings). All collectives
  of the step are done then, so a policy's own small agreement collective cannot
  interleave with them; every rank must make the same decision;
* ``pop_metrics()`` after ``after_step``: merged into ``optimizer.last_stats.metrics``;
* ``state_dict()`` / ``load_state_dict()`` with the optimizer's.

Defaults do nothing, so a policy overrides only what it uses. Levels are applied with the
compressor's ``set_level(name, value)`` (``compressors.levels.PerTensorLevels``).
"""

from __future__ import annotations


class Policy:
    """Base class of Accordion and CAT (see module doc)."""

    def bind(self, optimizer, compressor, transport, names: list[str]) -> None:
        """Called once by the optimizer; refuse a compressor the policy cannot drive."""

    def observe(self, name: str, grad) -> None:
        """The uncompressed local gradient of ``name``, before it is compressed."""

    def after_step(self, stats) -> None:
        """The step's collectives are done (``stats``: hvdcompress.stats.StepStats)."""

    def pop_metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")
