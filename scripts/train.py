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
same payloads, moved by ``transports.torch_dist``), or with ``--torch-hook`` torch's own
DDP communication (allreduce, bf16, PowerSGD of ``--powersgd-rank`` after
``--powersgd-start-iter`` dense steps: default 2, at least 2; torch's documentation suggests
about 10% of training) as the baseline; the other launchers run one process per rank with
``--backend``. Progress: rank 0 shows a tqdm bar when its stderr is a terminal, and
otherwise (horovodrun, mpirun and srun pipe it) a plain line every ``--progress-every``
seconds.

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
summary line gives ``bits_per_value_ranks``, the mean over ranks and the run, and
``exchanges_used``, the exchanges that carried the gradients (the steps ``--exchange
auto`` spent timing its options left out; ``-`` where torch's hooks moved them).

Simulated ranks: ``--simulate-ranks N`` plays N ranks in this one process, as threads of
hvdcompress.training.simulate (one model replica, optimizer, compressor bound to its rank
and data shard per rank; the same code path as a real run): no launcher, and the same
final ``param_digest`` as ``mpirun -np N`` / ``horovodrun -np N`` with the same flags for
the gather-path compressors (docs/horovod-parity.md, "The simulated world").

This script parses, checks and launches; each rank's run (``training.loop``: replica,
checkpoints, logs, progress) and the data, models and policies come from
``hvdcompress.training``; ranks, the broadcast of the initial parameters and the sums of
the evaluation from the optimizer's transport (``hvdcompress.transports``).
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback

import hvdcompress
from hvdcompress.checkpoint import DEFAULT_KEEP, CheckpointError, check_writable_dir
from hvdcompress.exchange import EXCHANGES
from hvdcompress.training.data import DATA_DIR
from hvdcompress.training.flags import (
    BASE_LR,
    BASE_MOMENTUM,
    BATCH_SIZE,
    make_compression,
    make_policy,
    make_schedule,
    recommend_sgd,
)
from hvdcompress.training.loop import load_data, train_rank
from hvdcompress.training.methods import check_level
from hvdcompress.training.models import IMAGE_MODELS, MODELS
from hvdcompress.training.schedule import DEFAULT_GAMMA, DEFAULT_KIND, parse_milestones
from hvdcompress.training.schedule import KINDS as SCHEDULES
from hvdcompress.training.simulate import run_ranks
from hvdcompress.training.torch_hooks import POWERSGD_START_ITER, TORCH_HOOKS
from hvdcompress.transports import make_transport

# tests and scripts reach these through this file (scripts/train.py is their entry point)
__all__ = ["MODELS", "build_parser", "load_data", "main", "make_compression", "make_policy",
           "make_schedule", "make_transport", "parse_args", "recommend_sgd", "run_ranks",
           "train_rank"]  # fmt: skip


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


def parse_args(argv=None):
    """The command line, every argument checked (exit status 2 naming the valid values);
    ``check_args`` checks the combinations, ``check_dirs`` the directories."""
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="train.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    _add_data_args(p)
    _add_compression_args(p)
    _add_launch_args(p)
    _add_schedule_args(p)
    _add_run_args(p)
    return p


def _add_data_args(p: argparse.ArgumentParser) -> None:
    """The data and the model."""
    p.add_argument("--dataset", choices=["fashion-mnist", "synthetic"], default="fashion-mnist")
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--synthetic-size", type=POSITIVE, default=4096, help="training examples")
    p.add_argument("--model", choices=sorted(IMAGE_MODELS), default="cnn")
    p.add_argument("--width", type=POSITIVE, default=16, help="channels of the first layer")


