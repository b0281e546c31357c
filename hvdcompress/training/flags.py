"""What scripts/train.py's checked flags build: the compressor (with the inner SGD's
momentum), the Accordion / CAT policy and the learning-rate schedule.

Apart from the parser so that the argument checks (which build each object once to
report a bad parameter before training) and every rank's run build them the same way;
errors are ``SystemExit`` with the message the command line reports.
"""

from __future__ import annotations

import hvdcompress
from hvdcompress.training.methods import build_policy, parse_cost, parse_params
from hvdcompress.training.schedule import LRSchedule, default_milestones


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
        compressor = hvdcompress.get_compressor(args.compression, **params)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"--compression {args.compression}: {err}") from None
    if args.compression == "block3lc" and compressor.momentum > 0.0:
        momentum = 0.0  # momentum correction: the compressor applies its own momentum
    return compressor, momentum


def make_policy(args):
    """hvdcompress.Accordion / hvdcompress.CAT / the compression warm-up
    (hvdcompress.policies.warmup) from the flags, or None."""
    warmup = getattr(args, "compression_warmup", None)
    if sum(bool(x) for x in (args.accordion, args.cat, warmup)) > 1:
        raise SystemExit("--accordion, --cat and --compression-warmup are exclusive")
    if warmup:
        warm, steps = warmup
        try:
            return build_policy("warmup", args.compression, warm=warm, steps=int(steps))
        except ValueError as err:
            raise SystemExit(f"--compression-warmup: {err}") from None
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
