"""A DDP communication hook: hvdcompress's compressors for ``torch.nn.parallel.
DistributedDataParallel`` users without Horovod (docs/horovod-parity.md,
"Horovod parity and the DDP hook").

    state = hvdcompress.DDPHookState("3lc", named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, hvdcompress.ddp_hook)

DDP calls the hook with each gradient bucket (a flat buffer holding its gradients, in
``bucket.parameters()`` order). The hook moves the same payloads as
``hvdcompress.DistributedOptimizer``, through ``torch.distributed`` (gloo on CPU, NCCL on
GPUs; ``transports.torch_dist``): gather-only compressors (3LC, top-k, ...) by an
allgather that every rank decodes in rank order, summable ones (none, fp16, bf16,
PowerSGD) by allreduce; tensors below ``compress_min_numel`` by an uncompressed
allreduce. The exchange averages the buffer in place (views of it, no copy) and the hook
returns the exchange's futures, chained to the buffer (today they complete inside the
hook, so buckets do not overlap one another's communication). Invariants: on the gather
path every rank holds bit-identical averaged gradients; the state (``state_dict``: this
rank's residuals) is checkpointable like the optimizer's, with the same rule for another
rank's state.
"""

# No ``from __future__ import annotations``: DDP checks the hook's return annotation
# (torch.futures.Future[torch.Tensor]) as an object.
import copy

import torch

from hvdcompress.buckets import Bucket
from hvdcompress.compat import resolve_compressor
from hvdcompress.compressors import Compressor, get_compressor
from hvdcompress.exchange import GatheredExchange, SummedExchange
from hvdcompress.stats import StepStats

__all__ = ["DDPHookState", "ddp_hook", "hooked_optimizer"]


