"""Per-tensor error-feedback memory (the residual e of 3LC, EF-signSGD, top-k ...).

Seide et al. 2014 / Karimireddy et al. 2019: adding back what compression dropped
keeps the compressed SGD unbiased over time. Invariant: for each tensor name,
sum over steps of (decoded gradient) + e_now == sum over steps of (true gradient),
up to float rounding.
"""

from __future__ import annotations

import torch

from hvdcompress.buckets import StateKey, state_key, state_text


class ErrorFeedback:
    """Residuals keyed by tensor name (or a piece's key), float32, flat, on the gradient's
    device; a checkpoint has the keys as strings (``buckets.state_key``)."""

    def __init__(self) -> None:
        self.residuals: dict[StateKey, torch.Tensor] = {}

    def residual(self, name: StateKey, like: torch.Tensor) -> torch.Tensor:
        """The residual for ``name``, created as zeros like the flat float32 ``like``."""
        e = self.residuals.get(name)
        if e is None:
            e = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self.residuals[name] = e
        elif e.numel() != like.numel() or e.device != like.device:
            raise ValueError(
                f"tensor {str(name)!r} has {like.numel()} elements on {like.device}, but its "
                f"error-feedback residual has {e.numel()} on {e.device}: a name was reused "
                "for a different tensor"
            )
        return e

    def swap(self, name: StateKey, new: torch.Tensor) -> torch.Tensor:
        """Make the flat float32 ``new`` (of the current residual's size and device) the
        residual of ``name`` and return the one it replaces: a compressor that computes
        the next residual in a buffer of its own hands it over without a copy."""
        old = self.residuals[name]
        if new.numel() != old.numel() or new.device != old.device or new.dim() != 1:
            raise ValueError(f"tensor {str(name)!r}: a swapped-in residual must match the old")
        self.residuals[name] = new
        return old

    def absorb(self, name: StateKey, delta: torch.Tensor) -> bool:
        """Add ``delta`` to the residual of ``name``; False when there is none of its size
        (nothing compressed yet)."""
        e = self.residuals.get(name)
        if e is None or e.numel() != delta.numel():
            return False
        e.add_(delta.reshape(-1).to(device=e.device, dtype=torch.float32))
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return state_text({name: e.clone() for name, e in self.residuals.items()})

    def load_state_dict(self, state: dict[str, torch.Tensor], what: str = "residuals") -> None:
        """Replace every residual; ``CheckpointError`` (nothing replaced) unless ``state``
        maps names to finite flat float32 tensors (of the current one's size, if any)."""
        from hvdcompress.checkpoint import CheckpointError, check_tensor_map

        check_tensor_map(what, state, dim=1)
        loaded = {}
        for text, e in state.items():
            name = state_key(text)
            current = self.residuals.get(name)
            if current is not None and current.numel() != e.numel():
                raise CheckpointError(
                    f"{what}[{text!r}]: {e.numel()} elements, the tensor has {current.numel()}"
                )
            device = current.device if current is not None else e.device
            loaded[name] = e.detach().to(device=device, copy=True)
        self.residuals = loaded


def residual_state(memory: ErrorFeedback, settings: dict) -> dict:
    """The ``state_dict`` of a compressor whose state is its ``memory``: the ``settings``
    a checkpoint must match (name -> this compressor's value), then the residuals."""
    return {**settings, "residuals": memory.state_dict()}


def load_residual_state(memory: ErrorFeedback, what: str, state: dict, settings: dict) -> None:
    """Load ``residual_state``'s dict: ``settings`` checked against the saved ones first."""
    from hvdcompress.checkpoint import check_keys, check_saved_value

    check_keys(f"{what} state", state, required=(*settings, "residuals"))
    for key, value in settings.items():
        check_saved_value(key, state[key], value)
    memory.load_state_dict(state["residuals"], what=f"{what} residuals")
