"""DistributedOptimizer: hvd.DistributedOptimizer with compressed gradients.

``DistributedOptimizer(optimizer, named_parameters, compression=..., backend=...)`` returns
an instance of a subclass of ``optimizer``'s class (as Horovod does), so it is a drop-in:
``loss.backward(); opt.step()``.

This module is the wrapper: hooks, launch order, ``synchronize``/``step``, checkpoints;
buckets and the agreement check are in ``buckets``, who sends what to whom in
``exchange``, the step record in ``stats`` (docs/design.md section 9, the gradient walk).

A post-accumulate-grad hook counts backward passes; when a bucket's gradients are all
ready, the policy observes them and the bucket's exchange compresses them and starts its
collective, overlapping the rest of backward. ``synchronize()`` (called by ``step()``)
starts what is left and finishes every bucket in order, draining every collective even
after an error so that no rank leaves one pending.

Invariants: after ``synchronize()`` every rank holds bit-identical gradients on the gather
path; ranks that disagree on what they communicate get ``RankAgreementError`` at
construction, on every rank; a payload that fails to decode raises ``PayloadError``
naming the sending rank and tensor, on every rank. Compressor state is per rank:
``state_dict()`` carries it under ``"hvdcompress"``, and each rank saves its own.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch

from hvdcompress.buckets import (
    Bucket,
    RankAgreementError,
    check_agreement,
    describe,
    make_buckets,
    named_params,
    resolve_fusion_threshold,
)
from hvdcompress.compat import resolve_compressor
from hvdcompress.compressors import Compressor, get_compressor
from hvdcompress.exchange import exchange_for
from hvdcompress.policies import Policy
from hvdcompress.stats import StepStats
from hvdcompress.transports import Transport, make_transport

Average = "average"
Sum = "sum"
STATE_KEY = "hvdcompress"

__all__ = ["Average", "Sum", "DistributedOptimizer", "RankAgreementError", "StepStats"]


def _normalize_op(op) -> str:
    if isinstance(op, str) and op in (Average, Sum):
        return op
    # Horovod's ReduceOp values (horovod/common/basics.py): Average 0, Sum 1, Adasum 2.
    if isinstance(op, int) and not isinstance(op, bool) and op in (0, 1):
        return (Average, Sum)[op]
    raise ValueError(
        "op must be hvdcompress.Average, hvdcompress.Sum, hvd.Average (0) or hvd.Sum (1), "
        f"got {op!r}"
    )


def _check_int(what: str, value, low: int, hint: str = "") -> int:
    """``value`` as an int >= ``low``, else ValueError naming the valid values."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not float(value).is_integer()
        or value < low
    ):
        raise ValueError(f"{what} must be an int >= {low}{hint}, got {value!r}")
    return int(value)


def _check_dtypes(compressor: Compressor, buckets: list[Bucket]) -> None:
    """TypeError at construction (not at the first step) naming the first parameter whose
    dtype the compressor cannot send, and the dtypes it can."""
    for b in buckets:
        if b.compressed:
            for name, p in zip(b.names, b.params, strict=True):
                try:
                    compressor.check_dtype(name, p.dtype)
                except TypeError as err:
                    raise TypeError(
                        f"{err} (parameter {name!r}; convert the model, e.g. model.float(), "
                        "or leave such tensors uncompressed with compress_min_numel)"
                    ) from None


