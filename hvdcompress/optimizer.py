"""DistributedOptimizer: hvd.DistributedOptimizer with compressed gradients (SPEC sections 1, 7).

``DistributedOptimizer(optimizer, named_parameters, compression=..., backend=...)`` returns
an instance of a subclass of ``optimizer``'s class (as Horovod does), so it is a drop-in:
``loss.backward(); opt.step()``.

Flow per step: a post-accumulate-grad hook on every parameter counts backward passes;
when every gradient of a bucket is ready, the bucket is compressed and its collective
started, so communication overlaps the rest of backward. ``synchronize()`` (called by
``step()``) starts what is left, waits, decodes and writes the averaged gradients into
``p.grad``.

* Buckets are fixed at construction from parameter order (reversed, as gradients become
  ready back to front), split when the uncompressed bytes reach ``fusion_threshold``
  (Horovod's fusion buffer, default 64 MiB, ``HOROVOD_FUSION_THRESHOLD`` honoured) or the
  dtype/device changes. Buckets are started strictly in bucket order on every rank, so
  collectives match across ranks without a coordinator.
* Summable compressors (none, fp16, bf16): the bucket's dense payloads are concatenated and
  summed by one allreduce. A compressor with ``phases`` > 1 (PowerSGD: P, then Q) makes the
  next phase's payloads from the summed ones (``next_phase``), one more allreduce each.
* Gather-only compressors (3LC): each rank sends one frame per bucket, ``n`` (uint64),
  ``n`` payload lengths (uint64) then the ``n`` self-describing payloads; one allgatherv
  moves every rank's frame. Every rank decodes all frames in rank order, adding into a
  float32 accumulator, then divides by the world size (``op=Average``). A compressor with
  ``uses_side_info`` (NDQSG) also gets ``side_info``: the mean of the lower ranks' decoded
  tensors. A compressor's ``check_optimizer(optimizer)`` runs at construction (DGC refuses
  an inner momentum) and its ``pop_metrics()`` after each step (``last_stats.metrics``).

Invariants: after ``synchronize()`` every rank holds bit-identical gradients on the gather
path (same bytes decoded in the same order); ranks that disagree on the set, order,
shape, dtype or compressor of gradients get ``RankAgreementError`` at construction, on
every rank; a payload that fails to decode raises ``PayloadError`` naming the sending rank
and tensor on every rank (all ranks decode the same bytes).

Compressor state (error-feedback residuals) is per rank; ``state_dict()`` carries it under
``"hvdcompress"`` next to the inner optimizer's state, so each rank saves its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hvdcompress.compressors import Compressor, Ctx, get_compressor
from hvdcompress.transports import Handle, Transport, make_transport
from hvdcompress.wire import PayloadError

Average = "average"
Sum = "sum"
DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024  # Horovod's default fusion buffer
_U64 = struct.Struct("<Q")
STATE_KEY = "hvdcompress"


class RankAgreementError(RuntimeError):
    """Ranks disagree on what they will communicate (tensors, shapes, compressor...)."""


@dataclass
class Bucket:
    """Parameters whose gradients travel in one collective."""

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    nbytes: int = 0
    ready: set[int] = field(default_factory=set)  # positions in params whose grads are ready
    compressed: bool = True  # False: below compress_min_numel, sent as is (allreduce)


@dataclass
class _InFlight:
    handle: Handle
    ctxs: list[Ctx]
    payload_bytes: int
    sizes: list[int] = field(default_factory=list)  # summable: elements of each payload


@dataclass
class StepStats:
    """What the last ``synchronize()`` moved: for logging bytes, bits per value and time."""

    numel: int = 0  # gradient elements
    raw_bytes: int = 0  # uncompressed gradient bytes
    payload_bytes: int = 0  # bytes this rank handed to the transport
    wire_bytes: float = 0.0  # bytes this rank sends (ring model of SPEC section 7)
    collectives: int = 0
    compress_s: float = 0.0
    decode_s: float = 0.0
    wait_s: float = 0.0
    metrics: dict = field(default_factory=dict)  # the compressor's pop_metrics() (NDQSG)
    # (payload bytes, seconds) of each collective (transports.Handle.seconds): what CAT's
    # cost model predicts, one collective at a time
    timings: list = field(default_factory=list)

    @property
    def bits_per_value(self) -> float:
        return 8.0 * self.payload_bytes / max(self.numel, 1)


def _normalize_op(op) -> str:
    if op in (Average, Sum):
        return op
    # Horovod's ReduceOp values (horovod/common/basics.py): Average 0, Sum 1, Adasum 2.
    if isinstance(op, int) and op in (0, 1):
        return (Average, Sum)[op]
    raise ValueError(f"op must be hvdcompress.Average or hvdcompress.Sum, got {op!r}")


def resolve_compressor(compression) -> Compressor:
    """A Compressor from a name, a Compressor, an ``hvdcompress.Compression`` entry, or
    Horovod's own ``hvd.Compression.none`` / ``fp16``."""
    if compression is None:
        return get_compressor("none")
    if isinstance(compression, str):
        return get_compressor(compression)
    if isinstance(compression, Compressor):
        return compression
    make = getattr(compression, "make_compressor", None)
    if callable(make):
        return make()
    horovod_names = {"NoneCompressor": "none", "FP16Compressor": "fp16"}
    cls_name = getattr(compression, "__name__", type(compression).__name__)
    if cls_name in horovod_names:
        return get_compressor(horovod_names[cls_name])
    raise TypeError(
        f"compression={compression!r} is not a compressor: pass a name ('3lc'), "
        "hvdcompress.get_compressor(...) or hvdcompress.Compression.<name>"
    )


