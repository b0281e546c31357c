"""The wrapper: hooks, launch order, ``synchronize``/``step``, checkpoints (package doc)."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch

from hvdcompress import checks
from hvdcompress.adapter_core import StepAccount, check_rank_state, load_rank_state, rank_state
from hvdcompress.buckets import (
    Bucket,
    check_agreement,
    describe,
    make_buckets,
    named_params,
    resolve_groups,
)
from hvdcompress.compressors import Compressor, get_compressor
from hvdcompress.exchange import GatheredExchange, SummedExchange, choose_exchanges
from hvdcompress.exchange.tuning import ExchangeTuner, Tuning, make_tuner
from hvdcompress.optimizer.options import Average, HorovodOptions, _normalize_op
from hvdcompress.optimizer.process_sets import _OutsideProcessSet
from hvdcompress.policies import Policy
from hvdcompress.sparse_grads import finish_sparse, start_sparse
from hvdcompress.stats import StepStats
from hvdcompress.transports import Transport

STATE_KEY = "hvdcompress"


class BackwardPassesError(AssertionError, RuntimeError):
    """More backward passes than ``backward_passes_per_step`` before ``step()``: an
    AssertionError as in Horovod (and a RuntimeError, as hvdcompress raised before)."""


class NonFiniteGradientError(FloatingPointError):
    """Averaged gradients that are not finite, with ``raise_on_nonfinite=True``: raised by
    ``synchronize()`` (so ``step()`` does not step the inner optimizer) on every rank
    alike, since every rank holds the same averages. ``tensors``: their names."""

    def __init__(self, tensors: list[str], compressor) -> None:
        self.tensors = list(tensors)
        shown = ", ".join(repr(n) for n in self.tensors[:4])
        more = f" and {len(self.tensors) - 4} more" if len(self.tensors) > 4 else ""
        super().__init__(
            f"hvdcompress: the averaged gradients of {shown}{more} are not finite "
            f"(compressor {compressor!r}); the inner optimizer did not step"
        )

    @classmethod
    def check(cls, named_grads, compressor) -> None:
        """Raise naming every (name, gradient) of ``named_grads`` that holds a NaN or an Inf
        (None gradients skipped); one read of the device for all of them."""
        named = [(n, g) for n, g in named_grads if g is not None]
        if not named:
            return
        finite = torch.stack([torch.isfinite(g).all() for _, g in named]).tolist()
        bad = [n for (n, _), ok in zip(named, finite, strict=True) if not ok]
        if bad:
            raise cls(bad, compressor)


@dataclass
class _Launched:
    """A started bucket: its dense part (the bucket, less any sparse gradients) and the
    sparse gradients' own collectives."""

    dense: Bucket | None
    comp: Compressor  # the compressor the dense part was started with
    exchange: object  # the exchange that started the dense part
    flight: object
    sparse: list[tuple[torch.nn.Parameter, object, int]]  # (parameter, handle, bytes sent)
    densified: list[torch.nn.Parameter]  # sparse_as_dense: back to sparse after


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


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (see package doc)."""

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
        link_cost=None,
        raise_on_nonfinite: bool = False,
        tuning: Tuning | None = None,
    ):
        super(self.__class__, self).__init__(params)
        horovod = horovod_options or HorovodOptions()
        self._raise_on_nonfinite = raise_on_nonfinite
        self._compressor = compressor
        self._uncompressed = get_compressor("none")  # buckets below compress_min_numel
        self._min_numel = compress_min_numel
        # None: this rank is outside process_set (no collectives, local steps).
        self._included = transport is not None
        transport = transport if transport is not None else _OutsideProcessSet()
        self._transport = transport
        compressor.bind(transport.rank, transport.size)
        # hvd.broadcast_optimizer_state makes missing state with the inner optimizer's
        # step() only for an optimizer whose __module__ is Horovod's; any other's step()
        # it calls on the ranks without state, whose collectives the root never joins.
        # Our step() synchronizes exactly as Horovod's does, so we answer as Horovod's.
        self.__module__ = "horovod.torch.optimizer"
        # Horovod's attributes, with its names and values.
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = horovod.gradient_predivide_factor
        self.sparse_as_dense = horovod.sparse_as_dense
        self.process_set = horovod.process_set
        self._op = _normalize_op(op)
        factor = horovod.gradient_predivide_factor
        # Horovod's Average: scaled by 1/f before the sum and by f/size after.
        self._prescale = 1.0 / factor if self._op == Average and factor != 1.0 else 1.0
        self._scale = factor / transport.size if self._op == Average else 1.0
        named = named_params(self, named_parameters)
        self._parameter_names = {p: n for n, p in named}
        self._groups = resolve_groups(horovod.groups, named)
        self._buckets = make_buckets(named, fusion_threshold, self._min_numel, self._groups)
        _check_dtypes(compressor, self._buckets)
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        plan = choose_exchanges(
            compressor, transport, self._buckets, exchange,
            link_cost=link_cost if self._included else None,
        )  # fmt: skip
        self._plan = plan
        self._tuner = make_tuner(tuning, exchange, transport) if self._included else None
        if self._tuner is None:  # the buckets "auto" sends dense go uncompressed for good
            for b in self._buckets:
                b.compressed = b.compressed and b.index not in plan.dense
        else:  # exchange.tuning: the option of each step is the tuner's
            for index, options in plan.options.items():
                self._tuner.add(index, options, plan.label(index))
        self._exchanges = plan.exchanges
        self._passes_left = {id(p): self.backward_passes_per_step for _, p in named}
        self._in_flight: dict[int, _Launched] = {}
        self._next_bucket = 0  # buckets start strictly in order
        self._should_synchronize = True
        self._synchronized = False
        self._account = StepAccount()
        compressor.check_optimizer(self)  # e.g. DGC refuses an inner optimizer with momentum
        self._policy = policy
        if not self._included:  # as Horovod: no hooks, no collectives
            self._hooks = []
            return
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        settings = [
            f"compressor {compressor!r} summable={compressor.summable}",
            f"op {self._op}; backward_passes_per_step {self.backward_passes_per_step}",
            f"fusion_threshold {fusion_threshold}; transport {transport.name}",
            f"compress_min_numel {self._min_numel}; groups {self._groups is not None}",
            f"gradient_predivide_factor {factor}; sparse_as_dense {self.sparse_as_dense}",
            f"exchange {exchange}: {[plan.label(b.index) for b in self._buckets]}; {tuning!r}",
        ]
        check_agreement(transport, describe(settings, named, self._buckets))
        if policy is not None:
            compressed = {n for b in self._buckets if b.compressed for n in b.names}
            policy.bind(self, compressor, transport, [n for n, _ in named if n in compressed])

    # ---- hooks and launching ---------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        key = id(p)
        if self._passes_left[key] <= 0:
            raise BackwardPassesError(
                "Gradients were computed more than backward_passes_per_step times before call "
                "to step(). Increase backward_passes_per_step to accumulate gradients locally. "
                f"(backward_passes_per_step={self.backward_passes_per_step})"
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
        dense, sparse, densified = [], [], []
        for p in bucket.params:
            if p.grad is None:  # unused in this step: contributes zeros, as in Horovod
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse and self.sparse_as_dense:
                p.grad = p.grad.to_dense()  # back to sparse once averaged, as in Horovod
                densified.append(p)
            if self._prescale != 1.0:
                p.grad.mul_(self._prescale)
            (sparse if p.grad.is_sparse else dense).append(p)
        part = bucket
        if sparse:  # the sparse ones go their own (uncompressed) way, as in Horovod
            keep = [i for i, p in enumerate(bucket.params) if not p.grad.is_sparse]
            part = Bucket(
                bucket.index,
                [bucket.params[i] for i in keep],
                [bucket.names[i] for i in keep],
                bucket.nbytes,
                compressed=bucket.compressed,
            )
        grads = [p.grad for p in dense]
        if self._policy is not None and bucket.compressed:
            for name, g in zip(part.names, grads, strict=True):
                self._policy.observe(name, g)  # the uncompressed local gradient
        if self._tuner is not None and self._next_bucket == 0:
            self._tuner.begin_step(self._transport.sum_floats)  # before any collective
        comp, exchange = self._route(bucket)
        self._account.current.exchanges[bucket.index] = self._option_label(bucket, comp, exchange)
        if sparse:  # the bucket's planned exchange may not fit a part of it: a plain one
            exchange = (SummedExchange if comp.summable else GatheredExchange)(self._transport)
        flight = exchange.start(part, comp, grads) if dense else None
        sparse_flights = [(p, *start_sparse(self._transport, p.grad)) for p in sparse]
        self._in_flight[bucket.index] = _Launched(
            part if dense else None, comp, exchange, flight, sparse_flights, densified
        )
        self._account.started([p.grad for p in bucket.params], time.perf_counter() - t0)

    def _comp(self, bucket: Bucket) -> Compressor:
        return self._compressor if bucket.compressed else self._uncompressed

    def _route(self, bucket: Bucket) -> tuple[Compressor, object]:
        """The compressor and exchange of ``bucket`` this step: the tuner's option where
        it tunes the bucket, else the plan's."""
        options = self._plan.options.get(bucket.index)
        if self._tuner is None or options is None:
            return self._comp(bucket), self._exchanges[bucket.index]
        option = self._tuner.option(bucket.index)
        return (self._uncompressed if option == "dense" else self._compressor), options[option]

    def _option_label(self, bucket: Bucket, comp: Compressor, exchange) -> str:
        return "dense" if bucket.compressed and comp is self._uncompressed else exchange.kind

    @property
    def exchange_tuner(self) -> ExchangeTuner | None:
        """The tuner of ``exchange="auto"`` (its ``decisions``, ``current``), or None."""
        return self._tuner

    # ---- synchronize / step ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Start what backward has not started, wait for all buckets, write averaged grads."""
        if not self._included:  # outside process_set: nothing to exchange, as in Horovod
            self._synchronized = True
            return
        for b in self._buckets[self._next_bucket :]:
            b.ready.update(range(len(b.params)))
        self._launch_ready()
        error: BaseException | None = None
        divisor = self._transport.size if self._op == Average else None
        for b in self._buckets:
            launched = self._in_flight.pop(b.index)
            flight = launched.flight
            try:  # after an error: only wait, so no rank leaves a collective pending
                if launched.dense is not None:
                    launched.exchange.finish(
                        launched.dense, launched.comp, flight, self._scale, decode=error is None
                    )
            except BaseException as err:  # noqa: BLE001 - keep draining, then raise
                error = error or err
            for p, handle, nbytes in launched.sparse:
                self._account.sent_sparse(nbytes)
                try:
                    result = handle.wait()
                    if error is None:
                        finish_sparse(result, p.grad, divisor)
                except BaseException as err:  # noqa: BLE001 - keep draining, then raise
                    error = error or err
            for p in launched.densified:
                p.grad = p.grad.to_sparse()
            if flight is not None:
                self._account.finished(flight)
        if error is None and self._raise_on_nonfinite:
            named = [(self._parameter_names[p], p.grad) for b in self._buckets for p in b.params]
            try:
                NonFiniteGradientError.check(named, self._compressor)
            except NonFiniteGradientError as err:
                error = err
        if self._tuner is not None and error is None:
            self._account.current.tuning = self._tuner.tuning_now
            self._tuner.end_step()
        self._account.end(self._compressor, self._policy if error is None else None)
        self._reset_round()
        self._synchronized = True
        if error is not None:
            raise error

    def _reset_round(self) -> None:
        for b in self._buckets:
            b.ready.clear()
        self._passes_left = dict.fromkeys(self._passes_left, self.backward_passes_per_step)
        self._next_bucket = 0

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For ``synchronize(); clip grads; with skip_synchronize(): step()`` (as Horovod)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (Horovod's method): the count of the current
        accumulation starts again."""
        self.backward_passes_per_step = checks.integer("backward_passes_per_step", passes, 1)
        self._passes_left = dict.fromkeys(self._passes_left, self.backward_passes_per_step)

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(  # Horovod's text, so that filters written for it apply
                    "optimizer.step() called without optimizer.skip_synchronize() context "
                    "after optimizer.synchronize(). This can cause training slowdown. You may "
                    "want to consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._in_flight:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition."
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        if not self._included:  # outside process_set: no compressor state
            return state
        state[STATE_KEY] = rank_state(self._transport, self._compressor)
        if self._policy is not None:
            state[STATE_KEY]["policy"] = self._policy.state_dict()  # Accordion's norms, levels
        return state

    def load_state_dict(self, state_dict):
        """Load the inner optimizer's state and the hvdcompress part (compressor and policy
        state), which is checked first (``check_optimizer_state``: ``CheckpointError``
        naming the entry); on any error nothing stays loaded. Another rank's state of the
        same job size loads by ``without_other_ranks_state``'s rule. As in Horovod,
        loading ends any gradient accumulation in progress."""
        if self._in_flight:
            raise AssertionError(
                "optimizer.load_state_dict() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): their collectives are in flight"
            )
        self._reset_round()
        self._synchronized = False
        self._should_synchronize = True
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is None or not self._included:
            return super(self.__class__, self).load_state_dict(state_dict)
        shapes = {
            n: tuple(p.shape)
            for b in self._buckets
            if b.compressed
            for n, p in zip(b.names, b.params, strict=True)
        }
        exchanges = [*self._exchanges.values()]
        exchanges += [e for options in self._plan.options.values() for e in options.values()]
        for exchange in exchanges:  # the two-stage and hierarchical exchanges' piece state
            shapes.update(exchange.state_shapes())
        ours = check_rank_state(ours, self._transport, self._compressor, shapes)
        return load_rank_state(
            ours, self._compressor, self._policy,
            then=lambda: super(self.__class__, self).load_state_dict(state_dict),
        )  # fmt: skip

    @property
    def last_stats(self) -> StepStats:
        """The ``StepStats`` of the last ``synchronize()``."""
        return self._account.last

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
