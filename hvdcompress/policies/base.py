"""The policy interface: choose each tensor's compression level during training
(docs/design.md, "Policies", for when the optimizer calls each method).

Defaults do nothing, so a policy overrides only what it uses. Levels are applied with the
compressor's ``set_level(name, value)`` (``compressors.levels.PerTensorLevels``); every
rank must make the same decision.
"""

from __future__ import annotations

from hvdcompress.checkpoint import CheckpointError, check_dict, check_keys


class Policy:
    """Base class of Accordion and CAT (see module doc)."""

    def bind(self, optimizer, compressor, transport, names: list[str]) -> None:
        """Called once by the optimizer; refuse a compressor the policy cannot drive."""

    def observe(self, name: str, grad) -> None:
        """The uncompressed local gradient of ``name``, before it is compressed."""

    def after_step(self, stats) -> None:
        """The step's collectives are done (``stats``: hvdcompress.stats.StepStats)."""

    def pop_metrics(self) -> dict:
        """The metrics a subclass left in ``self._metrics`` since the last call."""
        out, self._metrics = getattr(self, "_metrics", {}), {}
        return out

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        check_keys(f"{type(self).__name__} state (it keeps none)", state)


def checked_levels(what: str, levels: dict, compressor) -> dict:
    """``levels`` (name -> level) as ``compressor`` accepts them, for a ``load_state_dict``;
    ``CheckpointError`` naming ``what[name]`` for a level it refuses."""
    out = {}
    for name, level in check_dict(what, levels).items():
        try:
            out[name] = compressor.levels.check(level)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"{what}[{name!r}]: {err}") from None
    return out