def _named_params(optimizer, named_parameters) -> list[tuple[str, torch.nn.Parameter]]:
    all_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(all_params) if p.requires_grad]
    named = list(named_parameters)
    if any(not isinstance(n, tuple) or len(n) != 2 for n in named):
        raise ValueError(
            "named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()"
        )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique, repeated: {dups[:5]}")
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(all_params) if id(p) not in known]
    if missing:
        raise ValueError(
            f"{len(missing)} optimizer parameter(s) are not in named_parameters "
            "(pass model.named_parameters() of the model the optimizer trains)"
        )
    in_optimizer = {id(p) for p in all_params}
    return [(n, p) for n, p in named if id(p) in in_optimizer and p.requires_grad]


def make_buckets(named, threshold: int, min_numel: int = 0) -> list[Bucket]:
    """Buckets from reversed parameter order, split at ``threshold`` bytes or a dtype change;
    tensors of fewer than ``min_numel`` elements go in buckets of their own, uncompressed."""
    buckets: list[Bucket] = []
    open_by_kind: dict[tuple, Bucket] = {}
    for name, p in reversed(named):
        compressed = p.numel() >= min_numel
        kind = (p.dtype, p.device, compressed)
        nbytes = p.numel() * p.element_size()
        b = open_by_kind.get(kind)
        if b is None or (b.params and b.nbytes + nbytes > threshold):
            b = Bucket(len(buckets), [], [], compressed=compressed)
            buckets.append(b)
            open_by_kind[kind] = b
        b.params.append(p)
        b.names.append(name)
        b.nbytes += nbytes
    return buckets


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
        policy=None,
        compress_min_numel: int = 0,
    ):
        super(self.__class__, self).__init__(params)
        self._compressor = compressor
        self._uncompressed = get_compressor("none")  # buckets below compress_min_numel
        self._min_numel = int(compress_min_numel)
        if self._min_numel < 0:
            raise ValueError(f"compress_min_numel must be >= 0, got {compress_min_numel!r}")
        self._transport = transport
        compressor.bind(transport.rank, transport.size)
        self.backward_passes_per_step = int(backward_passes_per_step)
        if self.backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._op = op
        named = _named_params(self, named_parameters)
        self._buckets = make_buckets(named, fusion_threshold, self._min_numel)
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in self._buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._passes_left = {id(p): self.backward_passes_per_step for _, p in named}
        self._in_flight: dict[int, _InFlight] = {}
        self._next_bucket = 0  # buckets start strictly in order
        self._should_synchronize = True
        self._synchronized = False
        self.last_stats = StepStats()
        self._stats = StepStats()
        check = getattr(compressor, "check_optimizer", None)
        if check is not None:  # e.g. DGC refuses an inner optimizer with momentum
            check(self)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self._check_agreement(named, fusion_threshold)
        # ---- policy (Accordion, CAT: hvdcompress.policies) ----
        self._policy = policy
        if policy is not None:
            compressed = {n for b in self._buckets if b.compressed for n in b.names}
            policy.bind(self, compressor, transport, [n for n, _ in named if n in compressed])

    # ---- agreement -------------------------------------------------------------------------
    def _describe(self, named, fusion_threshold) -> list[str]:
        lines = [
            f"compressor {self._compressor!r} summable={self._compressor.summable}",
            f"op {self._op}; backward_passes_per_step {self.backward_passes_per_step}",
            f"fusion_threshold {fusion_threshold}; transport {self._transport.name}",
            f"compress_min_numel {self._min_numel}",
        ]
        lines += [f"tensor {n} {tuple(p.shape)} {p.dtype}" for n, p in named]
        lines += [f"bucket {b.index}: {b.names}" for b in self._buckets]
        return lines

    def _check_agreement(self, named, fusion_threshold) -> None:
        mine = self._describe(named, fusion_threshold)
        digest = hashlib.sha256("\n".join(mine).encode()).hexdigest()
        digests = self._transport.allgather_object(digest)
        if len(set(digests)) == 1:
            return
        described = self._transport.allgather_object(mine)  # every rank takes this branch
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        r = odd[0]
        ref, other = described[0], described[r]
        diff = next(
            (i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
            min(len(ref), len(other)),
        )
        line0 = ref[diff] if diff < len(ref) else "<nothing>"
        liner = other[diff] if diff < len(other) else "<nothing>"
        raise RankAgreementError(
            f"ranks disagree on the gradients they will communicate: ranks {odd} differ "
            f"from rank 0; first difference (item {diff}): rank 0 has {line0!r}, rank {r} "
            f"has {liner!r}. Every rank must build the same model, parameter order, "
            "dtypes and compressor."
        )

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
        comp = self._comp(bucket)
        payloads, ctxs = [], []
        policy = self._policy if bucket.compressed else None
        for name, g in zip(bucket.names, grads, strict=True):
            if policy is not None:
                policy.observe(name, g)  # the uncompressed local gradient, before encoding
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.reshape(-1))
            ctxs.append(ctx)
        sizes = [p.numel() for p in payloads]
        if comp.summable:
            handle, payload_bytes, wire = self._start_allreduce(torch.cat(payloads))
        else:
            frame = _frame([p.cpu() for p in payloads])
            payload_bytes = frame.numel()
            handle = self._transport.start_allgatherv(frame)
            wire = float((self._transport.size - 1) * payload_bytes)
            self._count(payload_bytes, wire)
        s = self._stats
        s.numel += sum(g.numel() for g in grads)
        s.raw_bytes += sum(g.numel() * g.element_size() for g in grads)
        s.compress_s += time.perf_counter() - t0
        self._in_flight[bucket.index] = _InFlight(handle, ctxs, payload_bytes, sizes)

    def _start_allreduce(self, dense: torch.Tensor) -> tuple[Handle, int, float]:
        payload_bytes = dense.numel() * dense.element_size()
        handle = self._transport.start_allreduce_sum(dense)
        wire = 2.0 * (self._transport.size - 1) / self._transport.size * payload_bytes
        self._count(payload_bytes, wire)
        return handle, payload_bytes, wire

    def _count(self, payload_bytes: int, wire: float) -> None:
        self._stats.payload_bytes += payload_bytes
        self._stats.wire_bytes += wire
        self._stats.collectives += 1

    def _comp(self, bucket: Bucket) -> Compressor:
        return self._compressor if bucket.compressed else self._uncompressed

    def _next_phases(self, comp, flight: _InFlight, summed: torch.Tensor) -> torch.Tensor:
        """Multi-phase summable compressors (PowerSGD: P, then Q): from the allreduced
        payloads of one phase, the compressor makes the next phase's payloads, which one
        more allreduce sums. Every rank runs the same phases of the buckets in bucket order,
        so the collectives match. A phase whose payloads are all empty is not sent."""
        for phase in range(1, getattr(comp, "phases", 1)):
            parts = summed.split(flight.sizes)
            nxt = [
                comp.next_phase(part, ctx, phase).reshape(-1)
                for part, ctx in zip(parts, flight.ctxs, strict=True)
            ]
            flight.sizes = [t.numel() for t in nxt]
            dense = torch.cat(nxt)
            if dense.numel():
                t0 = time.perf_counter()
                handle, payload_bytes, _ = self._start_allreduce(dense)
                summed = handle.wait()
                self._stats.wait_s += time.perf_counter() - t0
                self._stats.timings.append((payload_bytes, handle.seconds))
            else:
                summed = dense
        return summed

    # ---- synchronize / step ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Start what backward has not started, wait for all buckets, write averaged grads."""
        for b in self._buckets[self._next_bucket :]:
            b.ready.update(range(len(b.params)))
        self._launch_ready()
        error: BaseException | None = None
        for b in self._buckets:
            flight = self._in_flight.pop(b.index)
            t0 = time.perf_counter()
            try:
                result = flight.handle.wait()
            except BaseException as err:  # noqa: BLE001 - keep draining, then raise
                error = error or err
                continue
            t1 = time.perf_counter()
            self._stats.wait_s += t1 - t0
            self._stats.timings.append((flight.payload_bytes, flight.handle.seconds))
            if error is not None:
                continue  # drain the remaining collectives so no rank leaves one pending
            try:
                comp = self._comp(b)
                if comp.summable:
                    result = self._next_phases(comp, flight, result)
                    self._write_summed(b, flight.ctxs, result, flight.sizes)
                else:
                    self._write_gathered(b, flight.ctxs, *result)
            except BaseException as err:  # noqa: BLE001
                error = err
            self._stats.decode_s += time.perf_counter() - t1
        pop_metrics = getattr(self._compressor, "pop_metrics", None)
        if pop_metrics is not None:
            self._stats.metrics = pop_metrics()
        if self._policy is not None and error is None:
            self._policy.after_step()  # every collective of the step is done
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

    def _scale(self) -> float:
        return 1.0 / self._transport.size if self._op == Average else 1.0

    def _write_summed(
        self, bucket: Bucket, ctxs: list[Ctx], summed: torch.Tensor, sizes: list[int]
    ) -> None:
        offset = 0
        scale = self._scale()
        comp = self._comp(bucket)
        for p, ctx, n in zip(bucket.params, ctxs, sizes, strict=True):
            value = comp.decompress(summed[offset : offset + n], ctx)
            offset += n
            if scale != 1.0:
                value = value.to(torch.float32).mul_(scale)
            p.grad.copy_(value.view_as(p.grad))

    def _write_gathered(
        self, bucket: Bucket, ctxs: list[Ctx], gathered: torch.Tensor, sizes: list[int]
    ) -> None:
        device = bucket.params[0].device
        accs = [torch.zeros(p.numel(), dtype=torch.float32, device=device) for p in bucket.params]
        # NDQSG: a payload is decoded with side information, the mean of the tensors already
        # decoded (lower ranks); the same on every rank, which decodes the same bytes in order.
        comp = self._comp(bucket)
        side = getattr(comp, "uses_side_info", False)
        offset = 0
        for rank, size in enumerate(sizes):
            frame = gathered[offset : offset + size]
            offset += size
            payloads = _unframe(frame, len(bucket.params), rank, bucket.names)
            for payload, acc, name, ctx in zip(payloads, accs, bucket.names, ctxs, strict=True):
                kw = {"side_info": acc / rank if rank else None} if side else {}
                comp.decode(
                    payload.to(device),
                    expect=ctx,
                    rank=rank,
                    name=name,
                    out=acc,
                    accumulate=True,
                    **kw,
                )
        scale = self._scale()
        for p, acc in zip(bucket.params, accs, strict=True):
            if scale != 1.0:
                acc.mul_(scale)
            p.grad.copy_(acc.view_as(p.grad))

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
                import warnings

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
        if self._policy is not None and hasattr(self._policy, "state_dict"):
            state[STATE_KEY]["policy"] = self._policy.state_dict()  # Accordion's norms, levels
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        if ours is not None:
            me = (self._transport.rank, self._transport.size)
            if (ours["rank"], ours["size"]) != me:
                raise ValueError(
                    f"this optimizer state was saved by rank {ours['rank']} of {ours['size']}, "
                    f"loading on rank {me[0]} of {me[1]}: error-feedback residuals are per "
                    "rank, so each rank must load its own state"
                )
            if ours["compressor"] != repr(self._compressor):
                raise ValueError(
                    f"state saved with compressor {ours['compressor']}, "
                    f"this optimizer has {self._compressor!r}"
                )
            self._compressor.load_state_dict(ours["compressor_state"])
            if "policy" in ours and hasattr(self._policy, "load_state_dict"):
                self._policy.load_state_dict(ours["policy"])
        return super(self.__class__, self).load_state_dict(state_dict)

    @property
    def compressor(self) -> Compressor:
        return self._compressor

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def policy(self):
        return self._policy

    @property
    def buckets(self) -> list[Bucket]:
        return self._buckets


