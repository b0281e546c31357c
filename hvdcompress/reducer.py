"""The reducer: one step of buckets for any front end (docs/design.md, "The reducer").

An adapter (``DistributedOptimizer``, the DDP hook; the next one, FSDP or another
framework's, the same way) decides when a bucket's gradients are ready and where the
average goes; the ``Reducer`` does the rest, once for all of them:

- ``plan(buckets)``: the exchange of each bucket, chosen once per set of tensors
  (``choose_exchanges``), and, with ``exchange="auto"`` and a ``Tuning``, the options the
  tuner times (``exchange.tuning``);
- ``route(bucket)``: how the bucket travels this step, a ``Route``: its compressor, its
  exchange and its label; a compressed bucket that the plan or the tuner sends dense is
  routed as a new uncompressed ``Bucket`` (the bucket handed in is never touched);
- ``begin_step()`` before the step's first bucket starts, ``start(route, grads)``,
  ``finish(started, scale, error)`` (draining: after an error a bucket is only waited
  for, so that no rank leaves a collective pending), ``end_step()``;
- ``account``: the step's ``StepStats`` (``stats.StepAccount``);
- ``state_dict()`` / ``load_state_dict(...)``: this rank's compressor state in its
  checkpoint envelope, checked by one rule for the names of the exchanges' pieces
  (``checkpoint_shapes``).

Invariants: every rank plans the same exchanges for the same buckets and the tuner takes
the same option on every rank (``exchange.tuning``), so routing depends only on what every
rank shares; ``finish`` of every started bucket, in start order, is what every rank does
after an error too; a state loads whole or not at all (``load_state_dict``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hvdcompress.buckets import Bucket, PieceKey
from hvdcompress.checkpoint import check_optimizer_state, without_other_ranks_state
from hvdcompress.compressors import Compressor, get_compressor
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.exchange import InFlight, SummedExchange, choose_exchanges
from hvdcompress.exchange.tuning import ExchangeTuner, Tuning, make_tuner
from hvdcompress.stats import StepAccount
from hvdcompress.transports import Transport
from hvdcompress.transports.cost import calibrate_link

__all__ = ["Reducer", "Route", "Started"]

BucketKey = tuple[str, ...]  # a bucket's tensor names: the same on every rank


@dataclass(frozen=True)
class Route:
    """How a bucket travels this step: ``bucket`` as it travels (``compressed=False``
    where it is sent dense), with ``compressor`` over ``exchange``; ``label``: the option
    taken, as ``StepStats.exchanges`` records it ("allgather", "twostage",
    "hierarchical", "allreduce", or "dense" for a compressed bucket sent uncompressed)."""

    bucket: Bucket
    compressor: Compressor
    exchange: object
    label: str


@dataclass
class Started:
    """A started bucket: its route, the exchange's ``InFlight`` and the seconds its start
    (the encode; inline transports: the collectives too) took."""

    route: Route
    flight: InFlight
    start_s: float


@dataclass(frozen=True)
class _Plan:
    """A bucket's planned exchange (a ``SummedExchange`` where the plan sends it dense:
    ``dense``) and, where the tuner times them, its options by label."""

    exchange: object
    dense: bool
    options: dict | None


class Reducer:
    """One step of buckets for any front end (module doc).

    ``compressor`` (bound here to the transport's rank and size) and ``transport``;
    ``finish_transport``: where the exchanges' ``finish`` starts its collectives (the DDP
    hook's finisher thread has its own); ``exchange``, ``link_cost`` and ``tuning``: the
    adapters' arguments (``link_cost="measure"`` with ``exchange="auto"`` calibrates the
    link now, collectively, and ``link_cost`` then holds the fitted ``LinkCost``);
    ``per_tensor``: two-stage shards planned per tensor (the DDP hook's); ``label``: a
    bucket's name in the tuner's decisions."""

    def __init__(
        self,
        compressor: Compressor,
        transport: Transport,
        *,
        exchange: str = "auto",
        link_cost=None,
        tuning: Tuning | None = None,
        finish_transport: Transport | None = None,
        per_tensor: bool = False,
        label: Callable[[Bucket], str] = lambda b: str(b.index),
    ) -> None:
        compressor.bind(transport.rank, transport.size)
        self.compressor = compressor
        self.uncompressed: Compressor = get_compressor("none")
        self.transport = transport
        self.finish_transport = finish_transport or transport
        self.mode = exchange
        if link_cost == "measure" and exchange == "auto":
            link_cost = calibrate_link(transport)
        self.link_cost = link_cost
        self.tuner: ExchangeTuner | None = make_tuner(tuning, exchange, transport)
        self.account = StepAccount()
        self._per_tensor = per_tensor
        self._label = label
        self._dense = SummedExchange(transport, self.finish_transport)
        self._plans: dict[BucketKey, _Plan] = {}

    # ---- routing ---------------------------------------------------------------------------
    def plan(self, buckets: list[Bucket]) -> None:
        """Choose the exchanges of the compressed ``buckets`` not planned yet (one
        ``choose_exchanges`` for all of them: with a ``LinkCost``, one timing of the
        codec), and hand the tuner each one's options."""
        new = [b for b in buckets if b.compressed and tuple(b.names) not in self._plans]
        if not new:
            return
        plan = choose_exchanges(
            self.compressor, self.transport, new, self.mode,
            finish_transport=self.finish_transport, per_tensor=self._per_tensor,
            link_cost=self.link_cost,
        )  # fmt: skip
        for b in new:
            options = plan.options.get(b.index) if self.tuner is not None else None
            self._plans[tuple(b.names)] = _Plan(plan[b.index], b.index in plan.dense, options)
            if options is not None:
                self.tuner.add(tuple(b.names), options, plan.label(b.index), self._label(b))

    def route(self, bucket: Bucket) -> Route:
        """How ``bucket`` travels this step: uncompressed on the dense allreduce; else the
        tuner's option where it times the bucket, else the plan's (planned now if new)."""
        if not bucket.compressed:
            return Route(bucket, self.uncompressed, self._dense, "allreduce")
        key = tuple(bucket.names)
        if key not in self._plans:
            self.plan([bucket])
        planned = self._plans[key]
        exchange = None if planned.dense else planned.exchange
        if planned.options is not None:
            option = self.tuner.option(key)
            exchange = None if option == "dense" else planned.options[option]
        if exchange is None:
            return Route(replace(bucket, compressed=False), self.uncompressed, self._dense, "dense")
        return Route(bucket, self.compressor, exchange, exchange.kind)

    def sends_compressed(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` may travel compressed: compressed, and not sent dense for
        good by the plan (a bucket the tuner times may)."""
        if not bucket.compressed:
            return False
        planned = self._plans.get(tuple(bucket.names))
        return planned is None or planned.options is not None or not planned.dense

    def planned(self, bucket: Bucket):
        """The exchange the plan gave ``bucket`` before any tuning (the dense allreduce
        for an uncompressed bucket, and for one the plan sends dense)."""
        return self._plans[tuple(bucket.names)].exchange if bucket.compressed else self._dense

    @property
    def exchanges(self) -> dict[BucketKey, object]:
        """The planned exchange of every compressed bucket, by its tensor names."""
        return {key: planned.exchange for key, planned in self._plans.items()}

    # ---- one step --------------------------------------------------------------------------
    def begin_step(self) -> None:
        """The step's first bucket is about to start (collective with the tuner: every
        rank calls it at the same point)."""
        if self.tuner is not None:
            self.tuner.begin_step(self.transport.sum_floats)

    def start(self, route: Route, grads: list[torch.Tensor]) -> Started:
        """Start ``route``'s bucket with ``grads`` (averaged in place by ``finish``); its
        label goes into the step's stats (a compressed bucket's first: the DDP hook's two
        parts of one DDP bucket share its index)."""
        labels = self.account.current.exchanges
        if route.label == "allreduce" and not route.bucket.compressed:
            labels.setdefault(route.bucket.index, route.label)
        else:
            labels[route.bucket.index] = route.label
        t0 = time.perf_counter()
        flight = route.exchange.start(route.bucket, route.compressor, grads)
        return Started(route, flight, time.perf_counter() - t0)

    def finish(
        self, started: Started, scale: float, error: BaseException | None = None
    ) -> BaseException | None:
        """Finish a started bucket: decode and write its average times ``scale``, or,
        after an earlier ``error`` of the step, only wait for its collectives. Its stats
        are counted either way; returns the step's first error (``error``, else this
        bucket's), which the adapter raises once every bucket is finished."""
        route = started.route
        try:
            route.exchange.finish(
                route.bucket, route.compressor, started.flight, scale, decode=error is None
            )
        except BaseException as err:  # noqa: BLE001 - the caller drains, then raises
            error = error or err
        self.account.started(started.flight.grads, started.start_s)
        self.account.finished(started.flight)
        return error

    def end_step(self, policy=None, ok: bool = True) -> None:
        """The step's buckets are finished: the tuner times the step (unless it failed:
        ``ok``), and the step's stats become ``account.last`` (``policy`` sees them first)."""
        if self.tuner is not None and ok:
            self.account.current.tuning = self.tuner.tuning_now
            self.tuner.end_step()
        self.account.end(self.compressor, policy if ok else None)

    # ---- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's compressor state (its residuals among it), tagged with the rank, the
        job size and the compressor's configuration."""
        return {
            "rank": self.transport.rank,
            "size": self.transport.size,
            "compressor": repr(self.compressor),
            "compressor_state": self.compressor.state_dict(),
        }

    def checkpoint_shapes(self, tensors: dict[str, tuple], state=None) -> dict:
        """The state names a checkpoint may hold, with their shapes: ``tensors`` (name ->
        shape), every planned exchange's piece names (``state_shapes``: exact), and the
        pieces in ``state`` of a tensor of ``tensors`` that no plan covers yet (the DDP
        hook before its first bucket), where they lie within that tensor."""
        shapes = dict(tensors)
        for planned in self._plans.values():
            for exchange in [planned.exchange, *(planned.options or {}).values()]:
                shapes.update(exchange.state_shapes())
        covered = {name for key in self._plans for name in key}
        for name in _state_names(state):
            piece = PieceKey.parse(name)
            if piece and piece.name in tensors and piece.name not in covered:
                if piece.start < piece.stop <= math.prod(tensors[piece.name]):
                    shapes[name] = (piece.stop - piece.start,)
        return shapes

    def load_state_dict(self, state, tensors: dict[str, tuple], policy=None, then=None):
        """Load a ``state_dict()`` (a copy: the caller's stays its own), maybe another
        rank's: of the same job size it loads without that rank's residuals, with a
        warning (``without_other_ranks_state``); checked first against this rank, job
        size, compressor and ``checkpoint_shapes(tensors)`` (``CheckpointError`` naming
        the entry). Then the policy's part (where both exist) and ``then()`` (the inner
        optimizer's state), whose value is returned. On any error nothing stays loaded."""
        if isinstance(state, dict):
            state = without_other_ranks_state(dict(state), self.transport.rank, self.transport.size)
        check_optimizer_state(
            state,
            rank=self.transport.rank,
            size=self.transport.size,
            compressor=repr(self.compressor),
            shapes=self.checkpoint_shapes(tensors, state),
        )
        return _load_whole(copy.deepcopy(state), self.compressor, policy, then)


def _state_names(state) -> set[str]:
    """The per-tensor state names in a checkpoint's ``compressor_state`` (none where it is
    not the shape of one: ``check_optimizer_state`` says why)."""
    comp = state.get("compressor_state") if isinstance(state, dict) else None
    if not isinstance(comp, dict):
        return set()
    entries = [entry for entry in comp.values() if isinstance(entry, dict)]
    return {name for entry in entries for name in entry if isinstance(name, str)}


def _load_whole(state: dict, compressor: Compressor, policy, then):
    """Load a checked state: the compressor's part, the policy's where both exist, then
    ``then()``. On any error the compressor's state, its per-tensor levels and the
    policy's are put back as they were, and the cause is raised."""
    # a policy's per-tensor levels (DQSG's and QSGD's ``levels`` is their int parameter)
    levels = compressor.levels if isinstance(compressor, PerTensorLevels) else None
    before = (
        compressor.state_dict(),
        dict(levels) if levels is not None else None,
        copy.deepcopy(policy.state_dict()) if policy is not None else None,
    )
    try:
        compressor.load_state_dict(state["compressor_state"])
        if "policy" in state and policy is not None:
            policy.load_state_dict(state["policy"])
        return then() if then is not None else None
    except BaseException:
        with contextlib.suppress(Exception):  # put back what was there; raise the cause
            compressor.load_state_dict(before[0])
            if policy is not None:
                policy.load_state_dict(before[2])
            if levels is not None:
                levels.clear()
                levels.update(before[1])
        raise
