"""PyTorch Lightning: compressed gradient exchange as a strategy (docs/integrations.md,
"Lightning: CompressedDDPStrategy", for the hook, the checkpoints and the logging).

    from hvdcompress.lightning import CompressedDDPStrategy
    trainer = Trainer(strategy=CompressedDDPStrategy("3lc"), accelerator="cpu", devices=2)

``CompressedDDPStrategy`` is Lightning's ``DDPStrategy`` whose DDP model gets
``hvdcompress.ddp_hook`` on every device type (Lightning's own ``ddp_comm_hook`` is
registered on CUDA only). Invariants: every bucket of every step passes through the hook;
each checkpoint carries every rank's hook state under ``"hvdcompress"`` (gathered to rank
0, which writes the file), and each rank resumes from its own entry with the rule of
``DDPHookState.load_state_dict``.

Needs ``pip install 'hvdcompress[lightning]'`` (tested with pytorch-lightning 2.6.6).
"""

from __future__ import annotations

import warnings

try:
    from pytorch_lightning.strategies import DDPStrategy
except ImportError:  # the unified package ships the same strategy
    try:
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError as err:
        raise ImportError(
            "hvdcompress.lightning needs PyTorch Lightning: pip install "
            "'hvdcompress[lightning]' (tested with pytorch-lightning 2.6.6)"
        ) from err

from hvdcompress.checkpoint import CheckpointError
from hvdcompress.ddp import DDPHookState
from hvdcompress.exchange.tuning import DEFAULT_TUNING

__all__ = ["CHECKPOINT_KEY", "CompressedDDPStrategy"]

CHECKPOINT_KEY = "hvdcompress"  # the checkpoint's entry: {"ranks": [state of rank 0, ...]}


class CompressedDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with hvdcompress's hook (module doc).

    ``compression``: a compressor name, Compressor or ``Compression`` entry, as in
    ``DistributedOptimizer``; ``compress_min_numel``: smaller tensors travel
    uncompressed; ``tuning``: as ``DDPHookState``'s (``None``: ``exchange="auto"`` keeps
    its first guess, for runs that must resume bit for bit); ``**kwargs``:
    ``DDPStrategy``'s and DDP's arguments, except its ``ddp_comm_*`` hooks, which this
    strategy replaces.
    """

    strategy_name = "hvdcompress_ddp"

    def __init__(
        self, compression="3lc", *, compress_min_numel: int = 0, tuning=DEFAULT_TUNING, **kwargs
    ) -> None:
        taken = sorted(
            k for k in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper") if k in kwargs
        )
        if taken:
            raise ValueError(
                f"CompressedDDPStrategy registers hvdcompress's comm hook itself and takes no "
                f"{', '.join(taken)}; use Lightning's DDPStrategy for torch's own hooks"
            )
        super().__init__(**kwargs)
        self.hook_state = DDPHookState(
            compression, compress_min_numel=compress_min_numel, tuning=tuning
        )
        self._resume_state: tuple | None = None  # (path, this rank's entry) of a loaded checkpoint

    @property
    def last_stats(self):
        """The ``StepStats`` of the last optimizer step."""
        return self.hook_state.last_stats

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model; registers no hook (none was given)
        self.hook_state.register(self.model)
        if self._resume_state is not None:  # checked against the model's parameters now
            (path, state), self._resume_state = self._resume_state, None
            try:
                self.hook_state.load_state_dict(state)
            except CheckpointError as err:
                raise CheckpointError(
                    f"resuming from {path}: {err} (here: the checkpoint's {CHECKPOINT_KEY!r} entry)"
                ) from err

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_stats()
        return output

    def _log_stats(self) -> None:
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        if not trainer.loggers or step % max(trainer.log_every_n_steps, 1):
            return
        stats = self.hook_state.last_stats
        metrics = {
            "hvdcompress/bits_per_value": stats.bits_per_value,
            "hvdcompress/payload_bytes": float(stats.payload_bytes),
            "hvdcompress/sent_bytes": float(stats.sent_bytes),
            "hvdcompress/compress_s": stats.compress_s,
            "hvdcompress/wait_s": stats.wait_s,
        }
        for logger in trainer.loggers:  # the loggers write on rank 0 only
            logger.log_metrics(metrics, step=step)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        """Every rank calls this (Lightning's rule for ``Trainer.save_checkpoint``): the
        ranks' hook states are gathered into the checkpoint rank 0 writes."""
        if self.hook_state.bound:
            ours = self.hook_state.state_dict()
            checkpoint[CHECKPOINT_KEY] = {"ranks": self.hook_state.transport.allgather_object(ours)}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, *args, **kwargs):
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            warnings.warn(
                f"hvdcompress: {checkpoint_path} holds no hvdcompress hook state (written "
                "without CompressedDDPStrategy?): error feedback starts from zero",
                UserWarning,
                stacklevel=2,
            )
            return checkpoint
        ranks = saved.get("ranks") if isinstance(saved, dict) else None
        if not isinstance(ranks, list) or not ranks:
            raise ValueError(
                f"{checkpoint_path}: its {CHECKPOINT_KEY!r} entry is not a list of rank states"
            )
        # a checkpoint of another world size has no entry of its own for every rank:
        # rank 0's entry then fails DDPHookState's world-size check with its message
        # (loaded in configure_ddp, once the model's parameter names are known)
        own = ranks[self.global_rank] if len(ranks) == self.world_size else ranks[0]
        self._resume_state = (checkpoint_path, own)
        return checkpoint
