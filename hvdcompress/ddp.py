"""A DDP communication hook: hvdcompress's compressors for ``torch.nn.parallel.
DistributedDataParallel`` users without Horovod (docs/horovod-parity.md, "Horovod parity
and the DDP hook", for the exchanges, the uncompressed buckets and the overlap; the late
binding: docs/integrations.md, "The hook state binds late").

    state = hvdcompress.DDPHookState("3lc")   # before or after init_process_group
    state.register(ddp_model)                  # = ddp_model.register_comm_hook(state, ddp_hook)

DDP calls the hook with each gradient bucket; the hook moves the same payloads as
``hvdcompress.DistributedOptimizer``, over ``transports.torch_dist``, by the exchange
``choose_exchanges`` picks (two-stage shards planned per tensor), and averages the
bucket's buffer in place. With ``overlap=True`` on gloo over the world group, the
hook's collectives run on a threaded transport and a finisher thread completes each
bucket's future, so backward goes on while the bytes move; otherwise each bucket
finishes inside the hook.

Invariants: every transport's collectives are started from one thread, in bucket order,
the same on every rank (the hook starts every part's collectives before it returns; the
finisher starts only ``finish``'s, on its own transport); each hook call returns one
future, completed with the buffer or the error; on the gather paths every rank holds
bit-identical averaged gradients; a payload error fails every rank's backward with the
``PayloadError``'s text; the state (``state_dict``: this rank's residuals) is
checkpointable like the optimizer's, with the same rule for another rank's state (both in
``adapter_core``). The first optimizer step over the state's parameters warns when DDP
never called the hook (Lightning's ``DDPStrategy`` registers comm hooks on CUDA only).
"""

# No ``from __future__ import annotations``: DDP checks the hook's return annotation
# (torch.futures.Future[torch.Tensor]) as an object.
import copy
import time
import warnings
import weakref

import torch
import torch.distributed
from torch.optim.optimizer import register_optimizer_step_post_hook

if torch.distributed.is_available() and not torch.distributed.is_initialized():
    # Before the user's world exists (docs/checkpoints-and-faults.md, "Clean exits"): the
    # functions of torch.distributed.nn.functional take ``group=group.WORLD`` as a default
    # argument, evaluated at their first import, which DDP makes when its first model is
    # built. Imported after init_process_group, ten defaults keep the world's gloo group
    # and its threads alive past destroy_process_group, to be torn down at interpreter
    # shutdown, where the README's recipe aborted now and then.
    import torch.distributed.nn.functional  # noqa: F401

from hvdcompress import checks
from hvdcompress.adapter_core import (
    StepAccount,
    check_rank_state,
    load_rank_state,
    piece_shapes,
    rank_state,
)
from hvdcompress.buckets import Bucket
from hvdcompress.compat import resolve_compressor
from hvdcompress.compressors import Compressor, get_compressor
from hvdcompress.ddp_finish import FinishBucket
from hvdcompress.exchange import SummedExchange, check_exchange, choose_exchanges
from hvdcompress.exchange.tuning import DEFAULT_TUNING, ExchangeTuner, check_tuning, make_tuner
from hvdcompress.stats import StepStats
from hvdcompress.transports.base import drain_worker, start_worker
from hvdcompress.transports.cost import calibrate_link

__all__ = ["DDPHookState", "ddp_hook"]

NEVER_CALLED = (
    "hvdcompress: an optimizer step over the parameters of this DDPHookState ran, but DDP "
    "never called its hook: the gradients were averaged by DDP's own uncompressed "
    "allreduce. Register it with state.register(ddp_model) (or ddp_model.register_comm_hook"
    "(state, hvdcompress.ddp_hook)); Lightning's DDPStrategy(ddp_comm_hook=...) registers "
    "comm hooks on CUDA devices only: use hvdcompress.lightning.CompressedDDPStrategy"
)


