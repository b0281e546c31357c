"""``DDPHookState``: the DDP hook's configuration, its binding to DDP's process group
(and the overlap's threads), its parameters' names, and its checkpoint; the hook's
buckets go through its ``Reducer`` (package doc)."""

import copy
import warnings
import weakref

import torch
import torch.distributed
from torch.optim.optimizer import register_optimizer_step_post_hook

from hvdcompress import checks
from hvdcompress.buckets import Bucket, PieceKey
from hvdcompress.compression import resolve_compressor
from hvdcompress.compressors import Compressor
from hvdcompress.ddp.hook import ddp_hook
from hvdcompress.exchange import check_exchange
from hvdcompress.exchange.tuning import DEFAULT_TUNING, ExchangeTuner, check_tuning
from hvdcompress.reducer import Reducer, check_start_up
from hvdcompress.stats import StepStats
from hvdcompress.transports.base import drain_worker, start_worker

__all__ = ["NEVER_CALLED", "DDPHookState"]

NEVER_CALLED = (
    "hvdcompress: an optimizer step over the parameters of this DDPHookState ran, but DDP "
    "never called its hook: the gradients were averaged by DDP's own uncompressed "
    "allreduce. Register it with state.register(ddp_model) (or ddp_model.register_comm_hook"
    "(state, hvdcompress.ddp_hook)); Lightning's DDPStrategy(ddp_comm_hook=...) registers "
    "comm hooks on CUDA devices only: use hvdcompress.lightning.CompressedDDPStrategy"
)


