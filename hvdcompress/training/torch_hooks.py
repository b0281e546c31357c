"""torch's own DDP communication for scripts/train.py ``--launcher torchrun --torch-hook``:
the baselines that hvdcompress's methods are compared against (DDP's allreduce, the 16-bit
``bf16_compress_hook``, torch's PowerSGD), trained by the same loop.

torch's hooks report no statistics, so ``TorchHook.step_stats`` gives the bytes each one
hands to its allreduces, from what it is documented to send: 32 bits per value for DDP's
allreduce, 16 for bf16, and for PowerSGD the element counts of its own ``PowerSGDState``
(P and Q of rank R, ``R * (m + n)`` per compressed matrix, dense tensors whole, and all of
it dense for the first ``start_powerSGD_iter`` steps). Nothing here is measured: the
compression time and the transport's byte counts stay unknown (``measured`` False).
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from hvdcompress.stats import StepStats

TORCH_HOOKS = ("allreduce", "bf16", "powersgd")
# the dense steps before PowerSGD compresses: the fewest torch allows with error feedback
# (torch's documentation suggests about 10% of training; train.py --powersgd-start-iter)
POWERSGD_START_ITER = 2
# torch's PowerSGD hook with several buckets aborts or hangs on gloo: one bucket
POWERSGD_BUCKET_CAP_MB = 1000
FLOAT32_BYTES = 4


def ddp_options(kind: str) -> dict:
    """DistributedDataParallel's keyword arguments for ``kind``."""
    return {"bucket_cap_mb": POWERSGD_BUCKET_CAP_MB} if kind == "powersgd" else {}


def label(kind: str, powersgd_rank: int) -> str:
    """The summary line's ``compression`` of a run with torch's hook ``kind``."""
    return f"torch-powersgd-r{powersgd_rank}" if kind == "powersgd" else f"torch-{kind}"


def bf16_hook(process_group, bucket):  # unannotated: DDP checks annotations by identity
    """torch's ``bf16_compress_hook`` itself, under another name: DDP refuses a hook of that
    name unless CUDA with NCCL (or XPU) is present, a check of the name and not of the
    backend, while gloo reduces bfloat16 on CPU as well."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def powersgd_state(rank: int, start_iter: int = POWERSGD_START_ITER) -> powersgd.PowerSGDState:
    """torch's ``PowerSGDState`` of rank ``rank`` as train.py trains with it and
    scripts/bench_peers.py times it (one constructor, so the job timed is the job trained):
    ``start_iter`` dense allreduce steps first (at least 2, torch's least with error feedback
    and warm start), then rank-``rank`` factors. ``min_compression_rate=1`` (torch's default
    is 2): every matrix whose factors ``rank * (m + n)`` are smaller than its ``m * n``
    values is compressed, where the default would send the matrices that compress less than
    twofold dense; the bytes counted by ``TorchHook`` and the accuracy trained are those of
    this setting."""
    if start_iter < 2:
        raise ValueError(f"PowerSGD's start iteration must be >= 2, got {start_iter}")
    return powersgd.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=start_iter,
        min_compression_rate=1,
    )


class TorchHook:
    """torch's hook ``kind`` registered on the DDP model ``ddp`` (none for ``allreduce``:
    DDP's own averaging), and the bytes of its last step (``step_stats``); PowerSGD of
    ``powersgd_rank`` after ``powersgd_start_iter`` dense steps (``powersgd_state``)."""

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel, kind: str,
                 powersgd_rank: int,
                 powersgd_start_iter: int = POWERSGD_START_ITER) -> None:  # fmt: skip
        if kind not in TORCH_HOOKS:
            raise ValueError(f"torch hook {kind!r}: expected one of {', '.join(TORCH_HOOKS)}")
        self.kind = kind
        self.size = torch.distributed.get_world_size()
        self.numel = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
        self.powersgd_state = None
        self._counted = 0  # PowerSGDState.total_numel_after_compression at the last step
        if kind == "bf16":
            ddp.register_comm_hook(None, bf16_hook)
        elif kind == "powersgd":
            self.powersgd_state = powersgd_state(powersgd_rank, powersgd_start_iter)
            ddp.register_comm_hook(self.powersgd_state, powersgd.powerSGD_hook)

    def _values_sent(self) -> int:
        """Float32 values the last step's allreduces carried (bf16: counted as halves)."""
        state = self.powersgd_state
        if state is None:
            return self.numel
        counted = state.total_numel_after_compression
        sent, self._counted = counted - self._counted, counted
        # the hook's first start_powerSGD_iter steps are a plain allreduce, uncounted: torch
        # runs step s (1-based) dense while its iter (s - 1 before, s after it) is below
        # start_powerSGD_iter, whatever that is
        return self.numel if state.iter <= state.start_powerSGD_iter else sent

    def resume_at(self, step: int) -> None:
        """Go on from a checkpoint of ``step``: PowerSGD's step count follows, so a dense
        warm-up (``start_powerSGD_iter``) is not run again by each resumed piece of a job.
        Its error feedback and warm-start factors are not in train.py's checkpoint: they
        start again from zero, as on the first compressed step."""
        if self.powersgd_state is not None:
            self.powersgd_state.iter = step
            self._counted = self.powersgd_state.total_numel_after_compression

    def step_stats(self) -> StepStats:
        """The last step's bytes, as ``DistributedOptimizer.last_stats`` gives them; called
        once after every step (PowerSGD's count is the difference from the last call)."""
        payload = self._values_sent() * FLOAT32_BYTES
        if self.kind == "bf16":
            payload //= 2
        return StepStats(
            numel=self.numel,
            raw_bytes=self.numel * FLOAT32_BYTES,
            payload_bytes=payload,
            wire_bytes=2.0 * (self.size - 1) / self.size * payload,  # a ring allreduce
        )