class DDPHookState:
    """The state of ``ddp_hook`` (as ``PowerSGDState`` is of PowerSGD's hook).

    ``compression``: as in ``DistributedOptimizer`` (a name, a Compressor or a
    ``Compression`` entry). ``process_group``: torch.distributed's group (None: the
    world, or the DDP model's group at ``register``). ``named_parameters``: the model's,
    so that residuals are named as in the optimizer (``register`` takes them from the
    model); without either, parameters are named ``param.<k>`` in the order the hook
    first meets them (the same on every rank and in every run of the same model).
    ``compress_min_numel``: smaller tensors travel uncompressed. ``exchange`` and
    ``link_cost``: as the optimizer's (``choose_exchanges``; "measure" calibrates at
    ``bind``, and ``link_cost`` then holds the fitted ``LinkCost``); ``tuning``: as the
    optimizer's (``exchange="auto"`` times the options open to each part while training:
    ``exchange_tuner``). ``overlap``: finish
    buckets on the finisher thread (module doc; ``overlapping`` says whether it does,
    once bound). ``step_stats``: the ``StepStats`` of the buckets reduced since the last
    step ended; ``last_stats``: those of the last optimizer step (``end_step``).
    ``hook_calls``: buckets reduced so far.

    The state is unbound until ``bind`` (called by ``register`` and by the first bucket):
    then ``transport`` exists, and a ``load_state_dict`` made before waits for it.
    """

    def __init__(
        self,
        compression="3lc",
        process_group=None,
        named_parameters=None,
        compress_min_numel: int = 0,
        exchange: str = "auto",
        overlap: bool = True,
        link_cost=None,
        tuning=DEFAULT_TUNING,
    ) -> None:
        check_exchange(exchange, link_cost)
        check_tuning(tuning)
        compress_min_numel = checks.integer("compress_min_numel", compress_min_numel, 0)
        self.overlap = checks.boolean("overlap", overlap)
        self.compressor: Compressor = resolve_compressor(compression)
        self.uncompressed: Compressor = get_compressor("none")
        self.process_group = process_group
        self.compress_min_numel = compress_min_numel
        self.exchange = exchange
        self.link_cost = link_cost
        self.tuning = tuning
        self._tuner: ExchangeTuner | None = None  # made at bind
        self._options: dict[tuple, dict] = {}  # a tuned part's options, by its names
        self.overlapping = False  # set by bind: whether buckets finish on the finisher
        self._closed = False  # by close(): the hook refuses buckets
        self._finish_transport = None
        self._finisher = None  # the queue of the thread that finishes buckets (overlap)
        self._transport = None
        self._group = None  # the DDP model's group (a threaded transport has its own)
        self._exchanges: dict[tuple, object] = {}  # the compressed parts', by their names
        self._dense_exchange = None  # the uncompressed parts' allreduce
        self._pending_state: dict | None = None  # loaded before bind: applied by bind
        self._module = None  # weakref to the module of the DDP model ``register`` hooked
        self._names: dict[int, str] = {}
        self._positions: dict[int, int] = {}  # the model's order of its parameters
        self._shapes: dict[str, tuple] = {}  # of the named parameters, for load_state_dict
        self._named_given = False
        if named_parameters is not None:
            self._set_names(named_parameters)
        self.hook_calls = 0
        self._steps = 0  # optimizer steps that ended a step of this state
        self._account = StepAccount()
        self._step_calls = 0  # hook_calls when the last step ended
        # every optimizer's step passes through here; it ends this state's step when the
        # optimizer holds this state's parameters (weakly: the state may be collected)
        ref = weakref.ref(self)
        handle = register_optimizer_step_post_hook(
            lambda opt, args, kwargs: _after_optimizer_step(ref, opt)
        )
        weakref.finalize(self, handle.remove)

    def _set_names(self, named_parameters) -> None:
        self._names, self._shapes, self._positions = {}, {}, {}
        for name, p in named_parameters:
            self._positions[id(p)] = len(self._names)
            self._names[id(p)] = name
            self._shapes[name] = tuple(p.shape)
        self._named_given = True

    # -- binding -------------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self._transport is not None

    @property
    def transport(self):
        if self._transport is None:
            raise RuntimeError(
                "this DDPHookState is not bound to a process group yet: it binds at "
                "state.register(ddp_model), state.bind() or the first bucket DDP hands the hook"
            )
        return self._transport

    def _bound_transport(self):
        """The transport, binding first (``bind()``) where torch.distributed is up."""
        import torch.distributed as dist

        if self._transport is None and dist.is_initialized():
            self.bind()
        return self.transport

    def bind(self, process_group=None) -> "DDPHookState":
        """Take rank, size and group from ``process_group`` (default: the one given at
        construction, else the world), which must be initialised. Binding again to the
        same group does nothing; to another group it is an error. A state loaded before
        (``load_state_dict``) is checked and applied now."""
        import torch.distributed as dist

        from hvdcompress.transports.torch_dist import TorchDistTransport

        if not dist.is_initialized():
            raise RuntimeError(
                "DDPHookState.bind: torch.distributed is not initialised: call "
                "torch.distributed.init_process_group first (torchrun, Lightning and "
                "Accelerate do it before the model is wrapped)"
            )
        group = _world_if_none(process_group if process_group is not None else self.process_group)
        if self._transport is not None:
            if group is not self._group:
                raise RuntimeError(
                    "this DDPHookState is bound to another process group already: each "
                    "DDP model needs a DDPHookState of its own"
                )
            return self
        if self.process_group is not None and group is not _world_if_none(self.process_group):
            raise RuntimeError(
                "DDPHookState: the process group given at construction is not the DDP "
                "model's process group"
            )
        # Overlap (module doc): two threaded transports, one for the collectives the
        # hook starts, one for those the finisher starts, each with its own group; on
        # gloo over the world group (new_group is collective over the world; NCCL's
        # streams are not yet ordered for a second thread)
        overlapping = (
            self.overlap and group is dist.group.WORLD and dist.get_backend(group) == "gloo"
        )
        transport = TorchDistTransport(group, threaded=overlapping)
        finish = TorchDistTransport(group, threaded=True) if overlapping else transport
        self.compressor.bind(transport.rank, transport.size)
        self._transport, self._finish_transport, self._group = transport, finish, group
        self.overlapping = overlapping
        self._finisher = start_worker(self, "hvdcompress-ddp-finish") if overlapping else None
        self._dense_exchange = SummedExchange(transport, finish)
        self._tuner = make_tuner(self.tuning, self.exchange, transport)
        if self.link_cost == "measure" and self.exchange == "auto":
            self.link_cost = calibrate_link(transport)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        return self

    def close(self) -> None:
        """End the hook's threads and free its own process groups at a known point, not
        at interpreter shutdown (docs/checkpoints-and-faults.md, "Clean exits"). Every
        bucket already handed to the hook finishes first; then the ranks meet in a
        barrier on the DDP model's group, so that no rank frees a group another rank
        still sends on. Collective: every rank calls it, at the same point. The hook
        refuses buckets afterwards. Idempotent; nothing to do before ``bind``."""
        import torch.distributed as dist

        if self._transport is None or self._closed:
            return
        self._closed = True
        if self._finisher is not None:
            drain_worker(self._finisher)
            self._finisher = None
        dist.barrier(group=self._group)
        self._transport.close()
        self._finish_transport.close()

    def __enter__(self) -> "DDPHookState":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """``close()`` after the block; after an exception nothing: another rank may be
        gone, and the exception, not a barrier that waits for it, is what ends the job."""
        if kind is None:
            self.close()

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> "DDPHookState":
        """Bind to ``ddp_model``'s process group, name the parameters as its module does,
        and register ``ddp_hook`` on it. A state serves one model: registering it on a DDP
        wrapper of another module is an error (a new wrapper of the same module, as a
        second ``Trainer.fit`` makes, is not)."""
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"DDPHookState.register needs a DistributedDataParallel model, got "
                f"{type(ddp_model).__name__}"
            )
        module = ddp_model.module
        if self._module is not None and self._module() is not module:
            raise RuntimeError(
                "this DDPHookState is registered on another model already: its residuals "
                "belong to that model's parameters; create one DDPHookState per model"
            )
        if self._module is None:  # names first: a state loaded before binding checks them
            self._set_names(module.named_parameters())
            self._module = weakref.ref(module)
        self.bind(ddp_model.process_group)
        ddp_model.register_comm_hook(self, ddp_hook)
        return self

    def exchange_of(self, part: Bucket) -> tuple[Bucket, object]:
        """A part of a DDP bucket as it travels, with its exchange: an uncompressed part
        on the dense allreduce; the compressed part on ``choose_exchanges``'s choice for
        ``exchange=`` (made once per set of tensors: DDP rebuilds its buckets after the
        first step), or, where that choice sends it dense, as an uncompressed part."""
        if part.compressed:
            key = tuple(part.names)
            if key not in self._exchanges:
                plan = choose_exchanges(
                    self.compressor, self._transport, [part], self.exchange,
                    finish_transport=self._finish_transport, per_tensor=True,
                    link_cost=self.link_cost,
                )  # fmt: skip
                self._exchanges[key] = None if part.index in plan.dense else plan[part.index]
                if self._tuner is not None and part.index in plan.options:
                    self._options[key] = plan.options[part.index]
                    label = f"{part.names[0]}..{part.names[-1]} ({len(part.names)} tensors)"
                    self._tuner.add(key, plan.options[part.index], plan.label(part.index), label)
            exchange = self._exchanges[key]
            if key in self._options:
                option = self._tuner.option(key)
                exchange = None if option == "dense" else self._options[key][option]
            if exchange is not None:
                self._account.current.exchanges[part.index] = exchange.kind
                return part, exchange
            self._account.current.exchanges[part.index] = "dense"
            part = Bucket(part.index, part.params, part.names, compressed=False)
        return part, self._dense_exchange

    @property
    def exchange_tuner(self) -> ExchangeTuner | None:
        """The tuner of ``exchange="auto"`` (its ``decisions``, ``current``), or None
        (unbound, or another ``exchange``, or ``tuning=None``)."""
        return self._tuner

    @property
    def step_stats(self) -> StepStats:
        """The ``StepStats`` of the buckets reduced since the last step ended."""
        return self._account.current

    @property
    def last_stats(self) -> StepStats:
        """The ``StepStats`` of the last optimizer step (``end_step``)."""
        return self._account.last

    # -- steps ---------------------------------------------------------------------------

    def end_step(self) -> None:
        """The buckets reduced so far make one step's ``last_stats`` (called after every
        optimizer step over this state's parameters; calling it again without new
        buckets keeps ``last_stats``)."""
        if self.hook_calls == self._step_calls:
            return
        self._step_calls = self.hook_calls
        if self._tuner is not None:
            self._account.current.tuning = self._tuner.tuning_now
            self._tuner.end_step()
        self._account.end(self.compressor)

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self._names:  # nothing known of the model yet: any optimizer counts
            return True
        return any(id(p) in self._names for g in optimizer.param_groups for p in g["params"])

    def name_of(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            if self._named_given:
                raise ValueError(
                    f"the DDP bucket has a parameter of shape {tuple(p.shape)} that is not "
                    "among the model's named parameters this DDPHookState knows: is one "
                    "state used by two models? Create one DDPHookState per model"
                )
            if self._steps:
                raise ValueError(
                    f"the DDP bucket has a parameter of shape {tuple(p.shape)} that no bucket "
                    "of the first step had: is one DDPHookState used by two models? "
                    "Create one per model"
                )
            self._positions[id(p)] = len(self._names)
            name = self._names[id(p)] = f"param.{len(self._names)}"
            self._shapes[name] = tuple(p.shape)
        return name

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's compressor state (residuals), tagged with the rank and job size."""
        if self._transport is None and self._pending_state is not None:
            return copy.deepcopy(self._pending_state)  # loaded, not yet bound: as loaded
        return rank_state(self._bound_transport(), self.compressor)

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()``; another rank's (same job size) loads without its
        residuals, with a warning, as ``DistributedOptimizer.load_state_dict`` does.
        An unbound state binds first (``bind()``: its group, else the world); before
        torch.distributed is initialised, the state waits and is checked and loaded when
        the state binds."""
        import torch.distributed as dist

        if self._transport is None and not dist.is_initialized():
            self._pending_state = copy.deepcopy(dict(state))
            return
        # self._shapes: with named_parameters, every name the model has
        state = check_rank_state(
            dict(state), self._bound_transport(), self.compressor,
            lambda mine: piece_shapes(mine, self._shapes, guess=not self._named_given),
        )  # fmt: skip
        load_rank_state(copy.deepcopy(state), self.compressor)


def _world_if_none(group):
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group


def _after_optimizer_step(ref, optimizer: torch.optim.Optimizer) -> None:
    """torch's post-step hook of every optimizer (registered by each ``DDPHookState``):
    an optimizer step over the state's parameters ends its step, and the first one warns
    when DDP never called the hook (module doc)."""
    state = ref()
    if state is None or not state._owns(optimizer):
        return
    if state._steps == 0 and state.hook_calls == 0:
        warnings.warn(NEVER_CALLED, UserWarning, stacklevel=4)
    state._steps += 1
    state.end_step()


def ddp_hook(state: DDPHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``model.register_comm_hook(state, ddp_hook)``): the
    bucket's gradients compressed with ``state.compressor`` and their collectives started
    here; the returned future completes when the average is written back into the
    bucket's buffer, on the finisher thread when the state overlaps (module doc)."""
    if state._closed:
        raise RuntimeError("this DDPHookState is closed (close() or its with-block ended)")
    if not state.bound:
        state.bind()
    if state._tuner is not None and state.hook_calls == state._step_calls:
        state._tuner.begin_step(state.transport.sum_floats)  # the step's first bucket
    state.hook_calls += 1
    buffer = bucket.buffer()
    params = bucket.parameters()
    grads, offset = [], 0
    for p in params:
        grads.append(buffer[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    if offset != buffer.numel():
        raise RuntimeError(
            f"DDP bucket {bucket.index()}: its buffer has {buffer.numel()} elements, its "
            f"parameters {offset}"
        )
    if state.compressor.name == "none" or all(p.numel() < state.compress_min_numel for p in params):
        return _allreduce_like_ddp(state, buffer)
    parts = []
    for compressed in (True, False):
        chosen = [
            i for i, p in enumerate(params) if (p.numel() >= state.compress_min_numel) == compressed
        ]
        if not chosen:
            continue
        names = {i: state.name_of(params[i]) for i in chosen}
        # in the model's order, not DDP's: DDP rebuilds its first buckets in gradient
        # order, and the same tensors must make the same exchange (two-stage shards)
        chosen.sort(key=lambda i: state._positions[id(params[i])])
        part = Bucket(
            bucket.index(),
            [params[i] for i in chosen],
            [names[i] for i in chosen],
            compressed=compressed,
        )
        parts.append((*state.exchange_of(part), chosen))
    if not any(part.compressed for part, _, _ in parts):  # "auto" sent it all dense
        return _allreduce_like_ddp(state, buffer)
    started = []
    for part, exchange, chosen in parts:
        comp = state.compressor if part.compressed else state.uncompressed
        # the exchange averages the views of DDP's buffer in place (exchange.py)
        t0 = time.perf_counter()
        flight = exchange.start(part, comp, [grads[i] for i in chosen])
        started.append((part, comp, exchange, flight, time.perf_counter() - t0))
    future = torch.futures.Future()
    job = FinishBucket(state._account, state.transport.size, started, buffer, future)
    if state._finisher is None:
        job()
    else:
        state._finisher.put(job)
    # An error travels as the value and is raised in ``then``: torch marks that future
    # failed with the error's text, which DDP raises from backward on every rank
    return future.then(_raise_error)


def _raise_error(future) -> torch.Tensor:
    value = future.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _allreduce_like_ddp(state: DDPHookState, buffer: torch.Tensor):
    """A bucket with nothing to compress (compression none, every tensor below
    ``compress_min_numel``, or all sent dense by "auto") goes as DDP's own allreduce
    does: divided by the world size, summed in place by one asynchronous allreduce on
    DDP's group, so it costs what DDP costs and gives DDP's bits."""
    import torch.distributed as dist

    size = state.transport.size
    state._account.allreduced(buffer, size)
    buffer.div_(size)
    work = dist.all_reduce(buffer, group=state._group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