class _ParamNames:
    """The names, shapes and model order of the parameters a hook state has met: the
    model's (``named``), or ``param.<k>`` in the order the hook first meets them (the same
    on every rank and in every run of the same model)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.positions: dict[int, int] = {}  # the model's order of its parameters
        self.shapes: dict[str, tuple] = {}
        self.given = False  # named by the model, not as met

    def set(self, named_parameters) -> None:
        self.names, self.shapes, self.positions = {}, {}, {}
        for name, p in named_parameters:
            self.positions[id(p)] = len(self.names)
            self.names[id(p)] = name
            self.shapes[name] = tuple(p.shape)
        self.given = True

    def of(self, p: torch.Tensor, stepped: bool) -> str:
        """``p``'s name; a parameter met for the first time is named now, unless the
        model's names are known or a step has ended (``stepped``): then it belongs to
        another model, and that is an error."""
        name = self.names.get(id(p))
        if name is not None:
            return name
        if self.given:
            raise ValueError(
                f"the DDP bucket has a parameter of shape {tuple(p.shape)} that is not "
                "among the model's named parameters this DDPHookState knows: is one "
                "state used by two models? Create one DDPHookState per model"
            )
        if stepped:
            raise ValueError(
                f"the DDP bucket has a parameter of shape {tuple(p.shape)} that no bucket "
                "of the first step had: is one DDPHookState used by two models? "
                "Create one per model"
            )
        self.positions[id(p)] = len(self.names)
        name = self.names[id(p)] = f"param.{len(self.names)}"
        self.shapes[name] = tuple(p.shape)
        return name

    def owned_by(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.names:  # nothing known of the model yet: any optimizer counts
            return True
        return any(id(p) in self.names for g in optimizer.param_groups for p in g["params"])

    def for_checkpoint(self, state) -> dict[str, tuple]:
        """The tensors a checkpoint may name: the model's; with no names met yet (before
        the first bucket), those of the residuals ``state`` holds, which the compressor
        checks when it first uses them."""
        shapes = dict(self.shapes)
        if self.given:
            return shapes
        comp = state.get("compressor_state") if isinstance(state, dict) else None
        entries = [comp.get(k) for k in ("residuals", "velocity")] if isinstance(comp, dict) else []
        for entry in (e for e in entries if isinstance(e, dict)):
            for name, t in entry.items():
                if isinstance(t, torch.Tensor) and not PieceKey.parse(name):
                    shapes.setdefault(name, (int(t.numel()),))
        return shapes


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
    ``exchange_tuner``). ``overlap``: finish buckets on the finisher thread (module doc;
    ``overlapping`` says whether it does, once bound). ``step_stats``: the ``StepStats``
    of the buckets reduced since the last step ended; ``last_stats``: those of the last
    optimizer step (``end_step``). ``hook_calls``: buckets reduced so far.

    The state is unbound until ``bind`` (called by ``register`` and by the first bucket):
    then ``transport`` and ``reducer`` exist, and a ``load_state_dict`` made before waits
    for them.
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
        check_tuning(tuning, exchange)
        self.compress_min_numel = checks.integer("compress_min_numel", compress_min_numel, 0)
        self.overlap = checks.boolean("overlap", overlap)
        self.compressor: Compressor = resolve_compressor(compression)
        if self.compressor.needs_wrapped_optimizer:
            raise ValueError(
                f"{self.compressor!r} needs the optimizer it runs under to be one its "
                "check_optimizer accepts, which the DDP hook never sees: use "
                "hvdcompress.DistributedOptimizer"
            )
        self.process_group = process_group
        self.exchange = exchange
        self.link_cost = link_cost
        self.tuning = tuning
        self.overlapping = False  # set by bind: whether buckets finish on the finisher
        self._reducer: Reducer | None = None  # made at bind
        self._closed = False  # by close(): the hook refuses buckets
        self._finish_transport = None
        self._finisher = None  # the queue of the thread that finishes buckets (overlap)
        self._group = None  # the DDP model's group (a threaded transport has its own)
        self._pending_state: dict | None = None  # loaded before bind: applied by bind
        self._module = None  # weakref to the module of the DDP model ``register`` hooked
        self.params = _ParamNames()
        if named_parameters is not None:
            self.params.set(named_parameters)
        self.hook_calls = 0
        self._steps = 0  # optimizer steps that ended a step of this state
        self._step_calls = 0  # hook_calls when the last step ended
        # every optimizer's step passes through here; it ends this state's step when the
        # optimizer holds this state's parameters (weakly: the state may be collected)
        ref = weakref.ref(self)
        handle = register_optimizer_step_post_hook(
            lambda opt, args, kwargs: _after_optimizer_step(ref, opt)
        )
        weakref.finalize(self, handle.remove)

    # -- binding -------------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self._reducer is not None

    @property
    def reducer(self) -> Reducer:
        """The ``Reducer`` that routes, starts, finishes and accounts the hook's buckets."""
        if self._reducer is None:
            raise RuntimeError(
                "this DDPHookState is not bound to a process group yet: it binds at "
                "state.register(ddp_model), state.bind() or the first bucket DDP hands the hook"
            )
        return self._reducer

    @property
    def transport(self):
        return self.reducer.transport

    @property
    def group(self):
        """The DDP model's process group (bound: the hook's dense allreduce runs on it)."""
        self.reducer  # noqa: B018 - unbound: the reducer's error says how to bind
        return self._group

    def _bound_reducer(self) -> Reducer:
        """The reducer, binding first (``bind()``) where torch.distributed is up."""
        import torch.distributed as dist

        if self._reducer is None and dist.is_initialized():
            self.bind()
        return self.reducer

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
        if self._reducer is not None:
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
        inline = TorchDistTransport(group)
        self._check_start_up(inline, overlapping)
        transport = TorchDistTransport(group, threaded=True) if overlapping else inline
        finish = TorchDistTransport(group, threaded=True) if overlapping else transport
        self._finish_transport, self._group = finish, group
        self._reducer = Reducer(
            self.compressor, transport, exchange=self.exchange, link_cost=self.link_cost,
            tuning=self.tuning, finish_transport=finish, per_tensor=True, label=_part_label,
        )  # fmt: skip
        self.link_cost = self._reducer.link_cost  # "measure": the fitted LinkCost
        self.overlapping = overlapping
        self._finisher = start_worker(self, "hvdcompress-ddp-finish") if overlapping else None
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        return self

    def _check_start_up(self, inline, overlapping: bool) -> None:
        """Every rank binds alike (``reducer.check_start_up``, on the DDP model's group, before
        the threaded transports' groups are made): the compressor, exchange, tuning, the
        overlap and the model's tensors where they are known."""
        lines = [
            f"compress_min_numel {self.compress_min_numel}; overlap {self.overlap} "
            f"({'on' if overlapping else 'off'}); transport {inline.name}",
            *(f"tensor {name} {shape}" for name, shape in self.params.shapes.items()),
        ]
        check_start_up(
            inline, self.compressor, exchange=self.exchange, tuning=self.tuning,
            link_cost=self.link_cost, lines=lines,
        )  # fmt: skip

    def close(self) -> None:
        """End the hook's threads and free its own process groups at a known point, not
        at interpreter shutdown (docs/checkpoints-and-faults.md, "Clean exits"). Every
        bucket already handed to the hook finishes first; then the ranks meet in a
        barrier on the DDP model's group, so that no rank frees a group another rank
        still sends on. Collective: every rank calls it, at the same point. The hook
        refuses buckets afterwards. Idempotent; nothing to do before ``bind``."""
        import torch.distributed as dist

        if self._reducer is None or self._closed:
            return
        self._closed = True
        if self._finisher is not None:
            drain_worker(self._finisher)
            self._finisher = None
        dist.barrier(group=self._group)
        self._reducer.transport.close()
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
            self.params.set(module.named_parameters())
            self._module = weakref.ref(module)
        self.bind(ddp_model.process_group)
        ddp_model.register_comm_hook(self, ddp_hook)
        return self

    @property
    def exchange_tuner(self) -> ExchangeTuner | None:
        """The tuner of ``exchange="auto"`` (its ``decisions``, ``current``), or None
        (unbound, or another ``exchange``, or ``tuning=None``)."""
        return None if self._reducer is None else self._reducer.tuner

    # -- steps ---------------------------------------------------------------------------

    @property
    def step_stats(self) -> StepStats:
        """The ``StepStats`` of the buckets reduced since the last step ended."""
        return StepStats() if self._reducer is None else self._reducer.account.current

    @property
    def last_stats(self) -> StepStats:
        """The ``StepStats`` of the last optimizer step (``end_step``)."""
        return StepStats() if self._reducer is None else self._reducer.account.last

    def begin_bucket(self) -> Reducer:
        """The reducer of a bucket DDP hands the hook: bound now if need be, its step
        begun at the step's first bucket."""
        if self._closed:
            raise RuntimeError("this DDPHookState is closed (close() or its with-block ended)")
        reducer = self._bound_reducer()
        if self.hook_calls == self._step_calls:
            reducer.begin_step()  # the step's first bucket
        self.hook_calls += 1
        return reducer

    def end_step(self) -> None:
        """The buckets reduced so far make one step's ``last_stats`` (called after every
        optimizer step over this state's parameters; calling it again without new
        buckets keeps ``last_stats``)."""
        if self.hook_calls == self._step_calls:
            return
        self._step_calls = self.hook_calls
        self.reducer.end_step()

    def name_of(self, p: torch.Tensor) -> str:
        return self.params.of(p, stepped=self._steps > 0)

    def finish_later(self, job) -> None:
        """Run ``job`` (a bucket's finishing) on the finisher thread, else now."""
        if self._finisher is None:
            job()
        else:
            self._finisher.put(job)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's compressor state (residuals), tagged with the rank and job size."""
        if self._reducer is None and self._pending_state is not None:
            return copy.deepcopy(self._pending_state)  # loaded, not yet bound: as loaded
        return self._bound_reducer().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()``; another rank's (same job size) loads without its
        residuals, with a warning, as ``DistributedOptimizer.load_state_dict`` does.
        An unbound state binds first (``bind()``: its group, else the world); before
        torch.distributed is initialised, the state waits and is checked and loaded when
        the state binds."""
        import torch.distributed as dist

        if self._reducer is None and not dist.is_initialized():
            self._pending_state = copy.deepcopy(dict(state))
            return
        reducer = self._bound_reducer()
        reducer.load_state_dict(dict(state), self.params.for_checkpoint(state))


def _world_if_none(group):
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group


def _part_label(part: Bucket) -> str:
    """A part of a DDP bucket in the tuner's decisions: its first and last tensors."""
    return f"{part.names[0]}..{part.names[-1]} ({len(part.names)} tensors)"


def _after_optimizer_step(ref, optimizer: torch.optim.Optimizer) -> None:
    """torch's post-step hook of every optimizer (registered by each ``DDPHookState``):
    an optimizer step over the state's parameters ends its step, and the first one warns
    when DDP never called the hook (module doc)."""
    state = ref()
    if state is None or not state.params.owned_by(optimizer):
        return
    if state._steps == 0 and state.hook_calls == 0:
        warnings.warn(NEVER_CALLED, UserWarning, stacklevel=4)
    state._steps += 1
    state.end_step()
