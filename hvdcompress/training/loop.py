"""One rank's training run of scripts/train.py: the steps over its data shard, an
evaluation at each epoch's end, checkpoints, rank 0's records and its ``summary:`` line.

The same function runs a process of a real run (horovodrun, mpirun, srun, torchrun) and a
thread of ``--simulate-ranks``, so that the simulated world takes the real code path. Every
rank starts from rank 0's parameters and reads a disjoint shard of each epoch's seeded
permutation with the same number of steps (the remainder is dropped, so that no rank waits
alone in a collective); every rank enters the same collectives in the same order.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hvdcompress
from hvdcompress.training.checkpoints import resume, save_checkpoint
from hvdcompress.training.data import DatasetNotFound, load_fashion_mnist, synthetic
from hvdcompress.training.flags import make_schedule
from hvdcompress.training.progress import Progress
from hvdcompress.training.replica import build_replica
from hvdcompress.training.run_log import RunLog
from hvdcompress.training.traffic import RunTraffic


def default_threads(local_size: int) -> int:
    """torch threads per rank: this process's cores shared by the ranks of the node."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(local_size, 1))


def param_digest(model) -> str:
    """16 hex digits of the parameters' sha256: runs that should agree compare these."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def load_data(args):
    """(train, test) of --dataset: each an (images, labels) pair."""
    if args.dataset == "synthetic":
        return synthetic(args.synthetic_size, max(args.synthetic_size // 4, 256))
    try:
        return load_fashion_mnist(args.data_dir)
    except DatasetNotFound as err:
        raise SystemExit(str(err)) from None


def evaluate(model, test, dist, batch: int = 1000) -> float:
    """Test accuracy over every rank: each scores every size-th example, one small sum."""
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


def plan_steps(args, dist, n_train: int) -> tuple[int, int]:
    """(steps per epoch, the step the run ends at): every rank the same number of full
    batches per epoch; ``--until-epoch`` ends a piece of a run of ``--epochs``."""
    steps_per_epoch = n_train // (dist.size * args.batch_size)
    if steps_per_epoch == 0:
        raise SystemExit(
            f"{n_train} examples cannot give {dist.size} ranks a batch of "
            f"{args.batch_size}: lower --batch-size"
        )
    total_steps = args.steps if args.steps is not None else steps_per_epoch * args.epochs
    if args.until_epoch is not None:  # a piece of the run: the schedule still spans --epochs
        total_steps = steps_per_epoch * args.until_epoch
    return steps_per_epoch, total_steps


def open_root_outputs(args, replica, total_steps: int, start_step: int):
    """Rank 0's (RunLog, Progress), after the note on --sgd's defaults if there is one."""
    if args.sgd_note:
        print(args.sgd_note, file=sys.stderr, flush=True)
    log = RunLog(args.log_dir, resume=args.resume, policy=replica.policy, measured=replica.measured)
    progress = Progress(total_steps, start_step, args.progress_every, not args.no_progress)
    return log, progress


def batch_indices(args, dist, n_train: int, step: int, steps_per_epoch: int):
    """This rank's examples at ``step``: its slot of the epoch's seeded permutation."""
    epoch = step // steps_per_epoch
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed + epoch))
    in_epoch = step % steps_per_epoch
    lo = (in_epoch * dist.size + dist.rank) * args.batch_size
    return perm[lo : lo + args.batch_size]


def optimizer_step(replica, dist, train, idx, step: int, epoch: int) -> tuple[float, float]:
    """One step on the examples ``idx`` of ``train``: (its loss, its seconds). A non-finite
    gradient ends the run with the step, the method and the loss."""
    x_train, y_train = train
    opt = replica.optimizer
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = F.cross_entropy(replica.forward(x_train[idx]), y_train[idx])
    loss.backward()
    try:
        replica.check_finite()  # DDP's averages, the same on every rank
        opt.step()
    except hvdcompress.NonFiniteGradientError as err:
        raise SystemExit(
            f"train: stopped at step {step + 1} (epoch {epoch}), compression "
            f"{replica.method}, loss on rank {dist.rank} {float(loss.detach()):.6g}: "
            f'{err} (docs/codecs.md, "Defaults that train")'
        ) from None
    step_s = time.perf_counter() - t0
    return float(loss.detach()), step_s


def checkpoint_due(args, step: int, total_steps: int) -> bool:
    """Whether ``step`` saves a checkpoint: the last one, and every --checkpoint-every."""
    return step == total_steps or bool(args.checkpoint_every and step % args.checkpoint_every == 0)


def print_decisions(tuner, decided: int) -> int:
    """The tuner's decisions after the first ``decided``, on stderr; how many there are now."""
    for decision in tuner.decisions[decided:]:
        print(f"train: exchange {decision}", file=sys.stderr, flush=True)
    return len(tuner.decisions)


