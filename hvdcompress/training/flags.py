"""What scripts/train.py's checked flags build: the SGD's defaults for the compressor
(``recommend_sgd``; ``method_sgd`` for a method of the table, as scripts/bench_peers.py
times it), the compressor (with the inner SGD's momentum), the Accordion / CAT policy and
the learning-rate schedule.

Apart from the parser so that the argument checks (which build each object once to
report a bad parameter before training) and every rank's run build them the same way;
errors are ``SystemExit`` with the message the command line reports.
"""

from __future__ import annotations

import argparse

import hvdcompress
from hvdcompress.training.methods import Method, build_policy, parse_cost, parse_params
from hvdcompress.training.schedule import LRSchedule, default_milestones

BASE_LR = 0.05  # plain SGD's learning rate and momentum on this job
BASE_MOMENTUM = 0.9
BATCH_SIZE = 64  # per rank (train.py's --batch-size)


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


def method_sgd(method: Method) -> tuple[float, float]:
    """(learning rate, momentum) of the torch SGD that train.py builds for ``method``'s
    flags (``Method.train_flags``) with its defaults: ``recommend_sgd``, then
    ``make_compression``'s inner momentum (none where the compressor applies its own)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--compression")
    p.add_argument("--compression-param", action="append", default=[])
    p.add_argument("--sparsity", type=float, default=1.0)
    args, _ = p.parse_known_args(method.train_flags())
    args.lr = args.momentum = None
    recommend_sgd(args)
    _, momentum = make_compression(args)
    return args.lr, momentum


def make_compression(args) -> tuple[hvdcompress.Compressor, float]:
    """(the compressor, the inner SGD's momentum): DGC applies ``--momentum`` itself
    (momentum correction), so the wrapped SGD then runs without momentum; block3lc with
    ``ef21`` applies its momentum in the compressor and needs the SGD's momentum at 1."""
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
    if args.compression == "block3lc" and compressor.ef21:
        momentum = 1.0  # EF21: the SGD's buffer adds up the averaged differences
    elif args.compression == "block3lc" and compressor.momentum > 0.0:
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