def _add_compression_args(p: argparse.ArgumentParser) -> None:
    """The compressor and the policies that set its level."""
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
    p.add_argument(
        "--compression-warmup",
        nargs=2,
        type=float,
        default=None,
        metavar=("LEVEL", "STEPS"),
        help="warm-up policy: the --compression level LEVEL (block3lc levels 3) for the\n"
        "first STEPS steps, then the compressor's own (hvdcompress.policies.warmup)",
    )
    p.add_argument("--cat-every", type=POSITIVE, default=200, help="recompute T* every S steps")
    p.add_argument(
        "--cat-cost",
        default=None,
        metavar="C0,C1[,PACKET_BITS]",
        help="cost model in seconds and seconds per bit (or per packet); default: calibrate",
    )


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    """The backend, the launcher, the hook and the exchange."""
    p.add_argument("--backend", choices=["horovod", "mpi4py"], default="horovod")
    p.add_argument(
        "--launcher",
        choices=["horovodrun", "mpirun", "srun", "torchrun"],
        default=None,
        help="torchrun: torch.distributed + DDP with hvdcompress.ddp_hook (--backend unused)",
    )
    p.add_argument("--ddp-backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument(
        "--torch-hook",
        choices=TORCH_HOOKS,
        default=None,
        help="--launcher torchrun: torch's own DDP communication instead of hvdcompress's\n"
        "hook (allreduce: DDP's; bf16: bf16_compress_hook; powersgd: powerSGD_hook, one\n"
        "bucket); with the default --compression only. The summary's bytes and bits per\n"
        "value are those the hook hands its allreduces (32, 16 bits per value; PowerSGD\n"
        "R*(m+n) per matrix, vectors dense); it leaves out sent_bytes_per_rank and\n"
        "received_bytes_per_rank (no hvdcompress transport counts them)",
    )
    p.add_argument(
        "--powersgd-rank",
        type=POSITIVE,
        default=1,
        metavar="R",
        help="--torch-hook powersgd: matrix_approximation_rank (default 1)",
    )
    p.add_argument(
        "--powersgd-start-iter",
        type=int_at_least(2),
        default=POWERSGD_START_ITER,
        metavar="N",
        help=f"--torch-hook powersgd: dense allreduce steps before compressing (default "
        f"{POWERSGD_START_ITER}, at least 2; torch suggests about 10%% of training)",
    )
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
        choices=list(EXCHANGES),
        default="auto",
        help="gather-only codecs: one allgather, the two-stage exchange (reduce-scatter + "
        "allgather of re-compressed shards), hierarchical (float32 inside a node, compressed "
        "across nodes), or per bucket by bytes (docs/exchanges.md)",
    )
    p.add_argument(
        "--no-tuning",
        action="store_true",
        help="--exchange auto: keep the first guess instead of timing every option open to "
        "a bucket while training and keeping the fastest (docs/exchanges.md, 'Measured "
        "while training'); for runs that must repeat and resume bit for bit",
    )
    p.add_argument(
        "--link-cost",
        choices=["bytes", "measure"],
        default="bytes",
        help="--exchange auto: choose by modelled bytes, or by seconds from timing the "
        "link and the codec at start (link_cost='measure')",
    )


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    """How long, and the optimizer's schedule."""
    p.add_argument("--epochs", type=POSITIVE, default=1)
    p.add_argument("--steps", type=POSITIVE, default=None, help="stop after this many steps in all")
    p.add_argument(
        "--until-epoch",
        type=POSITIVE,
        default=None,
        help="stop at the end of this epoch of --epochs (checkpointed: --resume goes on); "
        "the learning-rate schedule still spans --epochs",
    )
    p.add_argument("--batch-size", type=POSITIVE, default=BATCH_SIZE, help="per rank")
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


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Threads, logs, checkpoints, progress and the simulated world."""
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


def milestones_arg(text: str) -> list[float]:
    """An argparse type: comma-separated milestone epochs."""
    try:
        return parse_milestones(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The combinations of arguments: compressor parameters, policy levels and cost model,
    --resume; ``parser.error`` (exit status 2) on the first bad one."""
    recommend_sgd(args)
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    if args.until_epoch is not None and (args.until_epoch > args.epochs or args.steps):
        parser.error("--until-epoch must be at most --epochs, and is not used with --steps")
    if args.accordion and args.cat:
        parser.error("--accordion and --cat are exclusive")
    if args.compression_warmup:
        steps = args.compression_warmup[1]
        if steps != int(steps) or steps < 0:
            parser.error(f"--compression-warmup STEPS: expected an int >= 0, got {steps:g}")
    if args.milestones and args.lr_schedule != "step":
        parser.error(f"--milestones apply to --lr-schedule step, not {args.lr_schedule}")
    if args.simulate_ranks and args.launcher is not None:
        parser.error("--simulate-ranks runs every rank in this process: no --launcher")
    if args.torch_hook and args.launcher != "torchrun":
        parser.error("--torch-hook needs --launcher torchrun (DDP's communication hook)")
    if args.torch_hook and (
        args.compression != parser.get_default("compression") or args.compression_param
    ):
        parser.error(f"--torch-hook {args.torch_hook} replaces --compression: not both")
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


if __name__ == "__main__":
    sys.exit(main())
