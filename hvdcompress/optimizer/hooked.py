"""A DDP model's optimizer as a training loop written for ``DistributedOptimizer`` uses
it (``hooked_optimizer``): ``last_stats`` and the per-rank state under ``"hvdcompress"``
(``STATE_KEY``, the key ``DistributedOptimizer`` saves under) come from the DDP hook's
state (``hvdcompress.DDPHookState``, duck-typed: this layer does not import ``ddp``).
"""

from __future__ import annotations

import torch

from hvdcompress.optimizer.wrapper import STATE_KEY
from hvdcompress.stats import StepStats

__all__ = ["hooked_optimizer"]


class _HookedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (``hooked_optimizer``)."""

    def __init__(self, params, state) -> None:
        super(self.__class__, self).__init__(params)
        self._hook_state = state

    @property
    def last_stats(self) -> StepStats:
        return self._hook_state.last_stats

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state[STATE_KEY] = self._hook_state.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is not None:
            self._hook_state.load_state_dict(ours)
        return super(self.__class__, self).load_state_dict(state_dict)


def hooked_optimizer(optimizer: torch.optim.Optimizer, state):
    """``optimizer`` (of a DDP model whose comm hook has ``state``) as a training loop
    written for ``DistributedOptimizer`` uses it: ``last_stats`` of its last step, and
    ``state_dict()`` carrying the hook's state under ``"hvdcompress"`` (per rank, loaded
    by ``load_state_dict`` with ``DDPHookState.load_state_dict``'s rule). Same class
    pattern as ``DistributedOptimizer``: an instance of a subclass of its class."""
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_HookedOptimizer.__dict__),
    )
    return cls(optimizer.param_groups, state)
