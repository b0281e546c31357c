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
- ``check_start_up(...)``, before a reducer is made: the start-up agreement check of its
  settings (compressor, exchange, tuning, link cost, the node override) with the
  adapter's (``RankAgreementError`` on every rank, before any collective that ranks which
  disagree would not all make);
- ``state_dict()`` / ``load_state_dict(...)``: this rank's compressor state in its
  checkpoint envelope, with the layout it was made on (exchange, nodes), checked by one
  rule for the names of the exchanges' pieces (``checkpoint_shapes``).

One residual per tensor (docs/error-feedback.md, "One residual per tensor"): each
exchange keeps its own error-feedback keys (the tensor, or the two-stage and hierarchical
exchanges' pieces); when a bucket's route changes (the tuner's trials, a re-check), the
residuals the new route does not keep are added into the gradient it sends, and dropped,
so none is stranded and the residual memory stays that of one route.

Invariants: every rank plans the same exchanges for the same buckets and the tuner takes
the same option on every rank (``exchange.tuning``), so routing depends only on what every
rank shares; ``finish`` of every started bucket, in start order, is what every rank does
after an error too; a state loads whole or not at all (``load_state_dict``); a residual
moved into a gradient keeps the sum over ranks of what is still to be sent.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hvdcompress.buckets import Bucket, PieceKey, check_agreement
from hvdcompress.checkpoint import check_layout, check_optimizer_state, without_other_ranks_state
from hvdcompress.compressors import Compressor, GatherCompressor, get_compressor
from hvdcompress.compressors.cast import Cast
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.exchange import InFlight, SummedExchange, check_mode, choose_exchanges
from hvdcompress.exchange.hierarchical import node_topology
from hvdcompress.exchange.tuning import HALF, ExchangeTuner, Tuning, make_tuner
from hvdcompress.stats import StepAccount
from hvdcompress.transports import Transport
from hvdcompress.transports.cost import calibrate_link
from hvdcompress.transports.topology import OVERRIDE_ENV

__all__ = ["Reducer", "Route", "Started", "check_start_up"]

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
    bucket's name in the tuner's decisions; ``scale``: the average's factor (default
    1 / size), by which an owner's residual is in the gradient's units.

    Made at the same point on every rank (collective: the link's calibration, and the
    topology where a hierarchical exchange may serve the job, so that a bad
    ``HVDC_RANKS_PER_NODE`` is reported on every rank now, not at the first step)."""

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
        scale: float | None = None,
    ) -> None:
        check_mode(compressor, exchange)
        compressor.bind(transport.rank, transport.size)
        self.compressor = compressor
        self.uncompressed: Compressor = get_compressor("none")
        self.transport = transport
        self.finish_transport = finish_transport or transport
        self.mode = exchange
        if link_cost == "measure" and exchange == "auto":
            link_cost = calibrate_link(transport)
        self.link_cost = link_cost
        self.tuning = tuning
        self.tuner: ExchangeTuner | None = make_tuner(tuning, exchange, transport)
        self.scale = 1.0 / transport.size if scale is None else scale
        self.nodes = self._topology()
        self.account = StepAccount()
        self._per_tensor = per_tensor
        self._label = label
        self._dense = SummedExchange(transport, self.finish_transport)
        self._halves: dict[str, Compressor] = {}  # the 16-bit options' casts
        self._plans: dict[BucketKey, _Plan] = {}
        self._last_label: dict[BucketKey, str] = {}  # the route each bucket took last

    def _topology(self) -> tuple | None:
        """The nodes a hierarchical exchange would be planned on, where one may serve the
        job (collective: ``topology.detect``); None where none can."""
        gather = isinstance(self.compressor, GatherCompressor)
        auto = self.mode == "auto" and gather and self.transport.size >= 4  # hierarchical_open's
        if not self.transport.splits or not (self.mode == "hierarchical" or auto):
            return None
        nodes = node_topology(self.transport).nodes
        if self.mode == "hierarchical" and len(nodes) < 2:
            warnings.warn(
                f"exchange='hierarchical' on one node ({self.transport.size} ranks): no "
                "link between nodes to save; every bucket goes through the node stages "
                "for nothing (exchange='auto' picks a flat exchange here)",
                UserWarning,
                stacklevel=5,  # the user's DistributedOptimizer(...) or state.register(...)
            )
        return nodes

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
        half = self.tuner.tuning.half if self.tuner is not None else None
        if isinstance(self.compressor, Cast):
            half = None  # a cast already: no 16-bit option beside it
        for b in new:
            options = plan.options.get(b.index) if self.tuner is not None else None
            if options is not None and half is not None:  # the 16-bit allreduce, timed too
                options = {**options, half: self._dense}
            self._plans[tuple(b.names)] = _Plan(plan[b.index], b.index in plan.dense, options)
            if options is not None:
                self.tuner.add(tuple(b.names), options, plan.label(b.index), self._label(b))

    def route(self, bucket: Bucket) -> Route:
        """How ``bucket`` travels this step: uncompressed on the dense allreduce; else the
        tuner's option where it times the bucket, else the plan's (planned now if new).
        Its label goes into the step's stats (a compressed bucket's first: the DDP hook's
        two parts of one DDP bucket share its index)."""
        route = self._route(bucket)
        labels = self.account.current.exchanges
        if route.label == "allreduce" and not route.bucket.compressed:
            labels.setdefault(bucket.index, route.label)
        else:
            labels[bucket.index] = route.label
        return route

    def _route(self, bucket: Bucket) -> Route:
        if not bucket.compressed:
            return Route(bucket, self.uncompressed, self._dense, "allreduce")
        key = tuple(bucket.names)
        if key not in self._plans:
            self.plan([bucket])
        planned = self._plans[key]
        exchange = None if planned.dense else planned.exchange
        if planned.options is not None:
            option = self.tuner.option(key)
            if option in HALF:  # the 16-bit dense allreduce
                if option not in self._halves:
                    self._halves[option] = get_compressor(option)
                half = self._halves[option]
                return Route(replace(bucket, compressed=False), half, self._dense, option)
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
        """Start ``route``'s bucket with ``grads`` (averaged in place by ``finish``); on a
        route the bucket did not take last, first move the residuals it does not keep into
        ``grads`` (module doc)."""
        self.enter(route, grads)
        t0 = time.perf_counter()
        flight = route.exchange.start(route.bucket, route.compressor, grads)
        return Started(route, flight, time.perf_counter() - t0)

    def enter(self, route: Route, grads: list[torch.Tensor]) -> None:
        """``route``'s bucket is about to be sent with ``grads`` (``start`` calls it; an
        adapter that sends a bucket itself, as the DDP hook's all-dense one, too): on a
        route the bucket did not take last, the residuals it does not keep go into
        ``grads`` first (module doc)."""
        if route.bucket.compressed or route.label in ("dense", *HALF):
            key = tuple(route.bucket.names)
            if self._last_label.get(key) != route.label:
                self._fold_stranded(route, grads)
                self._last_label[key] = route.label

    def _fold_stranded(self, route: Route, grads: list[torch.Tensor]) -> None:
        """Add into ``grads`` every residual of their tensors that ``route`` does not keep
        (another exchange's pieces, or any residual where the route is dense), and drop it
        (module doc: one residual per tensor). An owner's residual is of the average: it
        goes in times 1 / ``scale``."""
        memory = self.compressor.memory
        if memory is None or not memory.residuals:
            return
        position = {name: i for i, name in enumerate(route.bucket.names)}
        keep = (
            route.exchange.residual_keys(route.bucket, route.compressor)
            if route.compressor is self.compressor
            else set()  # sent dense, in float32 or 16 bits: no residual kept
        )
        for key in [k for k in memory.residuals if k not in keep]:
            name, offset, owner = _tensor_of(key)
            if name not in position:
                continue
            residual = memory.residuals.pop(key)
            flat = grads[position[name]].view(-1)[offset : offset + residual.numel()]
            weight = 1.0 / self.scale if owner else 1.0
            flat.add_((residual * weight if weight != 1.0 else residual).to(flat.dtype))

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
    @property
    def layout(self) -> dict:
        """What the exchanges' pieces depend on: the exchange asked for and the nodes
        (None where no hierarchical exchange can serve the job)."""
        nodes = None if self.nodes is None else [list(n) for n in self.nodes]
        return {"exchange": self.mode, "nodes": nodes}

    def state_dict(self) -> dict:
        """This rank's compressor state (its residuals among it), tagged with the rank, the
        job size, the compressor's configuration and the layout it was made on."""
        return {
            "rank": self.transport.rank,
            "size": self.transport.size,
            "compressor": repr(self.compressor),
            "compressor_state": self.compressor.state_dict(),
            "layout": self.layout,
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
        check_layout(state.get("layout"), self.layout, _pieces(state))
        self._last_label.clear()  # the next step's routes fold what they do not keep
        return _load_whole(copy.deepcopy(state), self.compressor, policy, then)


def check_start_up(
    transport: Transport, compressor: Compressor, *, exchange: str, tuning, link_cost, lines
) -> None:
    """The start-up agreement check (``buckets.check_agreement``; docs/wire-format.md,
    "Agreement at start-up") of what a ``Reducer`` will be made with and the adapter's
    ``lines`` (its own settings, the tensors, the buckets): ``RankAgreementError`` on every
    rank, naming the first difference. Collective: every rank calls it before making its
    reducer (whose making is collective in ways that depend on these settings)."""
    own = [
        f"compressor {compressor!r} summable={compressor.summable}",
        f"exchange {exchange}; tuning {tuning!r}; link_cost {_kind(link_cost)}",
        f"{OVERRIDE_ENV} {os.environ.get(OVERRIDE_ENV)!r}",
    ]
    check_agreement(transport, own + list(lines))


def _kind(link_cost) -> str:
    """A ``link_cost`` as every rank can compare it: its kind (a fitted ``LinkCost``'s
    numbers differ from run to run; ranks share one after ``calibrate_link``)."""
    return "none" if link_cost is None else type(link_cost).__name__


def _tensor_of(key) -> tuple[str, int, bool]:
    """(tensor name, offset of the key's first element in the flat tensor, whether it is
    an owner's residual) of a compressor state key: a tensor's name, a piece of it, or a
    piece of a piece (the hierarchical exchange's two-stage pieces), as an object or as
    a checkpoint wrote it."""
    if isinstance(key, str):
        parsed = PieceKey.parse(key)
        if parsed is None:
            return key, 0, False
        key = parsed
    name, offset, owner = _tensor_of(key.name)
    return name, offset + key.start, owner or key.owner


def _pieces(state) -> list[str]:
    """The piece names among a checkpoint's per-tensor state."""
    return sorted(n for n in _state_names(state) if PieceKey.parse(n) is not None)


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