class DDPHookState:
    """The state of ``ddp_hook`` (as ``PowerSGDState`` is of PowerSGD's hook).

    ``compression``: as in ``DistributedOptimizer`` (a name, a Compressor or a
    ``Compression`` entry). ``process_group``: torch.distributed's group (None: the
    world; it must be initialised first). ``named_parameters``: the model's, so that
    residuals are named as in the optimizer; without it, parameters are named
    ``param.<k>`` in the order the hook first meets them (the same on every rank and in
    every run of the same model). ``compress_min_numel``: smaller tensors travel
    uncompressed. ``step_stats``: the ``StepStats`` of the buckets reduced since the last
    ``end_step()``, which moves them to ``last_stats``.
    """

    def __init__(
        self,
        compression="3lc",
        process_group=None,
        named_parameters=None,
        compress_min_numel: int = 0,
    ) -> None:
        from hvdcompress.transports.torch_dist import TorchDistTransport

        if isinstance(compress_min_numel, bool) or not isinstance(compress_min_numel, int):
            raise ValueError(f"compress_min_numel must be an int >= 0, got {compress_min_numel!r}")
        if compress_min_numel < 0:
            raise ValueError(f"compress_min_numel must be an int >= 0, got {compress_min_numel!r}")
        self.compressor: Compressor = resolve_compressor(compression)
        self.uncompressed: Compressor = get_compressor("none")
        self.transport = TorchDistTransport(process_group)
        self.compressor.bind(self.transport.rank, self.transport.size)
        self.compress_min_numel = compress_min_numel
        self._names: dict[int, str] = {}
        self._shapes: dict[str, tuple] = {}  # of the named parameters, for load_state_dict
        if named_parameters is not None:
            for name, p in named_parameters:
                self._names[id(p)] = name
                self._shapes[name] = tuple(p.shape)
        self._named_given = named_parameters is not None
        self._exchanges = {
            True: _exchange(self.compressor, self.transport),
            False: SummedExchange(self.transport),
        }
        self.step_stats = StepStats()
        self.last_stats = StepStats()

    def end_step(self) -> None:
        """The buckets reduced so far make one step's ``last_stats``."""
        self.step_stats.metrics = self.compressor.pop_metrics()
        self.last_stats, self.step_stats = self.step_stats, StepStats()

    def name_of(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is None:
            if self._named_given:
                raise ValueError(
                    f"the DDP bucket has a parameter of shape {tuple(p.shape)} that is not in "
                    "the named_parameters given to DDPHookState"
                )
            name = self._names[id(p)] = f"param.{len(self._names)}"
            self._shapes[name] = tuple(p.shape)
        return name

    def state_dict(self) -> dict:
        """This rank's compressor state (residuals), tagged with the rank and job size."""
        return {
            "rank": self.transport.rank,
            "size": self.transport.size,
            "compressor": repr(self.compressor),
            "compressor_state": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()``; another rank's (same job size) loads without its
        residuals, with a warning, as ``DistributedOptimizer.load_state_dict`` does."""
        from hvdcompress.checkpoint import check_optimizer_state, without_other_ranks_state

        rank, size = self.transport.rank, self.transport.size
        state = without_other_ranks_state(dict(state), rank, size)
        shapes = dict(self._shapes)  # with named_parameters: every name the model has
        if not self._named_given:  # names not met yet (before the first bucket): their
            # sizes are checked when the compressor first uses them
            for name, t in _residual_tensors(state).items():
                shapes.setdefault(name, (int(t.numel()),))
        check_optimizer_state(
            state, rank=rank, size=size, compressor=repr(self.compressor), shapes=shapes
        )
        self.compressor.load_state_dict(copy.deepcopy(state["compressor_state"]))


def _residual_tensors(state: dict) -> dict:
    comp = state.get("compressor_state")
    out = {}
    if isinstance(comp, dict):
        for key in ("residuals", "velocity"):
            if isinstance(comp.get(key), dict):
                out.update({n: t for n, t in comp[key].items() if isinstance(t, torch.Tensor)})
    return out


def _exchange(compressor: Compressor, transport):
    return (SummedExchange if compressor.summable else GatheredExchange)(transport)


def ddp_hook(state: DDPHookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``model.register_comm_hook(state, ddp_hook)``): the
    bucket's gradients compressed with ``state.compressor``, exchanged, averaged, and
    written back into the bucket's buffer (module doc)."""
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
    stats = state.step_stats
    scale = 1.0 / state.transport.size
    futures = []
    for compressed in (True, False):
        chosen = [
            i for i, p in enumerate(params) if (p.numel() >= state.compress_min_numel) == compressed
        ]
        if not chosen:
            continue
        part = Bucket(
            bucket.index(),
            [params[i] for i in chosen],
            [state.name_of(params[i]) for i in chosen],
            compressed=compressed,
        )
        comp = state.compressor if compressed else state.uncompressed
        exchange = state._exchanges[compressed]
        # the exchange averages the views of DDP's buffer in place (exchange.py)
        flight = exchange.start(part, comp, [grads[i] for i in chosen])
        exchange.finish(part, comp, flight, scale, decode=True)
        stats.numel += sum(params[i].numel() for i in chosen)
        stats.raw_bytes += sum(grads[i].numel() * grads[i].element_size() for i in chosen)
        stats.add(flight)
        futures.append(flight.future)
    return torch.futures.collect_all(futures).then(lambda _: buffer)


class _HookedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the wrapped optimizer's class (``hooked_optimizer``)."""

    def __init__(self, params, state: DDPHookState) -> None:
        super(self.__class__, self).__init__(params)
        self._hook_state = state

    def step(self, closure=None):
        loss = super(self.__class__, self).step(closure)
        self._hook_state.end_step()
        return loss

    @property
    def last_stats(self) -> StepStats:
        return self._hook_state.last_stats

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["hvdcompress"] = self._hook_state.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop("hvdcompress", None)
        if ours is not None:
            self._hook_state.load_state_dict(ours)
        return super(self.__class__, self).load_state_dict(state_dict)


def hooked_optimizer(optimizer: torch.optim.Optimizer, state: DDPHookState):
    """``optimizer`` (of a DDP model whose comm hook has ``state``) as a training loop
    written for ``DistributedOptimizer`` uses it: ``last_stats`` per step, and
    ``state_dict()`` carrying the hook's state under ``"hvdcompress"`` (per rank, loaded
    by ``load_state_dict`` with ``DDPHookState.load_state_dict``'s rule). Same class
    pattern as ``DistributedOptimizer``: an instance of a subclass of its class."""
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_HookedOptimizer.__dict__),
    )
    return cls(optimizer.param_groups, state)
