"""Per-tensor error-feedback memory (the residual e of 3LC, EF-signSGD, top-k ...).

Seide et al. 2014 / Karimireddy et al. 2019: adding back what compression dropped
keeps the compressed SGD unbiased over time. Invariant: for each tensor name,
sum over steps of (decoded gradient) + e_now == sum over steps of (true gradient),
up to float rounding.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Residuals keyed by tensor name, float32, flat, on the gradient's device."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def residual(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The residual for ``name``, created as zeros like the flat float32 ``like``."""
        e = self.residuals.get(name)
        if e is None:
            e = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self.residuals[name] = e
        elif e.numel() != like.numel() or e.device != like.device:
            raise ValueError(
                f"tensor {name!r} has {like.numel()} elements on {like.device}, but its "
                f"error-feedback residual has {e.numel()} on {e.device}: a name was reused "
                "for a different tensor"
            )
        return e

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: e.clone() for name, e in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], what: str = "residuals") -> None:
        """Replace every residual; ``CheckpointError`` (nothing replaced) unless ``state``
        maps names to finite flat float32 tensors (of the current one's size, if any)."""
        from hvdcompress.checkpoint import CheckpointError, check_tensor_map

        check_tensor_map(what, state, dim=1)
        loaded = {}
        for name, e in state.items():
            current = self.residuals.get(name)
            if current is not None and current.numel() != e.numel():
                raise CheckpointError(
                    f"{what}[{name!r}]: {e.numel()} elements, the tensor has {current.numel()}"
                )
            device = current.device if current is not None else e.device
            loaded[name] = e.detach().to(device=device, copy=True)
        self.residuals = loaded


class ResidualState:
    """``state_dict`` of a compressor whose state is its ``memory``: the residuals, and the
    settings a checkpoint must match (``saved_settings``, attribute names)."""

    saved_settings: tuple[str, ...] = ()

    def state_dict(self) -> dict:
        settings = {key: getattr(self, key) for key in self.saved_settings}
        return {**settings, "residuals": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from hvdcompress.checkpoint import check_keys, check_saved_value

        check_keys(f"{self.name} state", state, required=(*self.saved_settings, "residuals"))
        for key in self.saved_settings:
            check_saved_value(key, state[key], getattr(self, key))
        self.memory.load_state_dict(state["residuals"], what=f"{self.name} residuals")
