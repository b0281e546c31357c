"""Rank 0's progress during scripts/train.py: a tqdm bar when its stderr is a terminal,
otherwise (horovodrun, mpirun, srun and torchrun pipe it) one plain line every few
seconds, since a carriage-return bar would reach a pipe as one endless line."""

from __future__ import annotations

import sys
import time


class ProgressLines:
    """Rank 0's progress without a terminal: one plain line (to stderr, flushed) every
    ``every`` seconds and at the last step, instead of tqdm's carriage returns."""

    def __init__(self, total: int, start: int, every: float) -> None:
        self.total, self.start, self.every = total, start, every
        self.began = self.last = time.monotonic()

    def update(self, step: int, loss: float, bits_per_value: float) -> None:
        now = time.monotonic()
        if now - self.last < self.every and step < self.total:
            return
        self.last = now
        rate = (step - self.start) / max(now - self.began, 1e-9)
        print(
            f"progress: step {step}/{self.total} ({100 * step / max(self.total, 1):.0f}%) "
            f"loss {loss:.4f} bits_per_value {bits_per_value:.2f} {rate:.1f} steps/s",
            file=sys.stderr,
            flush=True,
        )


class Progress:
    """The bar or the lines (or neither, ``--no-progress``) from step ``start`` to
    ``total``; ``has_bar`` says whether evaluations go through the bar's postfix instead
    of a printed line."""

    def __init__(self, total: int, start: int, every: float, enabled: bool) -> None:
        self.bar = self.lines = None
        if not enabled:
            return
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)
        else:
            self.lines = ProgressLines(total, start, every)

    @property
    def has_bar(self) -> bool:
        return self.bar is not None

    def update(self, step: int, loss: float, bits_per_value: float) -> None:
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", bpv=f"{bits_per_value:.2f}")
        if self.lines:
            self.lines.update(step, loss, bits_per_value)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
