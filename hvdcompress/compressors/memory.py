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

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        loaded = {}
        for name, e in state.items():
            if not isinstance(e, torch.Tensor) or e.dtype != torch.float32 or e.dim() != 1:
                raise ValueError(f"residual {name!r} must be a flat float32 tensor")
            current = self.residuals.get(name)
            device = current.device if current is not None else e.device
            loaded[name] = e.detach().to(device=device, copy=True)
        self.residuals = loaded