def report_step(log, progress, step, epoch, loss, acc, stats, step_s, lr) -> None:
    """Rank 0's record of a step: its row of the log, the progress, and (without a bar)
    a line at each evaluation."""
    log.step(step, epoch, loss, acc, stats, step_s, lr)
    progress.update(step, loss, stats.bits_per_value)
    if acc is not None and not progress.has_bar:
        print(f"step {step} epoch {epoch} loss {loss:.4f} test_acc {acc:.4f}")


def train_rank(args, dist, data=None) -> str:
    """One rank's run: a process of a real run, or a thread of --simulate-ranks (which
    passes the ``data`` every rank reads); the digest of its final parameters."""
    threads = args.threads or default_threads(dist.local_size)
    torch.set_num_threads(threads)
    train, test = data if data is not None else load_data(args)
    replica = build_replica(args, dist)
    model, opt, policy = replica.model, replica.optimizer, replica.policy
    steps_per_epoch, total_steps = plan_steps(args, dist, len(train[0]))
    schedule = make_schedule(args, steps_per_epoch)

    start_step = 0
    ckpt_dir = Path(args.checkpoint) if args.checkpoint else None
    if args.resume:
        start_step = resume(ckpt_dir, model, opt, dist, schedule)
        if replica.torch_hook is not None:
            replica.torch_hook.resume_at(start_step)

    is_root = dist.rank == 0
    log = progress = None
    if is_root:
        log, progress = open_root_outputs(args, replica, total_steps, start_step)

    traffic = RunTraffic(dist.size)
    decided = 0  # the tuner's decisions printed so far
    step = start_step
    first_loss = last_loss = None
    while step < total_steps:
        epoch = step // steps_per_epoch
        idx = batch_indices(args, dist, len(train[0]), step, steps_per_epoch)
        lr = schedule.apply(opt, step)
        last_loss, step_s = optimizer_step(replica, dist, train, idx, step, epoch)
        step += 1
        stats = replica.step_stats()
        first_loss = last_loss if first_loss is None else first_loss
        traffic.add(stats)
        if policy is not None and step % steps_per_epoch == 0:
            if hasattr(policy, "end_epoch"):  # every rank: an Accordion interval end
                policy.end_epoch()
        acc = None
        if step % steps_per_epoch == 0 or step == total_steps:  # every rank: evaluation, a sum
            acc = evaluate(model, test, dist)
            bits, values = traffic.end_evaluation(dist)
            if log:
                log.evaluation(step, epoch, lr, acc, bits, values)
        if ckpt_dir and checkpoint_due(args, step, total_steps):
            save_checkpoint(ckpt_dir, step, model, opt, dist, args, schedule)
        if is_root and replica.tuner is not None:
            decided = print_decisions(replica.tuner, decided)
        if is_root:
            report_step(log, progress, step, epoch, last_loss, acc, stats, step_s, lr)

    final_acc = evaluate(model, test, dist)
    digest = param_digest(model)
    transport_bytes = traffic.transport_means(dist)  # every rank: one small sum
    if is_root:
        progress.close()
        print(
            summary_line(args, dist, replica, step, (first_loss, last_loss), final_acc, traffic,
                         transport_bytes, schedule.kind, threads, digest),
            flush=True,
        )  # fmt: skip
        log.close(final_acc, step)
    return digest


def summary_line(args, dist, replica, steps, losses, final_acc, traffic: RunTraffic,
                 transport_bytes, lr_schedule, threads, digest) -> str:  # fmt: skip
    """Rank 0's last line, ``key value`` pairs that scripts read back. The transport's
    counts (sent / received) only where hvdcompress's transport moved the bytes."""
    first_loss, last_loss = losses
    sent, received = transport_bytes
    measured = (
        f"sent_bytes_per_rank {sent:.0f} received_bytes_per_rank {received:.0f} "
        if replica.measured
        else ""
    )
    return (
        f"summary: ranks {dist.size} backend {dist.name} compression {replica.method} "
        f"steps {steps} first_loss {first_loss} last_loss {last_loss} "
        f"test_accuracy {final_acc:.4f} bytes_sent_per_rank {traffic.wire:.0f} "
        f"uncompressed_allreduce_bytes {traffic.raw:.0f} "
        f"traffic_saved {100 * traffic.traffic_saved:.1f}% "
        f"exchange {args.exchange} exchanges_used {','.join(sorted(traffic.exchanges)) or '-'} "
        f"{measured}"
        f"bits_per_value_ranks {traffic.bits_per_value_ranks:.4f} "
        f"lr_schedule {lr_schedule} threads {threads} param_digest {digest}"
    )