def _frame(payloads: list[torch.Tensor]) -> torch.Tensor:
    """n, n lengths (uint64 little-endian), then the payloads: one rank's bytes of a bucket."""
    head = struct.pack(f"<Q{len(payloads)}Q", len(payloads), *(p.numel() for p in payloads))
    return torch.cat([torch.frombuffer(bytearray(head), dtype=torch.uint8), *payloads])


def _unframe(frame: torch.Tensor, count: int, rank: int, names: list[str]) -> list[torch.Tensor]:
    """Split one rank's frame; a malformed frame raises PayloadError naming the rank."""
    head_len = 8 * (count + 1)
    if frame.numel() < head_len:
        raise PayloadError(
            "frame", f"{frame.numel()} bytes cannot hold a table of {count} lengths", rank=rank
        )
    table = np.frombuffer(frame[:head_len].numpy().tobytes(), dtype="<u8")
    if int(table[0]) != count:
        raise PayloadError(
            "frame", f"{int(table[0])} payloads in the bucket, expected {count}", rank=rank
        )
    lengths = [int(x) for x in table[1:]]
    if head_len + sum(lengths) != frame.numel():
        raise PayloadError(
            "frame",
            f"lengths add up to {head_len + sum(lengths)} bytes, frame has {frame.numel()}",
            rank=rank,
            tensor=names[0] if count == 1 else None,
        )
    out, offset = [], head_len
    for n in lengths:
        out.append(frame[offset : offset + n])
        offset += n
    return out


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression="none",
    backward_passes_per_step: int = 1,
    op=Average,
    backend: str | Transport = "horovod",
    fusion_threshold: int | None = None,
    policy=None,
    compress_min_numel: int = 0,
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
    compressor = resolve_compressor(compression)
    op = _normalize_op(op)
    transport = backend if isinstance(backend, Transport) else make_transport(backend)
    if fusion_threshold is None:
        fusion_threshold = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD))
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
    )
