"""One rank of tests/test_lightning.py: hvdcompress.lightning with the real PyTorch
Lightning, 2 CPU ranks under torchrun (gloo).

    torchrun --standalone --nproc_per_node 2 tests/integrations/lightning_worker.py OUT
    python tests/integrations/lightning_worker.py OUT --resume-on-one CKPT

Writes OUT/rank<r>.json: Lightning's plain DDP against CompressedDDPStrategy("none");
a 2-epoch 3LC run (several DDP buckets) with the hook calls and gradient elements of
every step, the parameter digests of every rank and what reached the logger; the run
resumed from that run's checkpoint of epoch 1, and from the same checkpoint without
its hook states (the control); the warning of the silent-CPU trap
(Lightning's own DDPStrategy with ddp_comm_hook on CPU). With --resume-on-one: the error
of resuming the 2-rank checkpoint on one rank.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from pytorch_lightning.loggers import Logger
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from lightning_fmnist import FashionMNISTClassifier  # noqa: E402

import hvdcompress  # noqa: E402
from hvdcompress.lightning import CompressedDDPStrategy  # noqa: E402
from hvdcompress.training.data import load_fashion_mnist  # noqa: E402
from tests.integrations.common import digest, max_diff  # noqa: E402

EXAMPLES = 1280  # 20 steps per epoch per rank at batch 32 on 2 ranks
BUCKET_MB = 0.25  # the CNN's 0.83 MB of gradients in several DDP buckets


class StepRecorder(Callback):
    """After each batch: the hook calls of the step and the elements the hook reduced."""

    def __init__(self, strategy: CompressedDDPStrategy) -> None:
        self.strategy, self.steps, self._calls = strategy, [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state = self.strategy.hook_state
        self.steps.append([state.hook_calls - self._calls, state.last_stats.numel])
        self._calls = state.hook_calls


class CaptureLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append({**metrics, "step": step})


def loader() -> DataLoader:
    (x, y), _ = load_fashion_mnist()
    return DataLoader(TensorDataset(x[:EXAMPLES], y[:EXAMPLES]), batch_size=32, shuffle=True)


def fit(strategy, epochs: int, *, devices: int = 2, ckpt_path=None, callbacks=(), logger=False):
    pl.seed_everything(0, verbose=False)
    module = FashionMNISTClassifier()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
        callbacks=list(callbacks), logger=logger, log_every_n_steps=5,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module, trainer


def saved_ranks(path) -> list:
    return torch.load(path, map_location="cpu", weights_only=True)["hvdcompress"]["ranks"]


def resume_on_one(out: Path, ckpt: str) -> None:
    try:
        fit(
            CompressedDDPStrategy("3lc", bucket_cap_mb=BUCKET_MB, tuning=None),
            2,
            devices=1,
            ckpt_path=ckpt,
        )
        error = None
    except Exception as err:  # what the test asserts on
        error = f"{type(err).__name__}: {err}"
    (out / "resume_on_one.json").write_text(json.dumps({"error": error}))


def main() -> None:
    out = Path(sys.argv[1])
    if "--resume-on-one" in sys.argv:
        return resume_on_one(out, sys.argv[sys.argv.index("--resume-on-one") + 1])
    plain, trainer = fit(DDPStrategy(), 1)
    none, _ = fit(CompressedDDPStrategy("none"), 1)
    rank, size = trainer.global_rank, trainer.world_size

    strategy = CompressedDDPStrategy("3lc", bucket_cap_mb=BUCKET_MB, tuning=None)
    recorder, logger = StepRecorder(strategy), CaptureLogger()
    saver = ModelCheckpoint(dirpath=out / "ckpt", every_n_epochs=1, save_top_k=-1)
    full, _ = fit(strategy, 2, callbacks=[recorder, saver], logger=logger)
    digests = [None] * size
    torch.distributed.all_gather_object(digests, digest(full))
    first_epoch = sorted((out / "ckpt").glob("epoch=0-*.ckpt"))

    resumed, _ = fit(
        CompressedDDPStrategy("3lc", bucket_cap_mb=BUCKET_MB, tuning=None),
        2,
        ckpt_path=str(first_epoch[0]),
    )
    # the control: the same checkpoint without the hook states resumes elsewhere
    bare = out / f"bare{rank}.ckpt"
    saved = torch.load(first_epoch[0], map_location="cpu", weights_only=False)
    del saved["hvdcompress"]
    torch.save(saved, bare)
    with warnings.catch_warnings(record=True) as bare_caught:
        warnings.simplefilter("always")
        bare_run, _ = fit(
            CompressedDDPStrategy("3lc", bucket_cap_mb=BUCKET_MB, tuning=None),
            2,
            ckpt_path=str(bare),
        )

    trap_state = hvdcompress.DDPHookState("3lc")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(DDPStrategy(ddp_comm_state=trap_state, ddp_comm_hook=hvdcompress.ddp_hook), 1)
    result = {
        "rank": rank,
        "size": size,
        "none_vs_plain_max_diff": max_diff(plain, none),
        "steps": recorder.steps,
        "numel": sum(p.numel() for p in full.parameters()),
        "digests_3lc": digests,
        "logged_keys": sorted({k for m in logger.metrics for k in m}),
        "logged_bits": [
            m["hvdcompress/bits_per_value"]
            for m in logger.metrics
            if "hvdcompress/bits_per_value" in m
        ],
        "checkpoints": [p.name for p in first_epoch],
        "resume_equal": digest(resumed) == digest(full),
        "resume_max_diff": max_diff(resumed, full),
        "bare_resume_equal": digest(bare_run) == digest(full),
        "bare_warnings": [str(w.message) for w in bare_caught if "hvdcompress" in str(w.message)],
        "saved_ranks": len(saved_ranks(first_epoch[0])),
        "trap_hook_calls": trap_state.hook_calls,
        "trap_warnings": [
            str(w.message) for w in caught if "never called its hook" in str(w.message)
        ],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
