"""``DistributedOptimizer(...)``: checks the arguments and builds the wrapper (package doc)."""

from __future__ import annotations

import warnings

import torch

from hvdcompress import checks
from hvdcompress.buckets import resolve_fusion_threshold
from hvdcompress.compression import resolve_compressor
from hvdcompress.exchange import check_exchange
from hvdcompress.exchange.tuning import DEFAULT_TUNING, Tuning, check_tuning
from hvdcompress.optimizer.adasum import _adasum_optimizer
from hvdcompress.optimizer.options import (
    Adasum,
    Average,
    HorovodOptions,
    _normalize_op,
)
from hvdcompress.optimizer.process_sets import _transport_for
from hvdcompress.optimizer.wrapper import _DistributedOptimizer
from hvdcompress.policies import Policy
from hvdcompress.transports import Transport


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression="none",
    backward_passes_per_step: int = 1,
    op=Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=None,
    *,
    backend: str | Transport = "horovod",
    fusion_threshold: int | None = None,
    policy=None,
    compress_min_numel: int = 0,
    exchange: str = "auto",
    link_cost=None,
    raise_on_nonfinite: bool = False,
    tuning: Tuning | None = DEFAULT_TUNING,
):
    """Wrap ``optimizer`` so gradients are compressed, exchanged and averaged across ranks.

    ``compression``: a compressor name, ``hvdcompress.get_compressor(...)``, or
    ``hvdcompress.Compression.<name>``. ``backend``: ``"horovod"`` (needs ``hvd.init()``),
    ``"mpi4py"`` (no Horovod needed) or a Transport. ``fusion_threshold``: bytes of
    uncompressed gradient per collective (default ``HOROVOD_FUSION_THRESHOLD`` or 64 MiB;
    0 sends every tensor on its own). ``policy``: ``hvdcompress.Accordion(...)`` or
    ``hvdcompress.CAT(...)``, which sets the compressor's level per tensor during training.
    ``compress_min_numel``: tensors with fewer elements are sent uncompressed (one float32
    allreduce per bucket of them; docs/benchmarks-step-time.md, "Step time on a
    rate-limited link"). ``exchange`` ("auto", "allgather", "twostage", "hierarchical"),
    ``link_cost`` and ``tuning``: how each bucket travels (docs/exchanges.md): "auto"
    guesses per bucket by modelled bytes (``link_cost``: seconds), then times every option
    open to it, dense included, while training and keeps the fastest ("Measured while
    training"; ``tuning=None``: the guess stays). ``raise_on_nonfinite``: ``synchronize()``
    raises ``NonFiniteGradientError`` naming the tensors whose averaged gradient holds a
    NaN or an Inf, on every rank, before the inner optimizer steps (default: written as
    it is, so that torch.amp's GradScaler skips the step).

    Horovod's keywords mean what they mean in ``hvd.DistributedOptimizer`` 0.28.1 (package
    doc): ``gradient_predivide_factor`` (op Average only), ``groups`` (an int or lists of
    tensors: each group one bucket, instead of ``fusion_threshold``), ``num_groups``
    (deprecated alias of ``groups``), ``sparse_as_dense``, ``process_set`` (an
    ``hvd.ProcessSet``; on mpi4py also a list of ``COMM_WORLD`` ranks) and ``op=hvd.Adasum``
    (Horovod's own Adasum optimizer, for compression none or fp16 on the horovod backend).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
    compressor = resolve_compressor(compression)
    user_op, op = op, _normalize_op(op)
    _check_predivide(gradient_predivide_factor, op)
    raise_on_nonfinite = checks.boolean("raise_on_nonfinite", raise_on_nonfinite)
    sparse_as_dense = checks.boolean("sparse_as_dense", sparse_as_dense)
    check_exchange(exchange, link_cost)
    check_tuning(tuning, exchange)
    groups = _groups_of(num_groups, groups)
    if op == Adasum:
        return _adasum_optimizer(
            optimizer, named_parameters, compressor, backward_passes_per_step, user_op,
            gradient_predivide_factor, groups, sparse_as_dense, process_set, backend=backend,
            policy=policy,
        )  # fmt: skip
    _check_policy_and_backend(policy, backend)
    fusion_threshold = checks.integer(
        "fusion_threshold", resolve_fusion_threshold(fusion_threshold), 0,
        unit=" (bytes; 0: one tensor per bucket)",
    )  # fmt: skip
    passes = checks.integer("backward_passes_per_step", backward_passes_per_step, 1)
    compress_min_numel = checks.integer("compress_min_numel", compress_min_numel, 0)
    horovod = HorovodOptions(gradient_predivide_factor, groups, sparse_as_dense, process_set)
    transport = _transport_for(backend, process_set)
    mixed = dict(_DistributedOptimizer.__dict__)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), mixed)
    return cls(
        optimizer.param_groups, named_parameters, compressor, transport, passes, user_op,
        fusion_threshold, policy, compress_min_numel, horovod_options=horovod,
        exchange=exchange, link_cost=link_cost, raise_on_nonfinite=raise_on_nonfinite,
        tuning=tuning,
    )  # fmt: skip


def _check_predivide(factor, op) -> None:
    """Horovod's checks of ``gradient_predivide_factor`` (its texts), and a finite
    positive number."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")
    if factor != 1.0:
        if op != Average:  # Horovod's check and text
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not factor > 0 or factor == float("inf"):
            raise ValueError(
                f"gradient_predivide_factor must be a finite number > 0, got {factor!r}"
            )


def _groups_of(num_groups, groups):
    """``groups``, or the deprecated ``num_groups`` in its place, with Horovod's warning."""
    if checks.integer("num_groups", num_groups, 0) != 0:
        warnings.warn(  # Horovod's warning
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=3,
        )
        if groups is None:
            groups = num_groups
    return groups


def _check_policy_and_backend(policy, backend) -> None:
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            "policy must be None or an hvdcompress.Policy (hvdcompress.Accordion(...), "
            f"hvdcompress.CAT(...)), got {type(policy).__name__}"
        )
    if not isinstance(backend, (str, Transport)):
        raise TypeError(
            "backend must be 'horovod', 'mpi4py' or a hvdcompress Transport, "
            f"got {type(backend).__name__}"
        )
