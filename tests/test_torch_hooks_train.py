"""scripts/train.py ``--launcher torchrun --torch-hook``: torch's own DDP communication
(DDP's allreduce, bf16_compress_hook, PowerSGD) trains through the same loop as
hvdcompress's hook, with the per-epoch accuracy lines and a summary whose bytes are those
the hook hands its allreduces; the flag's conflicts are one-line argparse errors."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
CHANCE = 0.1  # ten classes


def _train_module():
    spec = importlib.util.spec_from_file_location("_script_train_torch_hooks", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(stdout: str) -> dict[str, str]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("summary:")]
    words = line.split()[1:]
    return dict(zip(words[::2], words[1::2], strict=True))


@pytest.mark.parametrize(
    "hook, compression, bits_per_value",
    [
        (["allreduce"], "torch-allreduce", lambda bits: bits == 32.0),
        (["bf16"], "torch-bf16", lambda bits: bits == 16.0),
        # two dense steps, then rank-2 factors of the conv and linear weights
        (["powersgd", "--powersgd-rank", "2"], "torch-powersgd-r2", lambda bits: bits < 16.0),
    ],
    ids=["allreduce", "bf16", "powersgd"],
)
def test_each_torch_hook_trains_two_ranks_and_reports_its_bytes(
    hook, compression, bits_per_value, tmp_path
):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(TRAIN), "--launcher", "torchrun", "--torch-hook", *hook, "--dataset",
        "synthetic", "--synthetic-size", "1024", "--batch-size", "32", "--epochs", "2",
        "--threads", "1", "--no-progress", "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    epochs = re.findall(r"^step (\d+) epoch (\d) loss \S+ test_acc (\S+)$", done.stdout, re.M)
    assert [(s, e) for s, e, _ in epochs] == [("16", "0"), ("32", "1")]
    summary = _summary(done.stdout)
    assert summary["compression"] == compression and summary["steps"] == "32"
    learned = float(summary["last_loss"]) < float(summary["first_loss"])
    assert learned or float(summary["test_accuracy"]) > CHANCE, summary
    assert bits_per_value(float(summary["bits_per_value_ranks"])), summary
    # torch's hook moves the bytes: no transport of hvdcompress counted them
    assert "sent_bytes_per_rank" not in summary and "received_bytes_per_rank" not in summary
    header, first = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()[:2]
    row = dict(zip(header.split(","), first.split(","), strict=True))
    # PowerSGD's first steps are a dense allreduce
    assert row["bits_per_value"] == ("16.0000" if compression == "torch-bf16" else "32.0000")
    assert row["compress_s"] == row["sent_bytes"] == row["received_bytes"] == ""


CONFLICTS = [
    (["--torch-hook", "bf16"], r"--torch-hook needs --launcher torchrun"),
    (["--launcher", "mpirun", "--torch-hook", "allreduce"], r"--torch-hook needs --launcher"),
    (
        ["--launcher", "torchrun", "--torch-hook", "powersgd", "--compression", "topk"],
        r"--torch-hook powersgd replaces --compression: not both",
    ),
    (
        ["--launcher", "torchrun", "--torch-hook", "bf16", "--compression-param", "sparsity=1.5"],
        r"--torch-hook bf16 replaces --compression: not both",
    ),
    (["--torch-hook", "fp16"], r"--torch-hook: invalid choice: 'fp16'"),
    (["--powersgd-rank", "0"], r"--powersgd-rank: expected an int >= 1, got 0"),
    (
        ["--launcher", "torchrun", "--torch-hook", "powersgd", "--powersgd-start-iter", "1"],
        r"--powersgd-start-iter: expected an int >= 2, got 1",
    ),
]


@pytest.mark.parametrize("argv, message", CONFLICTS, ids=[" ".join(a) for a, _ in CONFLICTS])
def test_torch_hook_conflicts_are_one_line_argparse_errors(argv, message, capsys):
    train = _train_module()
    with pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert err.strip().splitlines()[-1].startswith("train.py: error: ")


def test_one_powersgd_state_for_training_and_timing_compresses_every_matrix():
    """torch_hooks.powersgd_state, which train.py's TorchHook and bench_peers both build:
    min_compression_rate 1 (torch's default is 2), the rank and the start iteration given,
    the start iteration at least 2; train.py's --powersgd-start-iter reaches it."""
    from hvdcompress.training.torch_hooks import POWERSGD_START_ITER, powersgd_state

    state = powersgd_state(2, 7)
    assert state.min_compression_rate == 1 and state.start_powerSGD_iter == 7
    assert state.matrix_approximation_rank == 2
    assert powersgd_state(1).start_powerSGD_iter == POWERSGD_START_ITER == 2
    with pytest.raises(ValueError, match="must be >= 2, got 1"):
        powersgd_state(1, 1)
    train = _train_module()
    base = ["--launcher", "torchrun", "--torch-hook", "powersgd"]
    assert train.parse_args(base).powersgd_start_iter == 2
    assert train.parse_args([*base, "--powersgd-start-iter", "30"]).powersgd_start_iter == 30


def test_torch_hook_counts_every_step_before_the_start_iteration_as_dense(tmp_path):
    """TorchHook with PowerSGD starting at step 4 (a one-rank world): steps 1-4 hand the
    allreduce every value, steps 5 on the rank-1 factors of the one weight matrix (the
    bias dense), as torch's hook sends them."""
    import torch
    import torch.distributed as tdist

    from hvdcompress.training.torch_hooks import TorchHook, ddp_options

    store = tdist.FileStore(str(tmp_path / "store"), 1)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 32)
        ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_options("powersgd"))
        hook = TorchHook(ddp, "powersgd", 1, powersgd_start_iter=4)
        assert hook.powersgd_state.start_powerSGD_iter == 4
        sent = []
        for _ in range(6):
            ddp(torch.randn(8, 64)).sum().backward()
            sent.append(hook.step_stats().payload_bytes // 4)
        del ddp, hook
    finally:
        tdist.destroy_process_group()
    assert sent == [64 * 32 + 32] * 4 + [64 + 32 + 32] * 2, sent


def test_a_resumed_powersgd_hook_does_not_warm_up_again(tmp_path):
    """Resumed at step 5 (``resume_at``: train.py's --resume), a hook that starts
    compressing at step 4 sends the factors from its first step on, not 4 dense steps
    again; resumed at step 2, it finishes the warm-up (steps 3-4 dense) and goes on."""
    import torch
    import torch.distributed as tdist

    from hvdcompress.training.torch_hooks import TorchHook, ddp_options

    store = tdist.FileStore(str(tmp_path / "store"), 1)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    sent = {}
    try:
        for at in (5, 2):
            torch.manual_seed(0)
            ddp = torch.nn.parallel.DistributedDataParallel(
                torch.nn.Linear(64, 32), **ddp_options("powersgd")
            )
            hook = TorchHook(ddp, "powersgd", 1, powersgd_start_iter=4)
            hook.resume_at(at)
            sent[at] = []
            for _ in range(4):
                ddp(torch.randn(8, 64)).sum().backward()
                sent[at].append(hook.step_stats().payload_bytes // 4)
            del ddp, hook
    finally:
        tdist.destroy_process_group()
    dense, factors = 64 * 32 + 32, 64 + 32 + 32
    assert sent[5] == [factors] * 4, sent
    assert sent[2] == [dense] * 2 + [factors] * 2, sent
