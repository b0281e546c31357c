"""The wrapper: hooks, launch order, ``synchronize``/``step``, checkpoints (package doc)."""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, replace

import torch

from hvdcompress import checks
from hvdcompress.buckets import (
    Bucket,
    describe,
    make_buckets,
    named_params,
    resolve_groups,
)
from hvdcompress.compressors import Compressor
from hvdcompress.exchange import GatheredExchange, SummedExchange
from hvdcompress.exchange.tuning import ExchangeTuner, Tuning
from hvdcompress.optimizer.options import Average, HorovodOptions, _normalize_op
from hvdcompress.optimizer.process_sets import _OutsideProcessSet
from hvdcompress.policies import Policy
from hvdcompress.reducer import Reducer, Route, Started, check_start_up
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
    """A started bucket: its dense part (the bucket, less any sparse gradients; None
    where every gradient is sparse) and the sparse gradients' own collectives."""

    dense: Started | None
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
    """Methods mixed into a subclass of the wrapped optimizer's class (see package doc):
    Horovod's semantics (backward passes, the launch order, sparse gradients, process
    sets, groups, ``synchronize``/``step``) over one ``Reducer``, which routes, starts,
    finishes, accounts and checkpoints the buckets."""

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
        # None: this rank is outside process_set (no collectives, local steps).
        self._included = transport is not None
        transport = transport if transport is not None else _OutsideProcessSet()
        self._transport = transport
        self._set_horovod_attributes(backward_passes_per_step, op, horovod)
        named = named_params(self, named_parameters)
        self._parameter_names = {p: n for n, p in named}
        self._groups = resolve_groups(horovod.groups, named)
        self._buckets = make_buckets(named, fusion_threshold, compress_min_numel, self._groups)
        _check_dtypes(compressor, self._buckets)
        if self._included:  # before the reducer, whose making is collective
            settings = [
                f"op {self._op}; backward_passes_per_step {self.backward_passes_per_step}",
                f"fusion_threshold {fusion_threshold}; transport {transport.name}",
                f"compress_min_numel {compress_min_numel}; groups {self._groups is not None}",
                f"gradient_predivide_factor {self.gradient_predivide_factor}; "
                f"sparse_as_dense {self.sparse_as_dense}",
            ]
            check_start_up(
                transport, compressor, exchange=exchange, tuning=tuning, link_cost=link_cost,
                lines=describe(settings, named, self._buckets),
            )  # fmt: skip
        self._reducer = Reducer(
            compressor, transport, exchange=exchange,
            link_cost=link_cost if self._included else None,
            tuning=tuning if self._included else None, scale=self._scale,
        )  # fmt: skip
        self._reducer.plan(self._buckets)
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._passes_left = {id(p): self.backward_passes_per_step for _, p in named}
        self._in_flight: dict[int, _Launched] = {}
        self._next_bucket = 0  # buckets start strictly in order
        self._should_synchronize = True
        self._synchronized = False
        compressor.check_optimizer(self)  # e.g. DGC refuses an inner optimizer with momentum
        self._policy = policy
        if not self._included:  # as Horovod: no hooks, no collectives
            self._hooks = []
            return
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        if policy is not None:
            compressed = {n for b in self.buckets if b.compressed for n in b.names}
            policy.bind(self, compressor, transport, [n for n, _ in named if n in compressed])

    def _set_horovod_attributes(self, backward_passes_per_step, op, horovod) -> None:
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
        self._scale = factor / self._transport.size if self._op == Average else 1.0

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
        dense, sparse, densified = _horovod_grads(bucket, self.sparse_as_dense, self._prescale)
        grads = [p.grad for p in dense]
        if self._policy is not None and self._reducer.sends_compressed(bucket):
            pairs = zip(bucket.names, bucket.params, strict=True)
            names = [n for n, p in pairs if not p.grad.is_sparse]
            for name, g in zip(names, grads, strict=True):
                self._policy.observe(name, g)  # the uncompressed local gradient
        if self._next_bucket == 0:
            self._reducer.begin_step()  # before any collective
        route = self._reducer.route(bucket)
        if sparse:  # the sparse ones go their own (uncompressed) way, as in Horovod
            route = _without_sparse(route, bucket, self._transport)
        started = self._reducer.start(route, grads) if dense else None
        sparse_flights = []
        if sparse:  # their own collectives, counted as Horovod's are
            t0 = time.perf_counter()
            sparse_flights = [(p, *start_sparse(self._transport, p.grad)) for p in sparse]
            self._reducer.account.started([p.grad for p in sparse], time.perf_counter() - t0)
        self._in_flight[bucket.index] = _Launched(started, sparse_flights, densified)

    @property
    def exchange_tuner(self) -> ExchangeTuner | None:
        """The tuner of ``exchange="auto"`` (its ``decisions``, ``current``), or None."""
        return self._reducer.tuner

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
            if launched.dense is not None:  # after an error: only waits (reducer.finish)
                error = self._reducer.finish(launched.dense, self._scale, error)
            for p, handle, nbytes in launched.sparse:
                self._reducer.account.sent_sparse(nbytes)
                try:
                    result = handle.wait()
                    if error is None:
                        finish_sparse(result, p.grad, divisor)
                except BaseException as err:  # noqa: BLE001 - keep draining, then raise
                    error = error or err
            for p in launched.densified:
                p.grad = p.grad.to_sparse()
        if error is None and self._raise_on_nonfinite:
            named = [(self._parameter_names[p], p.grad) for b in self._buckets for p in b.params]
            try:
                NonFiniteGradientError.check(named, self.compressor)
            except NonFiniteGradientError as err:
                error = err
        self._reducer.end_step(self._policy, ok=error is None)
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
        state[STATE_KEY] = self._reducer.state_dict()
        if self._policy is not None:
            state[STATE_KEY]["policy"] = self._policy.state_dict()  # Accordion's norms, levels
        return state

    def load_state_dict(self, state_dict):
        """Load the inner optimizer's state and the hvdcompress part (compressor and policy
        state), which is checked first (``Reducer.load_state_dict``: ``CheckpointError``
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
        tensors = {
            n: tuple(p.shape)
            for b in self.buckets
            if b.compressed
            for n, p in zip(b.names, b.params, strict=True)
        }
        return self._reducer.load_state_dict(
            ours, tensors, self._policy,
            then=lambda: super(self.__class__, self).load_state_dict(state_dict),
        )  # fmt: skip

    @property
    def last_stats(self) -> StepStats:
        """The ``StepStats`` of the last ``synchronize()``."""
        return self._reducer.account.last

    @property
    def compressor(self) -> Compressor:
        return self._reducer.compressor

    @property
    def reducer(self) -> Reducer:
        """The ``Reducer`` that routes, starts, finishes and accounts the buckets."""
        return self._reducer

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def policy(self) -> Policy | None:
        return self._policy

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets as they travel: one that ``exchange="auto"`` sends dense for good
        (no tuner) as uncompressed (a copy: the optimizer's own are not touched)."""
        return [
            b if self._reducer.sends_compressed(b) or not b.compressed
            else replace(b, compressed=False)
            for b in self._buckets
        ]  # fmt: skip


