"""Hugging Face Accelerate: compressed gradient exchange in one call after ``prepare``
(docs/integrations.md, "Accelerate: register", for what it finds and what it refuses).

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = hvdcompress.accelerate.register(accelerator, model, compression="3lc")

Every rank saves its own hook state to ``STATE_FILE`` in the ``save_state`` folder and
resumes from it, with the rule of ``DDPHookState.load_state_dict``. A call of its own,
because Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own
hook types.

Needs ``pip install 'hvdcompress[accelerate]'`` (tested with accelerate 1.16.0).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from accelerate.utils import DistributedType, is_compiled_module
except ImportError as err:
    raise ImportError(
        "hvdcompress.accelerate needs Hugging Face Accelerate: pip install "
        "'hvdcompress[accelerate]' (tested with accelerate 1.16.0)"
    ) from err

from hvdcompress import checks
from hvdcompress.checkpoint import CheckpointError
from hvdcompress.ddp import DDPHookState
from hvdcompress.exchange.tuning import DEFAULT_TUNING, check_tuning

__all__ = ["STATE_FILE", "register"]

STATE_FILE = "hvdcompress_model{model}_rank{rank}.pt"  # in the save_state folder
DDP_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def register(
    accelerator,
    model: torch.nn.Module,
    compression="3lc",
    *,
    compress_min_numel: int = 0,
    tuning=DEFAULT_TUNING,
) -> DDPHookState | None:
    """Register hvdcompress's DDP hook on ``model`` (what ``accelerator.prepare``
    returned) and its state with ``accelerator``'s checkpoints (module doc); ``tuning``:
    as ``DDPHookState``'s (``None``: ``exchange="auto"`` keeps its first guess). Returns the
    hook's state (``last_stats`` of each optimizer step, ``hook_calls``), or None with a
    warning in a one-process run, where Accelerate wraps nothing and nothing is exchanged.
    """
    compress_min_numel = checks.integer("compress_min_numel", compress_min_numel, 0)
    check_tuning(tuning)
    kind = accelerator.distributed_type
    if kind == DistributedType.NO:
        warnings.warn(
            "hvdcompress.accelerate.register: one process, so Accelerate did not wrap the "
            "model in DDP and no gradient is exchanged: nothing to compress (launch with "
            "`accelerate launch --num_processes N` for N > 1)",
            UserWarning,
            stacklevel=2,
        )
        return None
    if kind not in DDP_TYPES:
        raise ValueError(
            f"hvdcompress.accelerate.register: Accelerate's distributed type is {kind}; "
            "hvdcompress compresses the gradients of DistributedDataParallel (MULTI_CPU, "
            "MULTI_GPU), not those of sharded or engine-managed training (FSDP, DeepSpeed, ...)"
        )
    ddp = _ddp_of(model)
    state = DDPHookState(compression, compress_min_numel=compress_min_numel, tuning=tuning)
    state.register(ddp)
    rank = accelerator.process_index

    def path_in(folder, models) -> str:
        # one file per rank and prepared model: the model's place in the accelerator's
        # list, as Accelerate numbers its own model files
        index = next((i for i, m in enumerate(models) if m is model or m is ddp), 0)
        return os.path.join(folder, STATE_FILE.format(model=index, rank=rank))

    def save(models, weights, output_dir) -> None:
        torch.save(state.state_dict(), path_in(output_dir, models))

    def load(models, input_dir) -> None:
        path = path_in(input_dir, models)
        if not os.path.exists(path):
            prefix = os.path.basename(path).rsplit("_rank", 1)[0] + "_rank"
            others = sorted(f for f in os.listdir(input_dir) if f.startswith(prefix))
            if others:
                raise FileNotFoundError(
                    f"{input_dir} holds hvdcompress states {others} but none of rank {rank} of "
                    f"{accelerator.num_processes}: it was saved by another world size; "
                    "resume on the world size that saved it"
                )
            warnings.warn(
                f"hvdcompress: {input_dir} holds no hvdcompress state for this model (saved "
                "before register?): error feedback starts from zero",
                UserWarning,
                stacklevel=2,
            )
            return
        try:
            state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except CheckpointError as err:
            raise CheckpointError(f"resuming from {path}: {err} (here: that file)") from err

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state


def _ddp_of(model: torch.nn.Module) -> DistributedDataParallel:
    """The DDP model inside what ``accelerator.prepare`` returned: the model itself, or
    the one ``torch.compile`` wraps."""
    inner = model._orig_mod if is_compiled_module(model) else model
    if not isinstance(inner, DistributedDataParallel):
        raise TypeError(
            f"hvdcompress.accelerate.register needs the model accelerator.prepare returned "
            f"(a DistributedDataParallel), got {type(model).__name__}: pass "
            "`model = accelerator.prepare(model)`'s result"
        )
    return inner
