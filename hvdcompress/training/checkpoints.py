"""scripts/train.py's checkpoints: what one rank saves at a step (model, optimizer with
the compressor's per-rank state, learning-rate schedule, the flags), and ``--resume``:
the newest step that verifies and loads on every rank.

The file format itself (sha256-verified, no unpickling of code, atomic writes, the newest
``keep`` per rank) is ``hvdcompress.checkpoint``'s; this module decides what a training
run puts in it and what a run accepts back, so that a resumed run continues with the same
parameters as an uninterrupted one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hvdcompress.checkpoint import (
    CheckpointError,
    check_tensor,
    checkpoint_path,
    list_checkpoints,
    load_checkpoint,
    save_rank_checkpoint,
    verified_steps,
)
from hvdcompress.training.schedule import LRSchedule

CKPT_FORMAT = "hvdcompress.train/1"


def save_checkpoint(directory: Path, step: int, model, opt, dist, args, schedule: LRSchedule):
    """This rank's file of ``step``; the newest ``args.keep_checkpoints`` stay."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    state.update(format=CKPT_FORMAT, step=step, rank=dist.rank, size=dist.size)
    state["args"] = vars(args)
    state["lr_schedule"] = schedule.state_dict()
    save_rank_checkpoint(directory, dist.rank, step, state, keep=args.keep_checkpoints)


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
