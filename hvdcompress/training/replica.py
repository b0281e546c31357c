"""One rank's replica in scripts/train.py: the model (rank 0's initial parameters on
every rank), the module its batches go through and the optimizer that averages and steps.

Three ways, chosen by the flags: ``hvdcompress.DistributedOptimizer`` over the rank's
transport (horovodrun, mpirun, srun, the simulated world); with ``--launcher torchrun``,
DistributedDataParallel with ``hvdcompress.DDPHookState`` and a local optimizer
(``hooked_optimizer``); or, with ``--torch-hook``, DDP with torch's own communication
(``torch_hooks``), the baseline. The training loop sees one interface: ``forward``,
``optimizer``, ``check_finite()`` and ``step_stats()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import hvdcompress
from hvdcompress.exchange.tuning import ExchangeTuner
from hvdcompress.optimizer.hooked import hooked_optimizer
from hvdcompress.stats import StepStats
from hvdcompress.training.flags import make_compression, make_policy
from hvdcompress.training.models import MODELS
from hvdcompress.training.simulate import seeded
from hvdcompress.training.torch_hooks import TorchHook, ddp_options, label


@dataclass
class Replica:
    """``model``: the parameters; ``forward``: the model, or its DDP wrapper;
    ``method``: what averages the gradients, as the summary line names it (--compression,
    or torch's hook); ``compression``: the compressor (None with torch's hook);
    ``policy``: Accordion / CAT or None; ``torch_hook``: torch's hook or None;
    ``tuner``: the ``ExchangeTuner`` of ``--exchange auto`` (None: ``--no-tuning``, another
    exchange, or the simulated world)."""

    model: torch.nn.Module
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    method: str
    compression: hvdcompress.Compressor | None
    policy: object | None = None
    torch_hook: TorchHook | None = None
    tuner: ExchangeTuner | None = None

    @property
    def ddp(self) -> bool:
        return self.forward is not self.model

    @property
    def measured(self) -> bool:
        """Whether hvdcompress's transport counts the bytes and times the compression."""
        return self.torch_hook is None

    def check_finite(self) -> None:
        """On DDP, ``NonFiniteGradientError`` naming the parameters whose averaged gradient
        holds a NaN or an Inf (``DistributedOptimizer(raise_on_nonfinite=True)``'s check,
        which the optimizer makes itself otherwise)."""
        if self.ddp:
            grads = [(name, p.grad) for name, p in self.model.named_parameters()]
            hvdcompress.NonFiniteGradientError.check(grads, self.compression or self.method)

    def step_stats(self) -> StepStats:
        """The last step's bytes, bits per value and times."""
        if self.torch_hook is not None:
            return self.torch_hook.step_stats()
        return self.optimizer.last_stats


def build_replica(args, dist) -> Replica:
    """The replica of this rank for the checked flags ``args``, its parameters broadcast
    from rank 0."""
    model = seeded(args.seed, lambda: MODELS[args.model](args.width))
    dist.broadcast_(model.parameters())
    compression, momentum = make_compression(args)
    policy = make_policy(args)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=momentum)
    if args.launcher != "torchrun":
        opt = hvdcompress.DistributedOptimizer(
            sgd,
            model.named_parameters(),
            compression=compression,
            backend=dist,
            fusion_threshold=args.fusion_threshold,
            policy=policy,
            compress_min_numel=args.compress_min_numel,
            exchange=args.exchange,
            link_cost=None if args.link_cost == "bytes" else "measure",
            raise_on_nonfinite=True,  # a diverged run stops (stop_if_nonfinite), no summary
            tuning=None if args.no_tuning else hvdcompress.Tuning(),
        )
        return Replica(
            model, model, opt, args.compression, compression, policy, tuner=opt.exchange_tuner
        )
    # DDP averages; the optimizer steps locally
    if policy is not None:
        raise SystemExit("--launcher torchrun: --accordion / --cat need the optimizer")
    if args.torch_hook:
        ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_options(args.torch_hook))
        hook = TorchHook(ddp, args.torch_hook, args.powersgd_rank, args.powersgd_start_iter)
        method = label(args.torch_hook, args.powersgd_rank)
        return Replica(model, ddp, sgd, method, None, torch_hook=hook)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook_state = hvdcompress.DDPHookState(
        compression,
        compress_min_numel=args.compress_min_numel,
        exchange=args.exchange,
        link_cost=None if args.link_cost == "bytes" else "measure",
        tuning=None if args.no_tuning else hvdcompress.Tuning(),
    ).register(ddp)
    opt = hooked_optimizer(sgd, hook_state)
    return Replica(model, ddp, opt, args.compression, compression, tuner=hook_state.exchange_tuner)
