"""One rank of tests/test_accelerate.py: hvdcompress.accelerate with the real Hugging
Face Accelerate, CPU ranks started by ``accelerate launch`` (gloo).

    accelerate launch --multi_gpu --num_processes 2 tests/integrations/accelerate_worker.py OUT
    accelerate launch --multi_gpu --num_processes 3 tests/integrations/accelerate_worker.py \
        OUT --resume STATE_DIR
    python tests/integrations/accelerate_worker.py OUT --one-process

Writes OUT/rank<r>.json: Accelerate's plain DDP against register(compression="none");
a 3LC run of 2 x STEPS steps with the hook calls and gradient elements of every step and
the parameter digests of every rank, saving its state (save_state) after STEPS steps;
that state resumed for the last STEPS steps; the same resume without the hook states
(the control); a wrong model passed to register. --resume: the error of loading the
2-rank state on another world size. --one-process: what register says with one process.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

import hvdcompress.accelerate
from hvdcompress.training.data import load_fashion_mnist
from hvdcompress.training.models import build_model
from tests.integrations.common import digest, max_diff

STEPS = 12
DDP_KWARGS = DistributedDataParallelKwargs(bucket_cap_mb=0.25)  # several DDP buckets
DATA = load_fashion_mnist()[0]


def batch(rank: int, size: int, step: int):
    """Rank ``rank``'s 32 examples of step ``step`` (disjoint across ranks)."""
    start = (step * size + rank) * 32
    x, y = DATA
    return x[start : start + 32], y[start : start + 32]


def prepared():
    """A new Accelerator (each run saves and loads only its own model) and the prepared
    CNN and optimizer."""
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DDP_KWARGS])
    torch.manual_seed(0)
    model = build_model("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return (accelerator, *accelerator.prepare(model, optimizer))


def train(accelerator, model, optimizer, steps: range, state=None) -> list:
    recorded, calls = [], 0 if state is None else state.hook_calls
    for step in steps:
        x, y = batch(accelerator.process_index, accelerator.num_processes, step)
        optimizer.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        if state is not None:
            recorded.append([state.hook_calls - calls, state.last_stats.numel])
            calls = state.hook_calls
    return recorded


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # what the test asserts on
        return f"{type(err).__name__}: {err}"
    return None


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    rank, size = accelerator.process_index, accelerator.num_processes
    if "--one-process" in sys.argv:
        accelerator, model, _ = prepared()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = hvdcompress.accelerate.register(accelerator, model)
        result = {"kind": str(accelerator.distributed_type), "state": repr(state),
                  "warnings": [str(w.message) for w in caught]}  # fmt: skip
        (out / "one_process.json").write_text(json.dumps(result))
        return
    if "--resume" in sys.argv:
        accelerator, model, optimizer = prepared()
        hvdcompress.accelerate.register(accelerator, model, compression="3lc", tuning=None)
        error = error_of(lambda: accelerator.load_state(sys.argv[sys.argv.index("--resume") + 1]))
        (out / f"resume{rank}.json").write_text(json.dumps({"size": size, "error": error}))
        return

    accelerator, plain, plain_opt = prepared()
    train(accelerator, plain, plain_opt, range(STEPS))
    accelerator, none, none_opt = prepared()
    none_state = hvdcompress.accelerate.register(accelerator, none, compression="none")
    train(accelerator, none, none_opt, range(STEPS), none_state)

    accelerator, full, full_opt = prepared()
    state = hvdcompress.accelerate.register(accelerator, full, compression="3lc", tuning=None)
    steps = train(accelerator, full, full_opt, range(STEPS), state)
    accelerator.save_state(str(out / "state"))
    steps += train(accelerator, full, full_opt, range(STEPS, 2 * STEPS), state)
    digests = [None] * size
    torch.distributed.all_gather_object(digests, digest(full))

    accelerator, resumed, resumed_opt = prepared()
    hvdcompress.accelerate.register(accelerator, resumed, compression="3lc", tuning=None)
    accelerator.load_state(str(out / "state"))
    resumed_state_files = sorted(p.name for p in (out / "state").glob("hvdcompress_*"))
    train(accelerator, resumed, resumed_opt, range(STEPS, 2 * STEPS))

    accelerator.wait_for_everyone()
    if rank == 0:  # the control: the same state without the hook states
        shutil.copytree(out / "state", out / "bare")
        for f in (out / "bare").glob("hvdcompress_*"):
            f.unlink()
    accelerator.wait_for_everyone()
    accelerator, bare, bare_opt = prepared()
    hvdcompress.accelerate.register(accelerator, bare, compression="3lc", tuning=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state(str(out / "bare"))
    train(accelerator, bare, bare_opt, range(STEPS, 2 * STEPS))

    result = {
        "rank": rank,
        "size": size,
        "kind": str(accelerator.distributed_type),
        "none_vs_plain_max_diff": max_diff(plain, none),
        "steps": steps,
        "numel": sum(p.numel() for p in full.parameters()),
        "digests_3lc": digests,
        "bits_per_value": state.last_stats.bits_per_value,
        "state_files": resumed_state_files,
        "resume_equal": digest(resumed) == digest(full),
        "resume_max_diff": max_diff(resumed, full),
        "bare_resume_equal": digest(bare) == digest(full),
        "bare_warnings": [str(w.message) for w in caught if "hvdcompress" in str(w.message)],
        "unprepared_error": error_of(
            lambda: hvdcompress.accelerate.register(accelerator, build_model("cnn"))
        ),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
