"""The policy interface: choose each tensor's compression level during training
(docs/design.md, "Policies", for when the optimizer calls each method).

Defaults do nothing, so a policy overrides only what it uses. Levels are applied with the
compressor's ``set_level(name, value)`` (``compressors.levels.PerTensorLevels``); every
rank must make the same decision.
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
