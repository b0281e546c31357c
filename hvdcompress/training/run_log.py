"""Rank 0's files of a scripts/train.py run in ``--log-dir``, and its ``summary:`` line.

``metrics.csv`` (one row per step: loss, bytes, bits per value, times, learning rate),
``epochs.csv`` (one row per evaluation, with the bits per value of every rank),
``policy.csv`` (a policy's per-tensor levels / budgets, long format), TensorBoard events
and ``accordion.json``. Appended to on ``--resume`` so that a resumed run's logs read as
one run. Kept apart from the training loop so that the loop says what is recorded when,
and this module how.

Runs with one of torch's own DDP hooks (``measured=False``) have no transport that counts
bytes and no compression time of hvdcompress's: those columns stay empty and the summary
leaves out ``sent_bytes_per_rank`` / ``received_bytes_per_rank``, rather than show zeros.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import hvdcompress
from hvdcompress.stats import StepStats

METRICS_COLUMNS = ["step", "epoch", "loss", "test_acc", "bytes_sent", "payload_bytes",
                   "raw_bytes", "bits_per_value", "compress_s", "step_s", "lr",
                   "sent_bytes", "received_bytes"]  # fmt: skip
EPOCHS_COLUMNS = ["step", "epoch", "lr", "test_acc", "payload_bits_ranks", "values_ranks",
                  "bits_per_value_ranks"]  # fmt: skip
POLICY_KEYS = ("level/", "T/", "cat/")  # what policy.csv keeps of the step's metrics


class RunLog:
    """The open files of ``log_dir`` (none without one); ``close`` ends them."""

    def __init__(self, log_dir: str | None, *, resume: bool, policy, measured: bool) -> None:
        self.log_dir = Path(log_dir) if log_dir else None
        self.policy, self.measured = policy, measured
        self.files = {}  # name: open handle
        self.metrics = self.epochs = self.policy_rows = self.writer = None
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = self._csv("metrics.csv", METRICS_COLUMNS, resume)
        self.epochs = self._csv("epochs.csv", EPOCHS_COLUMNS, resume)
        if policy is not None:  # long format: level / T per tensor, modelled vs measured
            self.policy_rows = self._csv("policy.csv", ["step", "key", "value"], resume)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir))
        except ImportError as err:
            print(f"train: no TensorBoard events ({err}); metrics.csv only", file=sys.stderr)

    def _csv(self, name: str, header: list[str], resume: bool):
        handle = open(self.log_dir / name, "a" if resume else "w", newline="")
        self.files[name] = handle
        out = csv.writer(handle)
        if not resume:
            out.writerow(header)
        return out

    def step(self, step: int, epoch: int, loss: float, acc: float | None, stats: StepStats,
             step_s: float, lr: float) -> None:  # fmt: skip
        """One optimizer step's row, policy entries and TensorBoard scalars."""
        measured = self.measured
        if self.metrics:
            self.metrics.writerow(
                [step, epoch, f"{loss:.6f}", "" if acc is None else f"{acc:.4f}",
                 f"{stats.wire_bytes:.0f}", stats.payload_bytes, stats.raw_bytes,
                 f"{stats.bits_per_value:.4f}", f"{stats.compress_s:.6f}" if measured else "",
                 f"{step_s:.6f}", f"{lr:.6g}", stats.sent_bytes if measured else "",
                 stats.received_bytes if measured else ""]
            )  # fmt: skip
        if self.policy_rows:
            for key, value in sorted(stats.metrics.items()):
                if key.startswith(POLICY_KEYS):
                    self.policy_rows.writerow([step, key, value])
        if self.writer:
            scalars = {"train/loss": loss, "comm/bytes_sent": stats.wire_bytes}
            if measured:
                scalars["comm/sent_bytes_measured"] = stats.sent_bytes
                scalars["comm/received_bytes_measured"] = stats.received_bytes
            scalars["comm/bits_per_value"] = stats.bits_per_value
            if measured:
                scalars["time/compress_s"] = stats.compress_s
            scalars.update({"time/step_s": step_s, "train/lr": lr})
            if acc is not None:
                scalars["test/accuracy"] = acc
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)

    def evaluation(self, step: int, epoch: int, lr: float, acc: float, bits: float,
                   values: float) -> None:  # fmt: skip
        """An evaluation's row of epochs.csv: the payload bits and gradient values of every
        rank since the last one. Flushed: a run killed later keeps its finished epochs."""
        if self.epochs:
            self.epochs.writerow(
                [step, epoch, f"{lr:.6g}", f"{acc:.4f}", f"{bits:.0f}", f"{values:.0f}",
                 f"{bits / max(values, 1.0):.4f}"]
            )  # fmt: skip
            self.files["epochs.csv"].flush()

    def close(self, final_acc: float, step: int) -> None:
        """The final accuracy's event, the files closed, Accordion's trace written."""
        if self.writer:
            self.writer.add_scalar("test/final_accuracy", final_acc, step)
            self.writer.close()
        for handle in self.files.values():
            handle.close()
        if self.log_dir and isinstance(self.policy, hvdcompress.Accordion):
            write_accordion_trace(self.log_dir / "accordion.json", self.policy)


def write_accordion_trace(path: Path, policy: hvdcompress.Accordion) -> None:
    """Accordion's decisions in this process (step, reason, level per tensor, the norms
    averaged over ranks, in ``names`` order) with eta: the norm-change trace that
    scripts/plot_policy.py draws under the levels."""
    trace = {"eta": policy.eta, "low": policy.low, "high": policy.high,
             "names": policy.names, "decisions": policy.history}  # fmt: skip
    path.write_text(json.dumps(trace, indent=1))