@dataclass(frozen=True)
class HorovodOptions:
    """The keywords of ``hvd.DistributedOptimizer`` (Horovod 0.28.1) beyond those every
    hvdcompress optimizer has, with Horovod's defaults and meaning."""

    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: object = None
    sparse_as_dense: bool = False
    process_set: object = None


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (see module doc)."""

    def __init__(
        self,
        params,
        named_parameters,
        compressor: Compressor,
        transport: Transport,
        backward_passes_per_step: int,
        op: str,
        fusion_threshold: int,
        policy: Policy | None = None,
        compress_min_numel: int = 0,
        *,
        horovod_options: HorovodOptions | None = None,
        exchange: str = "auto",
    ):
        super(self.__class__, self).__init__(params)
        # Horovod's own keywords (gradient_predivide_factor, num_groups, groups,
        # sparse_as_dense, process_set): see HorovodOptions.
        self._horovod_options = horovod_options or HorovodOptions()
        # Which exchange gather-only buckets use: "auto", "allgather" or "twostage".
        self._exchange_mode = exchange
        self._compressor = compressor
        self._uncompressed = get_compressor("none")  # buckets below compress_min_numel
        self._min_numel = _check_int("compress_min_numel", compress_min_numel, 0)
        self._transport = transport
        compressor.bind(transport.rank, transport.size)
        self.backward_passes_per_step = _check_int(
            "backward_passes_per_step", backward_passes_per_step, 1
        )
        self._op = op
        self._scale = 1.0 / transport.size if op == Average else 1.0
        named = named_params(self, named_parameters)
        self._buckets = make_buckets(named, fusion_threshold, self._min_numel)
        _check_dtypes(compressor, self._buckets)
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._exchanges = {
            True: exchange_for(compressor, transport),
            False: exchange_for(self._uncompressed, transport),
        }
        self._passes_left = {id(p): self.backward_passes_per_step for _, p in named}
        self._in_flight: dict[int, object] = {}
        self._next_bucket = 0  # buckets start strictly in order
        self._should_synchronize = True
        self._synchronized = False
        self.last_stats = StepStats()
        self._stats = StepStats()
        compressor.check_optimizer(self)  # e.g. DGC refuses an inner optimizer with momentum
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        settings = [
            f"compressor {compressor!r} summable={compressor.summable}",
            f"op {op}; backward_passes_per_step {self.backward_passes_per_step}",
            f"fusion_threshold {fusion_threshold}; transport {transport.name}",
            f"compress_min_numel {self._min_numel}",
        ]
        check_agreement(transport, describe(settings, named, self._buckets))
        self._policy = policy
        if policy is not None:
            compressed = {n for b in self._buckets if b.compressed for n in b.names}
            policy.bind(self, compressor, transport, [n for n, _ in named if n in compressed])

    # ---- hooks and launching ---------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        key = id(p)
        if self._passes_left[key] <= 0:
            raise RuntimeError(
                "gradients were computed more than backward_passes_per_step="
                f"{self.backward_passes_per_step} times before step() or synchronize(); "
                "raise backward_passes_per_step or call step() more often"
            )
        self._passes_left[key] -= 1
        if self._passes_left[key] == 0:
            bucket, i = self._where[key]
            bucket.ready.add(i)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_bucket < len(self._buckets):
            b = self._buckets[self._next_bucket]
            if len(b.ready) < len(b.params):
                return
            self._launch(b)
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        t0 = time.perf_counter()
        grads = []
        for p in bucket.params:
            if p.grad is None:  # unused in this step: contributes zeros, as in Horovod
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        if self._policy is not None and bucket.compressed:
            for name, g in zip(bucket.names, grads, strict=True):
                self._policy.observe(name, g)  # the uncompressed local gradient
        flight = self._exchanges[bucket.compressed].start(bucket, self._comp(bucket), grads)
        self._in_flight[bucket.index] = flight
        s = self._stats
        s.numel += sum(g.numel() for g in grads)
        s.raw_bytes += sum(g.numel() * g.element_size() for g in grads)
        s.compress_s += time.perf_counter() - t0

    def _comp(self, bucket: Bucket) -> Compressor:
        return self._compressor if bucket.compressed else self._uncompressed

    # ---- synchronize / step ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Start what backward has not started, wait for all buckets, write averaged grads."""
        for b in self._buckets[self._next_bucket :]:
            b.ready.update(range(len(b.params)))
        self._launch_ready()
        error: BaseException | None = None
        for b in self._buckets:
            flight = self._in_flight.pop(b.index)
            try:  # after an error: only wait, so no rank leaves a collective pending
                exchange = self._exchanges[b.compressed]
                exchange.finish(b, self._comp(b), flight, self._scale, decode=error is None)
            except BaseException as err:  # noqa: BLE001 - keep draining, then raise
                error = error or err
            self._stats.add(flight)
        self._stats.metrics = self._compressor.pop_metrics()
        if self._policy is not None and error is None:
            self._policy.after_step(self._stats)  # every collective of the step is done
            self._stats.metrics = {**self._stats.metrics, **self._policy.pop_metrics()}
        self._reset_round()
        self._synchronized = True
        self.last_stats, self._stats = self._stats, StepStats()
        if error is not None:
            raise error

    def _reset_round(self) -> None:
        for b in self._buckets:
            b.ready.clear()
        for key in self._passes_left:
            self._passes_left[key] = self.backward_passes_per_step
        self._next_bucket = 0

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip grads; with skip_synchronize(): step()`` (as Horovod)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called after optimizer.synchronize() without "
                    "skip_synchronize(): gradients are synchronized again",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._in_flight:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize()"
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state[STATE_KEY] = {
            "rank": self._transport.rank,
            "size": self._transport.size,
            "compressor": repr(self._compressor),
            "compressor_state": self._compressor.state_dict(),
        }
        if self._policy is not None:
            state[STATE_KEY]["policy"] = self._policy.state_dict()  # Accordion's norms, levels
        return state

    def load_state_dict(self, state_dict):
        """Load the inner optimizer's state and the hvdcompress part (compressor and policy
        state). The hvdcompress part is checked first (``hvdcompress.CheckpointError``
        naming the entry: another rank's state, unknown tensor names, residuals of the
        wrong size or dtype, NaN or Inf); on any error nothing stays loaded."""
        import copy

        from hvdcompress.checkpoint import check_optimizer_state

        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is None:
            return super(self.__class__, self).load_state_dict(state_dict)
        shapes = {
            n: tuple(p.shape)
            for b in self._buckets
            if b.compressed
            for n, p in zip(b.names, b.params, strict=True)
        }
        check_optimizer_state(
            ours,
            rank=self._transport.rank,
            size=self._transport.size,
            compressor=repr(self._compressor),
            shapes=shapes,
        )
        comp, policy = self._compressor, self._policy
        before = (
            comp.state_dict(),
            dict(comp.levels) if hasattr(comp, "levels") else None,
            copy.deepcopy(policy.state_dict()) if policy is not None else None,
        )
        try:
            comp.load_state_dict(ours["compressor_state"])
            if "policy" in ours and policy is not None:
                policy.load_state_dict(ours["policy"])
            return super(self.__class__, self).load_state_dict(state_dict)
        except BaseException:
            with contextlib.suppress(Exception):  # put back what was there; raise the cause
                comp.load_state_dict(before[0])
                if policy is not None:
                    policy.load_state_dict(before[2])
                if before[1] is not None:
                    comp.levels.clear()
                    comp.levels.update(before[1])
            raise

    @property
    def compressor(self) -> Compressor:
        return self._compressor

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def policy(self) -> Policy | None:
        return self._policy

    @property
    def buckets(self) -> list[Bucket]:
        return self._buckets


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
):
    """Wrap ``optimizer`` so gradients are compressed, exchanged and averaged across ranks.

    ``compression``: a compressor name, ``hvdcompress.get_compressor(...)``, or
    ``hvdcompress.Compression.<name>``. ``backend``: ``"horovod"`` (needs ``hvd.init()``),
    ``"mpi4py"`` (no Horovod needed) or a Transport. ``fusion_threshold``: bytes of
    uncompressed gradient per collective (default ``HOROVOD_FUSION_THRESHOLD`` or 64 MiB;
    0 sends every tensor on its own). ``policy``: ``hvdcompress.Accordion(...)`` or
    ``hvdcompress.CAT(...)``, which sets the compressor's level per tensor during training.
    ``compress_min_numel``: tensors with fewer elements are sent uncompressed (one float32
    allreduce per bucket of them), the switch for links fast enough that compressing a
    small tensor costs more time than it saves (see README, "Results").
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
    compressor = resolve_compressor(compression)
    op = _normalize_op(op)
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(
            "policy must be None or an hvdcompress.Policy (hvdcompress.Accordion(...), "
            f"hvdcompress.CAT(...)), got {type(policy).__name__}"
        )
    fusion_threshold = _check_int(
        "fusion_threshold",
        resolve_fusion_threshold(fusion_threshold),
        0,
        " (bytes; 0: one tensor per bucket)",
    )
    _check_int("backward_passes_per_step", backward_passes_per_step, 1)
    _check_int("compress_min_numel", compress_min_numel, 0)
    if not isinstance(backend, (str, Transport)):
        raise TypeError(
            "backend must be 'horovod', 'mpi4py' or a hvdcompress Transport, "
            f"got {type(backend).__name__}"
        )
    transport = backend if isinstance(backend, Transport) else make_transport(backend)
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_DistributedOptimizer.__dict__),
    )
    return cls(
        optimizer.param_groups,
        named_parameters,
        compressor,
        transport,
        backward_passes_per_step,
        op,
        fusion_threshold,
        policy,
        compress_min_numel,
        horovod_options=HorovodOptions(
            gradient_predivide_factor=gradient_predivide_factor,
            num_groups=num_groups,
            groups=groups,
            sparse_as_dense=sparse_as_dense,
            process_set=process_set,
        ),
        exchange=exchange,
    )
