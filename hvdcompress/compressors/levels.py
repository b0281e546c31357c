"""Per-tensor compression levels, set by a policy (Accordion, CAT; docs/policies.md).

A compressor with ``PerTensorLevels`` has one level parameter (3LC ``sparsity``, top-k
``ratio``, PowerSGD ``matrix_rank``); ``set_level(name, value)`` overrides it for one
tensor, ``level(name)`` reads what is in force. Every rank applies the same policy
decision at the same step, so a receiver expects the level its own decision gives the
sending tensor: ``check_params(header, name)`` checks the header's level against
``level(name)``. The error-feedback residual is keyed by name only, so it survives a
switch.
"""

from __future__ import annotations


class PerTensorLevels:
    """Mixin: ``level_param`` names the attribute holding the default level."""

    level_param: str = ""

    @property
    def levels(self) -> dict[str, float]:
        """The per-tensor overrides (name -> level)."""
        return self.__dict__.setdefault("_levels", {})

    def _check_level(self, value):
        """Validate one level (subclasses: raise ValueError); returns it normalised."""
        return value

    def level(self, name: str | None):
        default = getattr(self, self.level_param)
        return default if name is None else self.levels.get(name, default)

    def set_level(self, name: str, value) -> None:
        self.levels[name] = self._check_level(value)

    def owner_level(self, level):
        """The level at which the owner of a two-stage shard re-compresses the averaged
        shard when the tensor's level is ``level`` (docs/exchanges.md): by default
        the same level."""
        return level
