"""Every registered compressor trains with its defaults: ``scripts/train.py --compression
NAME`` with no compressor parameters and no --lr / --momentum (so the compressor's
declared ``sgd_lr_factor`` and ``sgd_momentum`` apply; docs/codecs.md, "Defaults that
train") ends with a finite loss and a test accuracy of at least four times chance after
150 steps of Fashion-MNIST on two simulated ranks (each run about 6 s). The longer runs
behind the declarations are docs/codecs.md's table."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvdcompress.compressors.registry import REGISTRY, names

TRAIN = Path(__file__).parents[1] / "scripts" / "train.py"
CHANCE = 0.1  # ten classes


def _train(name: str) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, str(TRAIN), "--simulate-ranks", "2", "--batch-size", "32",
           "--steps", "150", "--no-progress", "--compression", name]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    summary = re.search(r"summary: .*", done.stdout)
    fields = summary.group(0).split()[1:] if summary else []
    return done, dict(zip(fields[::2], fields[1::2], strict=False))


@pytest.mark.parametrize("name", names())
def test_the_default_run_ends_finite_and_above_chance(name):
    done, summary = _train(name)
    assert done.returncode == 0, done.stderr[-2000:]
    assert math.isfinite(float(summary["last_loss"])), summary
    assert float(summary["test_accuracy"]) >= 4 * CHANCE, summary


def test_train_py_says_which_recommended_settings_it_applied():
    done, _ = _train("signsgd")
    assert "signsgd's recommended SGD settings: lr 0.0001 (0.05 x 0.002)" in done.stderr


def test_the_declared_settings_are_sane():
    for name, cls in REGISTRY.items():
        assert 0.0 < cls.spec.sgd_lr_factor <= 10.0, name
        assert cls.spec.sgd_momentum is None or 0.0 <= cls.spec.sgd_momentum < 1.0, name