def _horovod_grads(bucket: Bucket, sparse_as_dense: bool, prescale: float):
    """The bucket's gradients as Horovod hands them over: a zero gradient for a
    parameter unused this step, sparse ones densified (``sparse_as_dense``) and every
    one pre-scaled; returns (dense parameters, sparse ones, densified ones)."""
    dense, sparse, densified = [], [], []
    for p in bucket.params:
        if p.grad is None:  # unused in this step: contributes zeros, as in Horovod
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse and sparse_as_dense:
            p.grad = p.grad.to_dense()  # back to sparse once averaged, as in Horovod
            densified.append(p)
        if prescale != 1.0:
            p.grad.mul_(prescale)
        (sparse if p.grad.is_sparse else dense).append(p)
    return dense, sparse, densified


def _without_sparse(route: Route, bucket: Bucket, transport: Transport) -> Route:
    """``route`` for the bucket less its sparse gradients, on a plain exchange (the
    planned one may not fit a part of the bucket: two-stage shards)."""
    keep = [i for i, p in enumerate(bucket.params) if not p.grad.is_sparse]
    part = Bucket(
        bucket.index,
        [bucket.params[i] for i in keep],
        [bucket.names[i] for i in keep],
        bucket.nbytes,
        compressed=route.bucket.compressed,
    )
    plain = SummedExchange if route.compressor.summable else GatheredExchange
    return replace(route, bucket=part, exchange=plain(transport))
