"""``ddp_hook``: DDP's communication hook over a ``DDPHookState``'s reducer, in the
manner of torch's ``default_hooks.allreduce_hook``: split the bucket into the part to
compress and the part to send as is, route and start them, and return one future that
the reducer's ``finish`` completes (package doc)."""

# No ``from __future__ import annotations``: DDP checks the hook's return annotation
# (torch.futures.Future[torch.Tensor]) as an object.
import torch

from hvdcompress.buckets import Bucket
from hvdcompress.errors import PayloadError, remember
from hvdcompress.exchange.tuning import HALF
from hvdcompress.reducer import Reducer, Started

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

__all__ = ["ddp_hook"]


def ddp_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``model.register_comm_hook(state, ddp_hook)``): the
    bucket's parts routed and started by the state's reducer here; the returned future
    completes when the average is written back into the bucket's buffer, on the finisher
    thread when the state overlaps (module doc)."""
    reducer = state.begin_bucket()
    buffer = bucket.buffer()
    routes = _routes(state, reducer, bucket)
    if not isinstance(routes, list):  # nothing compressed: as DDP's (or its bf16) allreduce
        return _allreduce_like_ddp(state, buffer, routes)
    started = [reducer.start(route, grads) for route, grads in routes]
    future = torch.futures.Future()
    state.finish_later(lambda: _finish_bucket(reducer, started, buffer, future))
    # An error travels as the value and is raised in ``then``: torch marks that future
    # failed with the error's text, which DDP raises from backward on every rank
    return future.then(_raise_error)


def _routes(state, reducer: Reducer, bucket):
    """The routes of a DDP bucket's parts (the tensors to compress, then those below
    ``compress_min_numel``), each with its views of the buffer; where nothing is sent
    compressed, the dtype the whole buffer is allreduced in instead: torch.float32
    (compression none, every tensor small, or all sent dense by "auto"), or the 16-bit
    dtype where "auto" sends every part on its 16-bit option."""
    buffer, params = bucket.buffer(), bucket.parameters()
    grads, offset = [], 0
    for p in params:
        grads.append(buffer[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    if offset != buffer.numel():
        raise RuntimeError(
            f"DDP bucket {bucket.index()}: its buffer has {buffer.numel()} elements, its "
            f"parameters {offset}"
        )
    small = state.compress_min_numel
    if state.compressor.name == "none" or all(p.numel() < small for p in params):
        return torch.float32
    routes = []
    for compressed in (True, False):
        chosen = [i for i, p in enumerate(params) if (p.numel() >= small) == compressed]
        if not chosen:
            continue
        names = {i: state.name_of(params[i]) for i in chosen}
        # in the model's order, not DDP's: DDP rebuilds its first buckets in gradient
        # order, and the same tensors must make the same exchange (two-stage shards)
        chosen.sort(key=lambda i: state.params.positions[id(params[i])])
        part = Bucket(
            bucket.index(),
            [params[i] for i in chosen],
            [names[i] for i in chosen],
            compressed=compressed,
        )
        # the exchange averages the views of DDP's buffer in place (exchange.py)
        routes.append((reducer.route(part), [grads[i] for i in chosen]))
    labels = {route.label for route, _ in routes}
    half = len(labels) == 1 and labels <= set(HALF)
    if half or all(route.compressor is reducer.uncompressed for route, _ in routes):
        for route, views in routes:  # as DDP's allreduce, with what residuals it strands
            reducer.enter(route, views)
        return HALF_DTYPES[routes[0][0].label] if half else torch.float32
    return routes


def _finish_bucket(reducer: Reducer, started: list[Started], buffer, future) -> None:
    """Finish a DDP bucket's started parts in order, then complete the hook's future
    with the buffer, or the first error (the other parts are still waited for, so that
    every collective they started ends on every rank)."""
    try:
        error = None
        for part in started:
            error = reducer.finish(part, 1.0 / reducer.transport.size, error)
        if isinstance(error, PayloadError):
            error = _named(error, started)
        result = buffer if error is None else error
    except BaseException as err:  # noqa: BLE001 - never leave DDP waiting
        result = err
    if not future.done():
        future.set_result(result)


def _named(error: PayloadError, started: list[Started]) -> PayloadError:
    """``error`` naming the DDP bucket's tensors, remembered for
    ``hvdcompress.payload_error`` (DDP keeps only its text)."""
    names = [n for part in started for n in part.route.bucket.names]
    error = PayloadError(
        error.field,
        f"{error.detail} (DDP bucket of {len(names)} tensors: {', '.join(names[:4])}"
        f"{', ...' if len(names) > 4 else ''})",
        rank=error.rank,
        tensor=error.tensor,
    )
    return remember(error)


def _raise_error(future) -> torch.Tensor:
    value = future.value()
    if isinstance(value, BaseException):
        raise value
    return value


def _allreduce_like_ddp(state, buffer: torch.Tensor, dtype: torch.dtype):
    """A bucket with nothing to compress (compression none, every tensor below
    ``compress_min_numel``, or all sent dense by "auto") goes as DDP's own allreduce
    does: divided by the world size, summed in place by one asynchronous allreduce on
    DDP's group, so it costs what DDP costs and gives DDP's bits. On "auto"'s 16-bit
    option, as torch's ``bf16_compress_hook`` (``fp16_compress_hook``) does: the buffer
    cast, divided, summed in 16 bits, and copied back."""
    import torch.distributed as dist

    size = state.transport.size
    wire = buffer if dtype == buffer.dtype else buffer.to(dtype)
    state.reducer.account.allreduced(buffer, size, sent=wire)
    wire.div_(size)
    work = dist.all_reduce(wire, group=state.group, async_op=True)
    if wire is buffer:
        return work.get_future().then(lambda fut: fut.value()[0])

    def copy_back(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(copy_back)
