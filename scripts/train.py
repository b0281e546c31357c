#!/usr/bin/env python
"""Data-parallel Fashion-MNIST training with hvdcompress.DistributedOptimizer.

Launch with any of (one process per rank; each rank trains on its shard):

    horovodrun -np 4 python scripts/train.py --compression 3lc --epochs 1
    mpirun -np 4 python scripts/train.py --backend mpi4py --compression powersgd \
        --compression-param matrix_rank=2

``--compression`` takes any name of ``hvdcompress.available()``; ``--compression-param
KEY=VALUE`` (repeatable) passes its parameters. DGC applies ``--momentum`` itself (momentum
correction), so with ``--compression dgc`` the wrapped SGD runs without momentum.
    horovodrun --gloo -np 4 python scripts/train.py --backend horovod
    mpirun -np 4 python scripts/train.py --backend mpi4py
    srun --mpi=pmix python scripts/train.py          (see slurm/)
    torchrun --nproc_per_node 4 scripts/train.py --launcher torchrun --compression 3lc

``--launcher torchrun``: no Horovod or MPI; torch.distributed (gloo, or NCCL with
``--ddp-backend nccl``) and DistributedDataParallel with ``hvdcompress.ddp_hook`` (the
same payloads, moved by ``transports.torch_dist``); the other launchers run one process per
rank with ``--backend``. Progress: rank 0 shows a tqdm bar when its stderr is a terminal,
and otherwise (horovodrun, mpirun and srun pipe it) a plain line every
``--progress-every`` seconds.

Data: the idx files of Debian's ``dataset-fashion-mnist`` in
/usr/share/datasets/fashion-mnist (``--dataset synthetic`` needs none). Every rank starts
from rank 0's parameters and sees a disjoint shard of each epoch's seeded permutation,
with the same number of steps (the remainder is dropped, so no rank waits alone in a
collective). Rank 0 shows a progress bar and writes ``metrics.csv`` and TensorBoard
events to ``--log-dir``: loss, test accuracy, bytes sent per step (per rank, ring model
of docs/exchanges.md), bits per value, compression time and step time. ``--checkpoint DIR``
saves one file per rank and step (error-feedback residuals are per rank), verified by a
sha256 digest, loaded without unpickling code, written atomically; the newest
``--keep-checkpoints`` of each rank stay. ``--resume`` continues from the newest step whose
files verify and load on every rank, and gives the same parameters as an uninterrupted
run. Every argument is checked before training starts (exit status 2 with the valid
range), the checkpoint and log directories included.

Policies: ``--accordion LOW HIGH`` switches each tensor between two levels of
``--compression`` (3lc sparsity, topk ratio, powersgd matrix_rank; interval = one epoch or
``--accordion-interval`` steps); ``--cat topk`` picks each tensor's top-k budget by CAT
(``--cat-cost C0,C1[,PACKET_BITS]`` or calibration, ``--cat-every S``). With a policy,
``--log-dir`` also gets ``policy.csv`` (step, key, value: ``level/<tensor>``,
``T/<tensor>``, ``cat/modelled_s``, ``cat/measured_s``); ``scripts/plot_policy.py`` draws
it next to the loss.

Learning rate: ``--lr-schedule`` constant, step (the default: x``--lr-gamma`` 0.1 after
the ``--milestones`` epochs, by default 50% and 80% of ``--epochs``) or cosine, with
``--warmup-epochs`` of linear warmup (hvdcompress.training.schedule); a pure function of
the step, set before every step, logged (``lr`` in metrics.csv, ``train/lr`` in
TensorBoard) and kept in checkpoints (a resume with other schedule flags is refused).
After each evaluation rank 0 writes ``epochs.csv``: step, epoch, lr, test accuracy and the
bits per value of every rank since the last evaluation (one small sum over ranks); the
summary line gives ``bits_per_value_ranks``, the mean over ranks and the run.

Simulated ranks: ``--simulate-ranks N`` plays N ranks in this one process, as threads of
hvdcompress.training.simulate (one model replica, optimizer, compressor bound to its rank
and data shard per rank; the same code path as a real run): no launcher, and the same
final ``param_digest`` as ``mpirun -np N`` / ``horovodrun -np N`` with the same flags for
the gather-path compressors (docs/horovod-parity.md, "The simulated world").

Data, models and policies come from ``hvdcompress.training``; ranks, the broadcast of the
initial parameters and the sums of the evaluation from the optimizer's transport
(``hvdcompress.transports``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

import hvdcompress
from hvdcompress.checkpoint import (
    DEFAULT_KEEP,
    CheckpointError,
    check_tensor,
    check_writable_dir,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    save_rank_checkpoint,
    verified_steps,
)
from hvdcompress.ddp import hooked_optimizer
from hvdcompress.training.data import DATA_DIR, DatasetNotFound, load_fashion_mnist, synthetic
from hvdcompress.training.methods import build_policy, check_level, parse_cost, parse_params
from hvdcompress.training.models import IMAGE_MODELS, MODELS
from hvdcompress.training.schedule import (
    DEFAULT_GAMMA,
    DEFAULT_KIND,
    LRSchedule,
    default_milestones,
    parse_milestones,
)
from hvdcompress.training.schedule import KINDS as SCHEDULES
from hvdcompress.training.simulate import run_ranks, seeded
from hvdcompress.transports import make_transport


# ---- helpers -------------------------------------------------------------------------------
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


def default_threads(local_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(local_size, 1))


def param_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# ---- arguments -----------------------------------------------------------------------------
class UsageError(SystemExit):
    """A bad command line: exit status 2 (argparse's), ``str()`` is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise UsageError(message)


def int_at_least(low: int, high: int | None = None):
    """An argparse type: an int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < low or (high is not None and value > high):
            valid = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"expected an int {valid}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def finite_float(low: float, *, low_open: bool = False, high: float | None = None,
                 high_open: bool = False):  # fmt: skip
    """An argparse type: a finite float in the interval (brackets as given)."""
    left = "(" if low_open else "["
    right = "]" if high is None or not high_open else ")"
    valid = f"in {left}{low}, {'inf' if high is None else high}{right}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low)
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a finite number {valid}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


POSITIVE = int_at_least(1)
NON_NEGATIVE = int_at_least(0)


# ---- training ------------------------------------------------------------------------------
def parse_args(argv=None):
    """The command line, every argument checked (exit status 2 naming the valid values);
    ``check_args`` checks the combinations, ``check_dirs`` the directories."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


BASE_LR = 0.05  # plain SGD's learning rate and momentum on this job
BASE_MOMENTUM = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", choices=["fashion-mnist", "synthetic"], default="fashion-mnist")
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--synthetic-size", type=POSITIVE, default=4096, help="training examples")
    p.add_argument("--model", choices=sorted(IMAGE_MODELS), default="cnn")
    p.add_argument("--width", type=POSITIVE, default=16, help="channels of the first layer")
    p.add_argument(
        "--compression",
        choices=sorted(hvdcompress.compressors.REGISTRY),
        default="3lc",
        help="compressor (hvdcompress.available() lists their parameters)",
    )
    p.add_argument(
        "--compression-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="compressor parameter, repeatable: --compression-param ratio=0.01",
    )
    p.add_argument(
        "--sparsity",
        type=finite_float(1.0, high=2.0, high_open=True),
        default=1.0,
        help="3LC sparsity multiplier [1, 2)",
    )
    p.add_argument(
        "--accordion",
        nargs=2,
        type=float,
        default=None,
        metavar=("LOW", "HIGH"),
        help="Accordion policy: the --compression level of low / high compression\n"
        "(3lc sparsity 1.0 1.9; topk ratio 0.99 0.1; powersgd matrix_rank 2 1)",
    )
    p.add_argument("--accordion-eta", type=finite_float(0.0, low_open=True), default=0.5)
    p.add_argument(
        "--accordion-interval", type=POSITIVE, default=None, help="steps (default: one epoch)"
    )
    p.add_argument(
        "--cat",
        choices=["topk", "topk+q", "randomk"],
        default=None,
        help="CAT policy: per-tensor budget; needs --compression topk, topkq or gspar",
    )
    p.add_argument("--cat-every", type=POSITIVE, default=200, help="recompute T* every S steps")
    p.add_argument(
        "--cat-cost",
        default=None,
        metavar="C0,C1[,PACKET_BITS]",
        help="cost model in seconds and seconds per bit (or per packet); default: calibrate",
    )
    p.add_argument("--backend", choices=["horovod", "mpi4py"], default="horovod")
    p.add_argument(
        "--launcher",
        choices=["horovodrun", "mpirun", "srun", "torchrun"],
        default=None,
        help="torchrun: torch.distributed + DDP with hvdcompress.ddp_hook (--backend unused)",
    )
    p.add_argument("--ddp-backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument(
        "--fusion-threshold", type=NON_NEGATIVE, default=None, help="bytes per collective"
    )
    p.add_argument(
        "--compress-min-numel",
        type=NON_NEGATIVE,
        default=0,
        help="send tensors with fewer elements uncompressed (fast links)",
    )
    p.add_argument(
        "--exchange",
        choices=["auto", "allgather", "twostage"],
        default="auto",
        help="gather-only codecs: one allgather, the two-stage exchange (reduce-scatter + "
        "allgather of re-compressed shards), or per bucket by bytes (docs/exchanges.md)",
    )
    p.add_argument(
        "--link-cost",
        choices=["bytes", "measure"],
        default="bytes",
        help="--exchange auto: choose by modelled bytes, or by seconds from timing the "
        "link and the codec at start (link_cost='measure')",
    )
    p.add_argument("--epochs", type=POSITIVE, default=1)
    p.add_argument("--steps", type=POSITIVE, default=None, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=POSITIVE, default=64, help="per rank")
    p.add_argument(
        "--lr",
        type=finite_float(0.0, low_open=True),
        default=None,
        help=f"SGD learning rate (default {BASE_LR} times the compressor's sgd_lr_factor)",
    )
    p.add_argument(
        "--lr-schedule",
        choices=SCHEDULES,
        default=DEFAULT_KIND,
        help="learning rate over the run (hvdcompress.training.schedule); default step",
    )
    p.add_argument(
        "--milestones",
        type=milestones_arg,
        default=None,
        metavar="E1,E2,...",
        help="step schedule: epochs after which the rate is multiplied by --lr-gamma\n"
        "(default: after 50%% and 80%% of --epochs, whole epochs: 5,8 of 10)",
    )
    p.add_argument(
        "--lr-gamma", type=finite_float(0.0, low_open=True, high=1.0), default=DEFAULT_GAMMA
    )
    p.add_argument(
        "--warmup-epochs",
        type=finite_float(0.0),
        default=0.0,
        help="linear warmup to --lr over this many epochs (may be fractional)",
    )
    p.add_argument(
        "--momentum",
        type=finite_float(0.0, high=1.0, high_open=True),
        default=None,
        help=f"SGD momentum (default {BASE_MOMENTUM}, or the compressor's sgd_momentum)",
    )
    p.add_argument("--seed", type=int_at_least(0, 2**63 - 1 - 10**6), default=42)
    p.add_argument("--threads", type=POSITIVE, default=None, help="torch threads per rank")
    p.add_argument("--log-dir", default=None, help="metrics.csv and TensorBoard events")
    p.add_argument("--checkpoint", default=None, help="directory: one file per rank and step")
    p.add_argument("--checkpoint-every", type=NON_NEGATIVE, default=0, help="steps (0: at the end)")
    p.add_argument(
        "--keep-checkpoints",
        type=POSITIVE,
        default=DEFAULT_KEEP,
        help=f"checkpoints kept per rank, newest first (default {DEFAULT_KEEP})",
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--progress-every",
        type=finite_float(0.0, low_open=True),
        default=10.0,
        help="seconds between progress lines when rank 0 has no terminal",
    )
    p.add_argument(
        "--simulate-ranks",
        type=POSITIVE,
        default=None,
        metavar="N",
        help="play N ranks in this process (threads; no launcher, --backend unused)",
    )
    return p


def milestones_arg(text: str) -> list[float]:
    """An argparse type: comma-separated milestone epochs."""
    try:
        return parse_milestones(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def recommend_sgd(args) -> None:
    """Fill in --lr and --momentum where not given: the job's defaults, with the factor and
    momentum the compressor declares (``CompressorSpec.sgd_lr_factor`` / ``sgd_momentum``;
    docs/codecs.md, "Defaults that train"), as built with --compression-param (a bad
    parameter: the class's, and make_compression reports it). ``args.sgd_note`` says what
    was applied."""
    spec, built = hvdcompress.compressors.REGISTRY[args.compression].spec, None
    try:
        params = parse_params(args.compression_param)
        built = hvdcompress.get_compressor(args.compression, **params)
    except (TypeError, ValueError):
        pass
    applied = []
    if args.lr is None:
        factor = spec.lr_factor(built)
        args.lr = BASE_LR * factor
        if factor != 1.0:
            applied.append(f"lr {args.lr:g} ({BASE_LR} x {factor:g})")
    if args.momentum is None:
        args.momentum = BASE_MOMENTUM if spec.sgd_momentum is None else spec.sgd_momentum
        if spec.sgd_momentum is not None:
            applied.append(f"momentum {args.momentum:g}")
    args.sgd_note = (
        f"train: {args.compression}'s recommended SGD settings: {', '.join(applied)} "
        '(docs/codecs.md, "Defaults that train"; --lr / --momentum override)'
        if applied
        else ""
    )


def make_schedule(args, steps_per_epoch: int) -> LRSchedule:
    """The learning-rate schedule of the flags (default milestones from --epochs)."""
    milestones = args.milestones
    if milestones is None:
        milestones = default_milestones(args.epochs) if args.lr_schedule == "step" else []
    return LRSchedule(
        args.lr_schedule,
        args.lr,
        steps_per_epoch,
        args.epochs,
        tuple(milestones),
        args.lr_gamma,
        args.warmup_epochs,
    )


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The combinations of arguments: compressor parameters, policy levels and cost model,
    --resume; ``parser.error`` (exit status 2) on the first bad one."""
    recommend_sgd(args)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    if args.accordion and args.cat:
        parser.error("--accordion and --cat are exclusive")
    if args.milestones and args.lr_schedule != "step":
        parser.error(f"--milestones apply to --lr-schedule step, not {args.lr_schedule}")
    if args.simulate_ranks and args.launcher is not None:
        parser.error("--simulate-ranks runs every rank in this process: no --launcher")
    if args.accordion:
        for which, value in zip(("LOW", "HIGH"), args.accordion, strict=True):
            try:
                check_level(args.compression, value)
            except ValueError as err:
                parser.error(f"--accordion {which}: {err}")
    try:
        make_compression(args)
        make_policy(args)
    except SystemExit as err:
        parser.error(str(err))


def check_dirs(parser: argparse.ArgumentParser, args) -> None:
    """Create --checkpoint and --log-dir and check they are writable, before training."""
    for flag, directory in (("--checkpoint", args.checkpoint), ("--log-dir", args.log_dir)):
        if directory:
            try:
                check_writable_dir(directory, flag)
            except CheckpointError as err:
                parser.error(str(err))


def make_compression(args) -> tuple[hvdcompress.Compressor, float]:
    """(the compressor, the inner SGD's momentum): DGC applies ``--momentum`` itself
    (momentum correction), so the wrapped SGD then runs without momentum."""
    try:
        params = parse_params(args.compression_param)
    except ValueError as err:
        raise SystemExit(f"--compression-param {err}") from None
    momentum = args.momentum
    if args.compression == "3lc":
        params.setdefault("sparsity", args.sparsity)
    if args.compression == "dgc":
        params.setdefault("momentum", args.momentum)
        momentum = 0.0
    try:
        return hvdcompress.get_compressor(args.compression, **params), momentum
    except (TypeError, ValueError) as err:
        raise SystemExit(f"--compression {args.compression}: {err}") from None


def make_policy(args):
    """hvdcompress.Accordion / hvdcompress.CAT from the flags, or None."""
    if args.accordion and args.cat:
        raise SystemExit("--accordion and --cat are exclusive")
    if args.accordion:
        low, high = args.accordion
        return build_policy(
            "accordion",
            args.compression,
            low=low,
            high=high,
            eta=args.accordion_eta,
            interval_steps=args.accordion_interval,
        )
    if args.cat:
        need = hvdcompress.policies.cat.compressor_for(args.cat)
        if args.compression != need:
            raise SystemExit(f"--cat {args.cat} needs --compression {need}")
        cost = None
        if args.cat_cost:
            try:
                cost = parse_cost(args.cat_cost)
            except ValueError:
                raise SystemExit(
                    f"--cat-cost takes C0,C1[,PACKET_BITS], got {args.cat_cost!r}"
                ) from None
        return build_policy(
            "cat", args.compression, kind=args.cat, cost_model=cost, recompute_every=args.cat_every
        )
    return None


CKPT_FORMAT = "hvdcompress.train/1"


def apply_checkpoint(path: Path, model, opt, dist, schedule: LRSchedule | None = None) -> int:
    """Load ``path`` (this rank's file) into the model and optimizer; its step.
    ``CheckpointError`` for a file that does not verify or does not fit this run (another
    learning-rate ``schedule`` included)."""
    saved = load_checkpoint(path)
    if schedule is not None and "lr_schedule" in saved:
        try:
            schedule.check_resumable(saved["lr_schedule"])
        except ValueError as err:
            raise CheckpointError(f"{path}: {err}") from None
    for key in ("format", "step", "rank", "size", "model", "optimizer"):
        if key not in saved:
            raise CheckpointError(f"{path}: no {key!r} entry")
    if saved["format"] != CKPT_FORMAT:
        raise CheckpointError(f"{path}: format {saved['format']!r}, expected {CKPT_FORMAT!r}")
    if (saved["rank"], saved["size"]) != (dist.rank, dist.size):
        raise CheckpointError(
            f"{path}: saved by rank {saved['rank']} of {saved['size']}, this is rank "
            f"{dist.rank} of {dist.size}"
        )
    for kind in ("model", "optimizer"):  # NaN / Inf anywhere: refuse, do not train on it
        stack = [(kind, saved[kind])]
        while stack:
            where, value = stack.pop()
            if isinstance(value, torch.Tensor):
                check_tensor(f"{path}: {where}", value, dtype=None)
            elif isinstance(value, dict):
                stack.extend((f"{where}.{k}", v) for k, v in value.items())
            elif isinstance(value, (list, tuple)):
                stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
    try:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    except (ValueError, RuntimeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: does not fit this run: {err}") from None
    return int(saved["step"])


def resume(directory: Path, model, opt, dist, schedule: LRSchedule | None = None) -> int:
    """Load the newest step whose checkpoint verifies and loads on every rank; its step.
    Every rank takes part in the same small collectives and agrees on the step."""
    good, bad = verified_steps(directory, dist.rank)
    everyone = dist.allgather_object(good)
    common = sorted(set(everyone[0]).intersection(*everyone[1:]), reverse=True)
    problems = [f"{path.name}: {err}" for path, err in bad]
    for step in common:
        path = checkpoint_path(directory, dist.rank, step)
        loaded = error = None
        try:
            loaded = apply_checkpoint(path, model, opt, dist, schedule)
        except CheckpointError as err:  # an older step fully overwrites what was loaded
            error = str(err)
        errors = dist.allgather_object(error)
        if all(e is None for e in errors):
            if problems or step != max(good, default=step):
                print(f"train: rank {dist.rank} resumes from step {step}", file=sys.stderr)
            return loaded
        problems += [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if not list_checkpoints(directory, dist.rank) and not problems:
        old = directory / f"rank{dist.rank}.pt"
        note = (
            f" ({old.name} is an old pickled checkpoint: not loaded, unpickling could run code)"
            if old.exists()
            else ""
        )
        raise SystemExit(f"--resume: no checkpoint of rank {dist.rank} in {directory}{note}")
    detail = "; ".join(problems) or "no step has a verified file on every rank"
    raise SystemExit(f"--resume: no checkpoint in {directory} loads on every rank: {detail}")


def evaluate(model, test, dist, batch: int = 1000) -> float:
    x, y = test
    shard = range(dist.rank, len(x), dist.size)
    correct = 0
    model.eval()
    with torch.no_grad():
        idx = torch.tensor(list(shard), dtype=torch.long)
        for i in range(0, len(idx), batch):
            b = idx[i : i + batch]
            correct += int((model(x[b]).argmax(1) == y[b]).sum())
    model.train()
    total_correct, total = dist.sum_floats([float(correct), float(len(shard))])
    return total_correct / max(total, 1.0)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    check_dirs(parser, args)  # every rank, before any collective
    if args.simulate_ranks:  # N ranks as threads of this process, one copy of the data
        data = load_data(args)
        digests = run_ranks(args.simulate_ranks, lambda dist: train_rank(args, dist, data))
        if len(set(digests)) != 1:  # the replicas must hold the same parameters
            raise SystemExit(f"simulated ranks ended with different parameters: {digests}")
        return 0
    if args.launcher == "torchrun":
        train_torchrun(args)
        return 0
    dist = make_transport(args.backend)  # the optimizer's transport too
    train_rank(args, dist)
    return 0


def train_torchrun(args) -> None:
    """``--launcher torchrun``: this rank's run in a torch.distributed world that it creates
    and destroys, in order (docs/checkpoints-and-faults.md, "Clean exits"): the world
    outlives every object that holds it (the DDP model, its reducer), every rank has left
    its last collective (a barrier) before any rank destroys it, and it is destroyed on
    the way out of an exception too, so that gloo's native threads (``pt_gloo_runloop``,
    ``gloo_tcp_loop``) end at ``destroy_process_group`` and not during interpreter
    shutdown."""
    import torch.distributed as tdist

    # Before the world exists: the functions of torch.distributed.nn.functional take
    # ``group=group.WORLD`` as a default argument, evaluated when the module is first
    # imported, and DDP imports it (through FSDP) when it is first built. Imported then,
    # ten default arguments keep the world's ProcessGroup alive after destroy_process_group,
    # with its threads and store connection, until the interpreter tears the module down.
    import torch.distributed.nn.functional  # noqa: F401

    from hvdcompress.transports.torch_dist import TorchDistTransport

    tdist.init_process_group(args.ddp_backend)
    try:
        train_rank(args, TorchDistTransport())
        tdist.barrier()  # no rank closes its connections while another is in a collective
    except BaseException as err:
        # The traceback keeps train_rank's frame, hence the DDP model and the group it
        # holds, alive: drop those locals (the traceback prints the same) so that the
        # group below is freed now, not at interpreter shutdown.
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        tdist.destroy_process_group()


def load_data(args):
    """(train, test) of --dataset: each an (images, labels) pair."""
    if args.dataset == "synthetic":
        return synthetic(args.synthetic_size, max(args.synthetic_size // 4, 256))
    try:
        return load_fashion_mnist(args.data_dir)
    except DatasetNotFound as err:
        raise SystemExit(str(err)) from None


def train_rank(args, dist, data=None) -> str:
    """One rank's run: a process of a real run, or a thread of --simulate-ranks (which
    passes the ``data`` every rank reads); the digest of its final parameters."""
    threads = args.threads or default_threads(dist.local_size)
    torch.set_num_threads(threads)
    train, test = data if data is not None else load_data(args)

    model = seeded(args.seed, lambda: MODELS[args.model](args.width))
    dist.broadcast_(model.parameters())
    compression, momentum = make_compression(args)
    policy = make_policy(args)
    forward = model
    if args.launcher == "torchrun":  # DDP with the hook; the optimizer steps locally
        if policy is not None:
            raise SystemExit("--launcher torchrun: --accordion / --cat need the optimizer")
        forward = torch.nn.parallel.DistributedDataParallel(model)
        hook_state = hvdcompress.DDPHookState(
            compression,
            compress_min_numel=args.compress_min_numel,
            exchange=args.exchange,
            link_cost=None if args.link_cost == "bytes" else "measure",
        ).register(forward)
        opt = hooked_optimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum), hook_state
        )
    else:
        opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum),
            model.named_parameters(),
            compression=compression,
            backend=dist,
            fusion_threshold=args.fusion_threshold,
            policy=policy,
            compress_min_numel=args.compress_min_numel,
            exchange=args.exchange,
            link_cost=None if args.link_cost == "bytes" else "measure",
            raise_on_nonfinite=True,  # a diverged run stops (stop_if_nonfinite), no summary
        )

    steps_per_epoch = len(train[0]) // (dist.size * args.batch_size)
    if steps_per_epoch == 0:
        raise SystemExit(
            f"{len(train[0])} examples cannot give {dist.size} ranks a batch of "
            f"{args.batch_size}: lower --batch-size"
        )
    total_steps = steps_per_epoch * args.epochs
    if args.steps is not None:
        total_steps = args.steps
    schedule = make_schedule(args, steps_per_epoch)

    start_step = 0
    ckpt_dir = Path(args.checkpoint) if args.checkpoint else None
    if args.resume:
        start_step = resume(ckpt_dir, model, opt, dist, schedule)

    def save(step: int) -> None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        state.update(format=CKPT_FORMAT, step=step, rank=dist.rank, size=dist.size)
        state["args"] = vars(args)
        state["lr_schedule"] = schedule.state_dict()
        save_rank_checkpoint(ckpt_dir, dist.rank, step, state, keep=args.keep_checkpoints)

    is_root = dist.rank == 0
    if is_root and args.sgd_note:
        print(args.sgd_note, file=sys.stderr, flush=True)
    writer = csv_file = csv_out = epochs_file = epochs_out = None
    policy_file = policy_out = None
    if is_root and args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        csv_file = open(Path(args.log_dir) / "metrics.csv", "a" if args.resume else "w", newline="")
        csv_out = csv.writer(csv_file)
        if not args.resume:
            csv_out.writerow(
                ["step", "epoch", "loss", "test_acc", "bytes_sent", "payload_bytes",
                 "raw_bytes", "bits_per_value", "compress_s", "step_s", "lr",
                 "sent_bytes", "received_bytes"]
            )  # fmt: skip
        epochs_file = open(
            Path(args.log_dir) / "epochs.csv", "a" if args.resume else "w", newline=""
        )
        epochs_out = csv.writer(epochs_file)  # one row per evaluation, over every rank
        if not args.resume:
            epochs_out.writerow(
                ["step", "epoch", "lr", "test_acc", "payload_bits_ranks", "values_ranks",
                 "bits_per_value_ranks"]
            )  # fmt: skip
        if policy is not None:  # long format: level / T per tensor, modelled vs measured
            policy_file = open(
                Path(args.log_dir) / "policy.csv", "a" if args.resume else "w", newline=""
            )
            policy_out = csv.writer(policy_file)
            if not args.resume:
                policy_out.writerow(["step", "key", "value"])
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(args.log_dir)
        except ImportError as err:
            print(f"train: no TensorBoard events ({err}); metrics.csv only", file=sys.stderr)

    bar = lines = None
    if is_root and not args.no_progress:
        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        else:  # a launcher's pipe: a carriage-return bar would arrive as one endless line
            lines = ProgressLines(total_steps, start_step, args.progress_every)

    # wire: the ring model's bytes; sent / received: what the transport counted
    totals = {"wire": 0.0, "raw": 0.0, "steps": 0, "sent": 0.0, "received": 0.0}
    # payload bits and gradient values: this rank's since the last evaluation, and the
    # sums over every rank since the start (mean bits per value over ranks and the run)
    since_eval = {"bits": 0.0, "values": 0.0}
    over_ranks = {"bits": 0.0, "values": 0.0}
    size = dist.size
    step = start_step
    loss_value = float("nan")
    first_loss = last_loss = None
    x_train, y_train = train
    while step < total_steps:
        epoch = step // steps_per_epoch
        perm = torch.randperm(
            len(x_train), generator=torch.Generator().manual_seed(args.seed + epoch)
        )
        in_epoch = step % steps_per_epoch
        lo = (in_epoch * size + dist.rank) * args.batch_size
        idx = perm[lo : lo + args.batch_size]
        lr = schedule.apply(opt, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(forward(x_train[idx]), y_train[idx])
        loss.backward()
        try:
            if args.launcher == "torchrun":  # DDP's averages, the same on every rank
                check_finite_grads(model, compression)
            opt.step()
        except hvdcompress.NonFiniteGradientError as err:
            raise SystemExit(
                f"train: stopped at step {step + 1} (epoch {epoch}), compression "
                f"{args.compression}, loss on rank {dist.rank} {float(loss.detach()):.6g}: "
                f'{err} (docs/codecs.md, "Defaults that train")'
            ) from None
        step_s = time.perf_counter() - t0
        step += 1
        stats = opt.last_stats
        loss_value = float(loss.detach())
        first_loss = loss_value if first_loss is None else first_loss
        last_loss = loss_value
        totals["wire"] += stats.wire_bytes
        totals["sent"] += stats.sent_bytes
        totals["received"] += stats.received_bytes
        totals["raw"] += 2.0 * (size - 1) / size * stats.raw_bytes
        totals["steps"] += 1
        since_eval["bits"] += 8.0 * stats.payload_bytes
        since_eval["values"] += stats.numel
        end_of_epoch = step % steps_per_epoch == 0 or step == total_steps
        if policy is not None and step % steps_per_epoch == 0:
            if hasattr(policy, "end_epoch"):  # every rank: an Accordion interval end
                policy.end_epoch()
        acc = evaluate(model, test, dist) if end_of_epoch else None
        if end_of_epoch:  # every rank: one small sum
            bits, values = dist.sum_floats([since_eval["bits"], since_eval["values"]])
            since_eval = {"bits": 0.0, "values": 0.0}
            over_ranks["bits"] += bits
            over_ranks["values"] += values
            if epochs_out:
                epochs_out.writerow(
                    [step, epoch, f"{lr:.6g}", f"{acc:.4f}", f"{bits:.0f}", f"{values:.0f}",
                     f"{bits / max(values, 1.0):.4f}"]
                )  # fmt: skip
                epochs_file.flush()
        if ckpt_dir and (
            step == total_steps or (args.checkpoint_every and step % args.checkpoint_every == 0)
        ):
            save(step)
        if is_root:
            row = [
                step, epoch, f"{loss_value:.6f}", "" if acc is None else f"{acc:.4f}",
                f"{stats.wire_bytes:.0f}", stats.payload_bytes, stats.raw_bytes,
                f"{stats.bits_per_value:.4f}", f"{stats.compress_s:.6f}", f"{step_s:.6f}",
                f"{lr:.6g}", stats.sent_bytes, stats.received_bytes,
            ]  # fmt: skip
            if csv_out:
                csv_out.writerow(row)
            if policy_out:
                for key, value in sorted(stats.metrics.items()):
                    if key.startswith(("level/", "T/", "cat/")):
                        policy_out.writerow([step, key, value])
            if writer:
                writer.add_scalar("train/loss", loss_value, step)
                writer.add_scalar("comm/bytes_sent", stats.wire_bytes, step)
                writer.add_scalar("comm/sent_bytes_measured", stats.sent_bytes, step)
                writer.add_scalar("comm/received_bytes_measured", stats.received_bytes, step)
                writer.add_scalar("comm/bits_per_value", stats.bits_per_value, step)
                writer.add_scalar("time/compress_s", stats.compress_s, step)
                writer.add_scalar("time/step_s", step_s, step)
                writer.add_scalar("train/lr", lr, step)
                if acc is not None:
                    writer.add_scalar("test/accuracy", acc, step)
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", bpv=f"{stats.bits_per_value:.2f}")
            if lines:
                lines.update(step, loss_value, stats.bits_per_value)
            if acc is not None and bar is None:
                print(f"step {step} epoch {epoch} loss {loss_value:.4f} test_acc {acc:.4f}")

    final_acc = evaluate(model, test, dist)
    digest = param_digest(model)
    # every rank: the transport's counts, averaged over ranks
    sent, received = (v / size for v in dist.sum_floats([totals["sent"], totals["received"]]))
    if is_root:
        if bar:
            bar.close()
        saved = 1.0 - totals["wire"] / totals["raw"] if totals["raw"] else 0.0
        print(
            f"summary: ranks {size} backend {dist.name} compression {args.compression} "
            f"steps {step} first_loss {first_loss} last_loss {last_loss} "
            f"test_accuracy {final_acc:.4f} bytes_sent_per_rank {totals['wire']:.0f} "
            f"uncompressed_allreduce_bytes {totals['raw']:.0f} traffic_saved {100 * saved:.1f}% "
            f"exchange {args.exchange} sent_bytes_per_rank {sent:.0f} "
            f"received_bytes_per_rank {received:.0f} "
            f"bits_per_value_ranks {over_ranks['bits'] / max(over_ranks['values'], 1.0):.4f} "
            f"lr_schedule {schedule.kind} threads {threads} param_digest {digest}",
            flush=True,
        )
        if writer:
            writer.add_scalar("test/final_accuracy", final_acc, step)
            writer.close()
        if csv_file:
            csv_file.close()
        if epochs_file:
            epochs_file.close()
        if policy_file:
            policy_file.close()
        if args.log_dir and isinstance(policy, hvdcompress.Accordion):
            write_accordion_trace(Path(args.log_dir) / "accordion.json", policy)
    return digest


def check_finite_grads(model: torch.nn.Module, compression) -> None:
    """``NonFiniteGradientError`` naming the parameters whose gradient holds a NaN or an
    Inf (``DistributedOptimizer(raise_on_nonfinite=True)``'s check, for the DDP path)."""
    grads = [(name, p.grad) for name, p in model.named_parameters()]
    hvdcompress.NonFiniteGradientError.check(grads, compression)


def write_accordion_trace(path: Path, policy: hvdcompress.Accordion) -> None:
    """Accordion's decisions in this process (step, reason, level per tensor, the norms
    averaged over ranks, in ``names`` order) with eta: the norm-change trace that
    scripts/plot_policy.py draws under the levels."""
    trace = {"eta": policy.eta, "low": policy.low, "high": policy.high,
             "names": policy.names, "decisions": policy.history}  # fmt: skip
    path.write_text(json.dumps(trace, indent=1))


if __name__ == "__main__":
    sys.exit(main())
