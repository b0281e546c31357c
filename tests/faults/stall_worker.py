"""One rank of tests/faults/test_stalled_rank.py: a job whose last rank stalls in the
middle of a step, with the user's timeout on the process group.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... LOCAL_RANK=r LOCAL_WORLD_SIZE=n \
        python tests/faults/stall_worker.py MODE TIMEOUT_S STALL_S OUT

MODE: ``hook`` (DDP with the hook, overlap on), ``hook-inline`` (overlap off), ``ddp``
(plain DDP, the reference), ``optimizer`` (DistributedOptimizer over a threaded
torch.distributed transport), ``lightning`` (CompressedDDPStrategy), ``accelerate``
(hvdcompress.accelerate.register). Every mode trains a small MLP; at step ``STALL_AT`` the
last rank sleeps ``STALL_S`` seconds before its forward pass, then exits. The other ranks
write OUT/rank<r>.json: the seconds from the start of that step until the step failed
(or ended), and the error's type and text. A rank never waits for its threads to end
(``os._exit``): the report is what is measured, not the teardown of a broken job.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STALL_AT = 3  # the step at which the last rank stalls (after DDP has built its buckets)
STEPS = 6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + int(os.environ["RANK"]))
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


class Clock:
    """Stalls the last rank at ``STALL_AT``; times the other ranks' step ``STALL_AT``."""

    def __init__(self, stall_s: float, out: Path) -> None:
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.stall_s, self.out, self.t0 = stall_s, out, None

    def before_step(self, step: int) -> None:
        if step != STALL_AT:
            return
        if self.rank == self.size - 1:
            time.sleep(self.stall_s)
            os._exit(0)
        self.t0 = time.monotonic()

    def report(self, error: BaseException | None) -> None:
        seconds = None if self.t0 is None else time.monotonic() - self.t0
        text = None if error is None else f"{type(error).__name__}: {error}"[:600]
        report = {"rank": self.rank, "seconds": seconds, "error": text}
        (self.out / f"rank{self.rank}.json").write_text(json.dumps(report))
        sys.stdout.flush()
        os._exit(0)


def _ddp_loop(clock: Clock, timeout: datetime.timedelta, mode: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcompress

    dist.init_process_group("gloo", timeout=timeout)
    if mode == "optimizer":
        from hvdcompress.transports.torch_dist import TorchDistTransport

        model = _model()
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
            compression="3lc", backend=TorchDistTransport(threaded=True),
        )  # fmt: skip
    else:
        model = DDP(_model())
        if mode != "ddp":
            hvdcompress.DDPHookState("3lc", overlap=mode == "hook").register(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        for step in range(STEPS):
            clock.before_step(step)
            x, y = _batch(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    except Exception as err:  # noqa: BLE001 - the report carries it
        clock.report(err)
    clock.report(None)


def _lightning_loop(clock: Clock, timeout: datetime.timedelta) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hvdcompress.lightning import CompressedDDPStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            clock.before_step(batch_idx)
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    n = 16 * STEPS * clock.size  # Lightning gives each rank its share
    data = TensorDataset(torch.randn(n, 32), torch.randint(0, 4, (n,)))
    trainer = pl.Trainer(
        strategy=CompressedDDPStrategy("3lc", timeout=timeout), accelerator="cpu",
        devices=clock.size, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(Module(), DataLoader(data, batch_size=16))
    except Exception as err:  # noqa: BLE001 - the report carries it
        clock.report(err)
    clock.report(None)


def _accelerate_loop(clock: Clock, timeout: datetime.timedelta) -> None:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    import hvdcompress.accelerate

    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=timeout)])
    model = accelerator.prepare(_model())
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05))
    hvdcompress.accelerate.register(accelerator, model, compression="3lc")
    try:
        for step in range(STEPS):
            clock.before_step(step)
            x, y = _batch(step)
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
    except Exception as err:  # noqa: BLE001 - the report carries it
        clock.report(err)
    clock.report(None)


def main() -> None:
    mode, timeout_s, stall_s, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    clock = Clock(stall_s, Path(out))
    timeout = datetime.timedelta(seconds=timeout_s)
    if mode == "lightning":
        _lightning_loop(clock, timeout)
    elif mode == "accelerate":
        _accelerate_loop(clock, timeout)
    else:
        _ddp_loop(clock, timeout, mode)


if __name__ == "__main__":
    main()
