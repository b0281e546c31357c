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

Data: the idx files of Debian's ``dataset-fashion-mnist`` in
/usr/share/datasets/fashion-mnist (``--dataset synthetic`` needs none). Every rank starts
from rank 0's parameters and sees a disjoint shard of each epoch's seeded permutation,
with the same number of steps (the remainder is dropped, so no rank waits alone in a
collective). Rank 0 shows a progress bar and writes ``metrics.csv`` and TensorBoard
events to ``--log-dir``: loss, test accuracy, bytes sent per step (per rank, ring model
of docs/design.md section 7), bits per value, compression time and step time. ``--checkpoint DIR``
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

Data, models and policies come from ``hvdcompress.training``; ranks, the broadcast of the
initial parameters and the sums of the evaluation from the optimizer's transport
(``hvdcompress.transports``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import os
import sys
import time
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
from hvdcompress.training.data import DATA_DIR, DatasetNotFound, load_fashion_mnist, synthetic
from hvdcompress.training.methods import build_policy, check_level, parse_cost, parse_params
from hvdcompress.training.models import IMAGE_MODELS, MODELS
from hvdcompress.transports import make_transport


# ---- helpers -------------------------------------------------------------------------------
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
        "--fusion-threshold", type=NON_NEGATIVE, default=None, help="bytes per collective"
    )
    p.add_argument(
        "--compress-min-numel",
        type=NON_NEGATIVE,
        default=0,
        help="send tensors with fewer elements uncompressed (fast links)",
    )
    p.add_argument("--epochs", type=POSITIVE, default=1)
    p.add_argument("--steps", type=POSITIVE, default=None, help="stop after this many steps in all")
    p.add_argument("--batch-size", type=POSITIVE, default=64, help="per rank")
    p.add_argument("--lr", type=finite_float(0.0, low_open=True), default=0.05)
    p.add_argument("--momentum", type=finite_float(0.0, high=1.0, high_open=True), default=0.9)
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
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """The combinations of arguments: compressor parameters, policy levels and cost model,
    --resume; ``parser.error`` (exit status 2) on the first bad one."""
    if args.resume and not args.checkpoint:
        parser.error("--resume needs --checkpoint DIR")
    if args.accordion and args.cat:
        parser.error("--accordion and --cat are exclusive")
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


def apply_checkpoint(path: Path, model, opt, dist) -> int:
    """Load ``path`` (this rank's file) into the model and optimizer; its step.
    ``CheckpointError`` for a file that does not verify or does not fit this run."""
    saved = load_checkpoint(path)
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


def resume(directory: Path, model, opt, dist) -> int:
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
            loaded = apply_checkpoint(path, model, opt, dist)
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
    dist = make_transport(args.backend)  # the optimizer's transport too
    threads = args.threads or default_threads(dist.local_size)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)

    if args.dataset == "synthetic":
        train, test = synthetic(args.synthetic_size, max(args.synthetic_size // 4, 256))
    else:
        try:
            train, test = load_fashion_mnist(args.data_dir)
        except DatasetNotFound as err:
            raise SystemExit(str(err)) from None

    model = MODELS[args.model](args.width)
    dist.broadcast_(model.parameters())
    compression, momentum = make_compression(args)
    policy = make_policy(args)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum),
        model.named_parameters(),
        compression=compression,
        backend=dist,
        fusion_threshold=args.fusion_threshold,
        policy=policy,
        compress_min_numel=args.compress_min_numel,
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

    start_step = 0
    ckpt_dir = Path(args.checkpoint) if args.checkpoint else None
    if args.resume:
        start_step = resume(ckpt_dir, model, opt, dist)

    def save(step: int) -> None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        state.update(format=CKPT_FORMAT, step=step, rank=dist.rank, size=dist.size)
        state["args"] = vars(args)
        save_rank_checkpoint(ckpt_dir, dist.rank, step, state, keep=args.keep_checkpoints)

    is_root = dist.rank == 0
    writer = csv_file = csv_out = None
    policy_file = policy_out = None
    if is_root and args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        csv_file = open(Path(args.log_dir) / "metrics.csv", "a" if args.resume else "w", newline="")
        csv_out = csv.writer(csv_file)
        if not args.resume:
            csv_out.writerow(
                ["step", "epoch", "loss", "test_acc", "bytes_sent", "payload_bytes",
                 "raw_bytes", "bits_per_value", "compress_s", "step_s"]
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

    bar = None
    if is_root and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)

    totals = {"wire": 0.0, "raw": 0.0, "steps": 0}
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
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        step_s = time.perf_counter() - t0
        step += 1
        stats = opt.last_stats
        loss_value = float(loss.detach())
        first_loss = loss_value if first_loss is None else first_loss
        last_loss = loss_value
        totals["wire"] += stats.wire_bytes
        totals["raw"] += 2.0 * (size - 1) / size * stats.raw_bytes
        totals["steps"] += 1
        end_of_epoch = step % steps_per_epoch == 0 or step == total_steps
        if policy is not None and step % steps_per_epoch == 0:
            if hasattr(policy, "end_epoch"):  # every rank: an Accordion interval end
                policy.end_epoch()
        acc = evaluate(model, test, dist) if end_of_epoch else None
        if ckpt_dir and (
            step == total_steps or (args.checkpoint_every and step % args.checkpoint_every == 0)
        ):
            save(step)
        if is_root:
            row = [
                step, epoch, f"{loss_value:.6f}", "" if acc is None else f"{acc:.4f}",
                f"{stats.wire_bytes:.0f}", stats.payload_bytes, stats.raw_bytes,
                f"{stats.bits_per_value:.4f}", f"{stats.compress_s:.6f}", f"{step_s:.6f}",
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
                writer.add_scalar("comm/bits_per_value", stats.bits_per_value, step)
                writer.add_scalar("time/compress_s", stats.compress_s, step)
                writer.add_scalar("time/step_s", step_s, step)
                if acc is not None:
                    writer.add_scalar("test/accuracy", acc, step)
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", bpv=f"{stats.bits_per_value:.2f}")
            if acc is not None and bar is None:
                print(f"step {step} epoch {epoch} loss {loss_value:.4f} test_acc {acc:.4f}")

    final_acc = evaluate(model, test, dist)
    digest = param_digest(model)
    if is_root:
        if bar:
            bar.close()
        saved = 1.0 - totals["wire"] / totals["raw"] if totals["raw"] else 0.0
        print(
            f"summary: ranks {size} backend {args.backend} compression {args.compression} "
            f"steps {step} first_loss {first_loss} last_loss {last_loss} "
            f"test_accuracy {final_acc:.4f} bytes_sent_per_rank {totals['wire']:.0f} "
            f"uncompressed_allreduce_bytes {totals['raw']:.0f} traffic_saved {100 * saved:.1f}% "
            f"threads {threads} param_digest {digest}",
            flush=True,
        )
        if writer:
            writer.add_scalar("test/final_accuracy", final_acc, step)
            writer.close()
        if csv_file:
            csv_file.close()
        if policy_file:
            policy_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
