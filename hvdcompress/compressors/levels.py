"""Per-tensor compression levels, set by a policy (Accordion, CAT; docs/policies.md).

A compressor with per-tensor levels (``PerTensorLevels``) has one level parameter (3LC
``sparsity``, top-k ``ratio``, PowerSGD ``matrix_rank``) and makes a ``TensorLevels`` of
it in ``__init__``; ``set_level(name, value)`` overrides it for one tensor, ``level(name)``
reads what is in force. Every rank applies the same policy decision at the same step, so
a receiver expects the level its own decision gives the sending tensor:
``check_params(header, name)`` checks the header's level against ``level(name)``. The
error-feedback residual is keyed by name only, so it survives a switch.
"""

from __future__ import annotations

from collections.abc import Callable


class TensorLevels(dict):
    """The per-tensor overrides (name -> level) of a ``default`` level; ``check`` validates
    one level (raises ValueError) and returns it normalised. A dict, so that a caller
    can save and put back the overrides (``DistributedOptimizer.load_state_dict``)."""

    def __init__(self, default, check: Callable) -> None:
        super().__init__()
        self.default = default
        self.check = check

    def of(self, name):
        """The level in force for tensor ``name`` (None: the default)."""
        return self.default if name is None else self.get(name, self.default)

    def set(self, name, value) -> None:
        self[name] = self.check(value)


class PerTensorLevels:
    """What the policies and the two-stage exchange use of a compressor with per-tensor
    levels: its ``levels`` (made in ``__init__``, defaulting to the constructor parameter
    its ``CompressorSpec.level_param`` names), read and set per tensor."""

    levels: TensorLevels

    def level(self, name):
        return self.levels.of(name)

    def set_level(self, name, value) -> None:
        self.levels.set(name, value)

    def owner_level(self, level):
        """The level at which the owner of a two-stage shard re-compresses the averaged
        shard when the tensor's level is ``level`` (docs/exchanges.md): by default
        the same level."""
        return level
