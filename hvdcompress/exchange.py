"""The exchange: who sends what to whom, per bucket (docs/design.md, "The gradient walk";
section 7, "Traffic per rank").

Three exchanges; ``choose_exchanges`` gives each bucket one, from the compressor's kind
and the optimizer's ``exchange=`` ("auto", "allgather", "twostage"):

* ``SummedExchange`` (summable compressors: none, fp16, bf16, PowerSGD): the bucket's
  dense payloads are concatenated and summed by one allreduce per phase; phase p + 1's
  payloads are made from phase p's sums (``next_phase``), then ``decompress`` gives each
  tensor's sum.
* ``GatheredExchange`` (gather-only compressors: 3LC and every byte-coded codec): each
  rank sends one frame per bucket (``wire.frame``: its payloads behind a length table);
  one allgather moves every rank's frame; every rank parses each payload's header once
  and decodes all payloads in rank order into one float32 accumulator per tensor.
  Compressors that decode with side information (NDQSG) get the mean of the lower
  ranks' decoded tensors. Traffic per rank: (N - 1) x payload.
* ``TwoStageExchange`` (gather-only compressors that can re-compress an average): a
  compressed reduce-scatter, then an allgather of re-compressed shards (3LC's push of
  compressed gradients and pull of compressed aggregates, as an all-to-all). The bucket's
  flat gradient is cut into N shards (``plan_shards``, boundaries on the codec's groups);
  stage 1: each rank compresses shard j with its own residual (state name
  ``Piece.sender_key``) and sends it to rank j (one alltoallv), rank j decodes the N
  shards it received in rank order into float32 and scales the sum; stage 2: rank j
  re-compresses that with its owner residual (``Piece.owner_key``), one allgatherv moves
  the shards, every rank decodes all of them. Traffic per rank about
  2 (N - 1) / N x payload, two full-size decodes per rank whatever N.

All scale the sum by ``scale`` (1 / size for an average) and write it into the gradient
tensors they were handed (in place: the optimizer hands ``p.grad``, the DDP hook views of
its bucket buffer; no exchange touches a parameter). ``start`` returns the bucket's
``InFlight``, whose ``future`` (a ``torch.futures.Future``) ``finish`` completes with those
tensors, or with the error.
Invariants: every rank starts the same collectives in the same order (bucket order,
phase order; the two-stage exchange runs stage 2 of every bucket it started, even while
draining after an error); on the gather paths every rank decodes the same bytes in the
same order, so all ranks hold bit-identical gradients; a payload that fails to decode
raises ``PayloadError`` naming the sending rank and the tensor (and the stage), on every
rank: an owner that cannot decode a stage-1 payload reports it in its stage-2 message.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from hvdcompress import wire
from hvdcompress.buckets import Bucket
from hvdcompress.compressors import Compressor, Ctx, GatherCompressor, SummableCompressor
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.errors import PayloadError
from hvdcompress.transports import Handle, Transport


@dataclass
class Collective:
    """One started collective: this rank's bytes and the ring-model bytes it sends."""

    handle: Handle
    payload_bytes: int
    wire_bytes: float


@dataclass
class InFlight:
    """A bucket whose collective has started; ``finish`` writes ``grads`` in place, fills
    in the times and completes ``future`` (its value: ``grads``)."""

    ctxs: list[Ctx]
    collectives: list[Collective]
    grads: list[torch.Tensor]  # the gradients handed to start: averaged in place
    sizes: list[int] = field(default_factory=list)  # summed: elements of each payload
    wait_s: float = 0.0
    decode_s: float = 0.0
    overflow: list[str] = field(default_factory=list)  # finite sums that overflowed the gradient
    nonfinite: list[str] = field(default_factory=list)  # sums that were not finite
    shards: list = field(default_factory=list)  # two-stage: the plan_shards of this bucket
    future: torch.futures.Future = field(default_factory=torch.futures.Future)


LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Exchange:
    """What the exchanges share: ``start`` a bucket, ``finish`` it (see module doc)."""

    kind = ""  # "allreduce", "allgather" or "twostage"

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Compressor state names this exchange adds beyond the tensors' own, with their
        shapes (checked when a checkpoint is loaded); none but for the two-stage one."""
        return {}

    def finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        """Wait for the bucket's collective, then (unless ``decode`` is False: draining
        after an error) decode and write the gradients; times go into ``flight``. The
        bucket's ``future`` ends with the averaged gradients, or with the error (draining:
        a RuntimeError), which is also raised."""
        try:
            self._finish(bucket, comp, flight, scale, decode)
        except BaseException as err:
            flight.future.set_exception(err)
            raise
        if decode:
            flight.future.set_result(flight.grads)
        else:
            flight.future.set_exception(
                RuntimeError(f"tensors {bucket.names} were not averaged: drained after an error")
            )

    def _finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        t0 = time.perf_counter()
        result = flight.collectives[0].handle.wait()
        t1 = time.perf_counter()
        flight.wait_s += t1 - t0
        if decode:
            self._complete(bucket, comp, flight, result, scale)
            flight.decode_s += time.perf_counter() - t1

    def _complete(self, bucket, comp, flight, result, scale) -> None:
        raise NotImplementedError

    def _write(
        self, grad: torch.Tensor, name: str, value: torch.Tensor, comp, scale: float, flight
    ) -> None:
        """Write the sum ``value`` times ``scale`` into ``grad`` (docs/design.md,
        "Error feedback and low precision").

        Into a float16 / bfloat16 gradient: a finite float32 value that overflows the
        dtype becomes +-Inf as a cast would (so that GradScaler skips the step and backs
        off), and is reported: ``flight.overflow`` (``StepStats.overflow``) and a
        RuntimeWarning naming the tensor. For an error-feedback compressor the rounding
        of the cast (float32 value minus what was written), where finite, goes into this
        rank's residual, scaled so that over the ranks it adds up to the rounding: every
        rank adds ``rounding / (scale * size)`` (Average: the rounding; Sum: 1 / size of
        it), so the applied gradients plus the residuals keep tracking the true sum."""
        if grad.dtype not in LOW_PRECISION:
            if scale != 1.0:
                value = value.to(torch.float32).mul_(scale)
            grad.copy_(value.view_as(grad))
            return
        value = value.to(torch.float32).reshape(grad.shape)
        if scale != 1.0:
            value = value.mul(scale)
        grad.copy_(value)
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            flight.nonfinite.append(name)  # a real non-finite gradient: stays as it is
            return
        written = grad.to(torch.float32)
        if not bool(torch.isfinite(written).all()):
            flight.overflow.append(name)
            warnings.warn(
                f"hvdcompress: the averaged gradient of {name!r} exceeds the range of "
                f"{grad.dtype} (max |value| {float(value.abs().max()):.6g}) and was written "
                "as Inf; a GradScaler skips this step and lowers its scale",
                RuntimeWarning,
                stacklevel=4,
            )
        if comp.error_feedback:
            rounding = value - written
            rounding = torch.where(torch.isfinite(rounding), rounding, torch.zeros_like(value))
            self._absorb_rounding(comp, name, rounding, scale, flight)

    def _absorb_rounding(
        self, comp, name: str, rounding: torch.Tensor, scale: float, flight
    ) -> None:
        """This rank's share of the rounding of a low-precision write (``_write``) into
        the residual that sends it again: every rank adds ``rounding / (scale * size)``
        to its residual of ``name``."""
        share = 1.0 / (scale * self.transport.size)
        comp.absorb(name, rounding if share == 1.0 else rounding * share)


class SummedExchange(_Exchange):
    """Allreduce of dense payloads, one per phase (see module doc)."""

    kind = "allreduce"

    def start(
        self, bucket: Bucket, comp: SummableCompressor, grads: list[torch.Tensor]
    ) -> InFlight:
        payloads, ctxs = [], []
        for name, g in zip(bucket.names, grads, strict=True):
            payload, ctx = comp.compress(g, name)
            payloads.append(payload.reshape(-1))
            ctxs.append(ctx)
        sizes = [p.numel() for p in payloads]
        return InFlight(ctxs, [self._allreduce(torch.cat(payloads))], list(grads), sizes)

    def _allreduce(self, dense: torch.Tensor) -> Collective:
        payload_bytes = dense.numel() * dense.element_size()
        size = self.transport.size
        handle = self.transport.start_allreduce_sum(dense)
        return Collective(handle, payload_bytes, 2.0 * (size - 1) / size * payload_bytes)

    def _complete(
        self,
        bucket: Bucket,
        comp: SummableCompressor,
        flight: InFlight,
        summed: torch.Tensor,
        scale: float,
    ) -> None:
        summed = self._next_phases(comp, flight, summed)
        offset = 0
        for grad, ctx, n in zip(flight.grads, flight.ctxs, flight.sizes, strict=True):
            value = comp.decompress_exact(summed[offset : offset + n], ctx)
            offset += n
            self._write(grad, ctx.name, value, comp, scale, flight)

    def _next_phases(self, comp, flight: InFlight, summed: torch.Tensor) -> torch.Tensor:
        """Phases 2.. of a multi-phase compressor (PowerSGD: P, then Q): every rank runs
        the same phases of the buckets in bucket order, so the collectives match. A phase
        whose payloads are all empty is not sent."""
        for phase in range(1, comp.phases):
            parts = summed.split(flight.sizes)
            nxt = [
                comp.next_phase(part, ctx, phase).reshape(-1)
                for part, ctx in zip(parts, flight.ctxs, strict=True)
            ]
            flight.sizes = [t.numel() for t in nxt]
            dense = torch.cat(nxt)
            if dense.numel():
                t0 = time.perf_counter()
                collective = self._allreduce(dense)
                flight.collectives.append(collective)
                summed = collective.handle.wait()
                flight.wait_s += time.perf_counter() - t0
            else:
                summed = dense
        return summed


class GatheredExchange(_Exchange):
    """Allgather of self-describing byte payloads, decoded by every rank (module doc)."""

    kind = "allgather"

    def start(self, bucket: Bucket, comp: GatherCompressor, grads: list[torch.Tensor]) -> InFlight:
        # One call per bucket (compressors/base.py, compress_bucket): the frame of the
        # bucket's payloads, one checksum pass over all of them.
        frame, ctxs = comp.compress_bucket(grads, list(bucket.names))
        if not self.transport.moves_on(frame.device):
            frame = frame.cpu()
        handle = self.transport.start_allgatherv(frame)
        wire_bytes = float((self.transport.size - 1) * frame.numel())
        return InFlight(ctxs, [Collective(handle, frame.numel(), wire_bytes)], list(grads))

    def _complete(
        self,
        bucket: Bucket,
        comp: GatherCompressor,
        flight: InFlight,
        result: tuple[torch.Tensor, list[int]],
        scale: float,
    ) -> None:
        gathered, sizes = result
        device = flight.grads[0].device
        accs = [torch.zeros(g.numel(), dtype=torch.float32, device=device) for g in flight.grads]
        offset = 0
        for rank, size in enumerate(sizes):
            frame = gathered[offset : offset + size]
            offset += size
            # Rank order; NDQSG gets the mean of the lower ranks' tensors (decode_bucket).
            comp.decode_frame(frame, accs, flight.ctxs, rank=rank)
        for grad, acc, ctx in zip(flight.grads, accs, flight.ctxs, strict=True):
            self._write(grad, ctx.name, acc, comp, scale, flight)


# ---- the two-stage exchange ------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of the flat tensor ``name`` (position ``tensor`` in its
    bucket): the part of it in the shard that rank ``owner`` owns.

    Compressor state is kept per piece: ``sender_key`` names every rank's stage-1 state
    (its error-feedback residual for what it sends to the owner), ``owner_key`` the
    owner's stage-2 state (the residual of its re-compressed average). Both carry the
    tensor's level (``PerTensorLevels``), mirrored before each use."""

    owner: int
    tensor: int
    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def sender_key(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]"

    @property
    def owner_key(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]@owner"


def plan_shards(
    names: list[str], numels: list[int], size: int, alignment: int
) -> list[list[Piece]]:
    """Cut the bucket's flat gradient (the tensors ``names`` of ``numels`` elements, one
    after the other) into ``size`` contiguous shards, shard j the pieces owned by rank j.

    Cut k starts at ``k * total // size`` and moves to the nearest multiple of
    ``alignment`` elements of the tensor it falls in (or that tensor's end); cuts never
    move backwards. Shards may be empty (fewer elements than ranks, or alignment), every
    element is in exactly one piece, and a tensor's pieces start at multiples of
    ``alignment``. The same on every rank (it depends on the arguments only)."""
    if size < 1 or alignment < 1:
        raise ValueError(f"size and alignment must be >= 1, got {size}, {alignment}")
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    cuts = [0]
    for k in range(1, size):
        cuts.append(max(cuts[-1], _aligned_cut(k * total // size, offsets, alignment)))
    cuts.append(total)
    shards = []
    for owner in range(size):
        lo, hi = cuts[owner], cuts[owner + 1]
        pieces = []
        for t, name in enumerate(names):
            a, b = max(lo, offsets[t]), min(hi, offsets[t + 1])
            if a < b:
                pieces.append(Piece(owner, t, name, a - offsets[t], b - offsets[t]))
        shards.append(pieces)
    return shards


def _aligned_cut(cut: int, offsets: list[int], alignment: int) -> int:
    """``cut`` moved to the nearest multiple of ``alignment`` of the tensor it falls in."""
    for start, stop in zip(offsets, offsets[1:], strict=False):
        if start <= cut < stop:
            within = (cut - start + alignment // 2) // alignment * alignment
            return start + min(within, stop - start)
    return cut


# The owner's stage-2 message: one status byte, then the frame of its re-compressed shard
# (OK), a JSON report of the stage-1 payload it could not decode (FAILED), or nothing
# (DRAINING: it only takes part so that no rank waits, after an error of its own).
STATUS_OK, STATUS_FAILED, STATUS_DRAINING = 0, 1, 2


class TwoStageExchange(_Exchange):
    """Compressed reduce-scatter (alltoallv), re-compression by the shard's owner, then an
    allgatherv of the re-compressed shards (module doc). One per bucket; the shards of
    what is launched (the bucket, or its dense part when some gradients are sparse) are
    ``plan_shards`` of its tensors with the compressor's ``shard_alignment``."""

    kind = "twostage"

    def __init__(self, transport: Transport, bucket: Bucket, alignment: int) -> None:
        super().__init__(transport)
        self.alignment = alignment
        self._plans: dict[tuple[str, ...], list[list[Piece]]] = {}
        self.plan(bucket)

    def plan(self, bucket: Bucket) -> list[list[Piece]]:
        """The shards of ``bucket``'s tensors (computed once per set of tensors)."""
        key = tuple(bucket.names)
        if key not in self._plans:
            numels = [p.numel() for p in bucket.params]
            self._plans[key] = plan_shards(
                bucket.names, numels, self.transport.size, self.alignment
            )
        return self._plans[key]

    def state_shapes(self) -> dict[str, tuple[int]]:
        """The compressor state names this exchange makes on this rank, and their shapes:
        a stage-1 entry per piece of every shard, a stage-2 entry per piece this rank owns
        (for checking a loaded checkpoint)."""
        shapes = {}
        for shards in self._plans.values():
            shapes.update({pc.sender_key: (pc.numel,) for pieces in shards for pc in pieces})
            shapes.update({pc.owner_key: (pc.numel,) for pc in shards[self.transport.rank]})
        return shapes

    def _mirror_levels(self, comp: GatherCompressor, shards: list[list[Piece]]) -> None:
        """Each piece's state names get the level its tensor has now (set by a policy):
        what this rank sends, and what it checks in the payloads it receives."""
        if isinstance(comp, PerTensorLevels):
            for pieces in shards:
                for pc in pieces:
                    level = comp.level(pc.name)
                    comp.set_level(pc.sender_key, level)
                    comp.set_level(pc.owner_key, comp.owner_level(level))

    # ---- stage 1 ----------------------------------------------------------------------------
    def start(self, bucket: Bucket, comp: GatherCompressor, grads: list[torch.Tensor]) -> InFlight:
        shards = self.plan(bucket)
        self._mirror_levels(comp, shards)
        flats = [g.reshape(-1) for g in grads]
        parts = []
        for pieces in shards:  # one frame per owner, its pieces in one bucket call
            frame, _ = comp.compress_bucket(
                [flats[pc.tensor][pc.start : pc.stop] for pc in pieces],
                [pc.sender_key for pc in pieces],
            )
            parts.append(frame.to(self._bytes_device(frame.device)))
        ctxs = [
            Ctx(name, tuple(g.shape), g.dtype, g.device)
            for name, g in zip(bucket.names, grads, strict=True)
        ]
        handle = self.transport.start_alltoallv(parts)
        rank = self.transport.rank
        to_others = sum(p.numel() for j, p in enumerate(parts) if j != rank)
        collective = Collective(handle, sum(p.numel() for p in parts), to_others)
        return InFlight(ctxs, [collective], list(grads), shards=shards)

    def _finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        """Wait for stage 1, make this rank's stage-2 message (its re-compressed shard, or
        the report of a stage-1 payload it could not decode, or with ``decode`` False only
        a placeholder), run stage 2 and decode it. Stage 2 runs on every rank in every
        case, so no rank is left waiting in it."""
        t0 = time.perf_counter()
        received = flight.collectives[0].handle.wait()
        t1 = time.perf_counter()
        flight.wait_s += t1 - t0
        local_error = None  # raised after stage 2, which every rank must take part in
        device = self._bytes_device(flight.ctxs[0].device if flight.ctxs else None)
        message = torch.tensor([STATUS_DRAINING], dtype=torch.uint8, device=device)
        if decode:
            try:
                message = self._owner_message(comp, flight, received, scale).to(device)
            except Exception as err:  # noqa: BLE001 - the others learn of it from the status
                local_error = err
        t2 = time.perf_counter()
        flight.decode_s += t2 - t1
        size = self.transport.size
        stage2 = Collective(
            self.transport.start_allgatherv(message), message.numel(), (size - 1) * message.numel()
        )
        flight.collectives.append(stage2)
        result = stage2.handle.wait()
        t3 = time.perf_counter()
        flight.wait_s += t3 - t2
        if local_error is not None:
            raise local_error
        if decode:
            self._complete(bucket, comp, flight, result, scale)
            flight.decode_s += time.perf_counter() - t3

    def _bytes_device(self, device: torch.device | None) -> torch.device:
        """Where this rank's stage messages go: the tensors' device where the transport
        moves bytes there (``Transport.moves_on``), else the host."""
        if device is not None and self.transport.moves_on(device):
            return device
        return torch.device("cpu")

    def _owner_message(self, comp, flight: InFlight, received, scale: float) -> torch.Tensor:
        """Decode the N stage-1 frames of this rank's shard in rank order into float32,
        scale the sum, re-compress each piece with the owner residual: the stage-2
        message (or the report of the first payload that failed to decode)."""
        device = flight.ctxs[0].device if flight.ctxs else torch.device("cpu")
        mine = flight.shards[self.transport.rank]
        accs = [torch.zeros(pc.numel, dtype=torch.float32, device=device) for pc in mine]
        ctxs = [
            Ctx(pc.sender_key, (pc.numel,), flight.ctxs[pc.tensor].dtype, device) for pc in mine
        ]
        for sender, frame in enumerate(received):
            try:  # decode_parsed(expect=ctx, out=acc, accumulate=True) of each payload
                comp.decode_frame(frame, accs, ctxs, rank=sender)
            except PayloadError as err:
                report = _report(err, sender, 1, _piece_of(flight.shards, err.tensor))
                body = json.dumps(report).encode()
                return torch.tensor([STATUS_FAILED, *body], dtype=torch.uint8)
        payloads = []
        for acc, pc in zip(accs, mine, strict=True):
            if scale != 1.0:
                acc.mul_(scale)
            payloads.append(comp.compress(acc, pc.owner_key)[0])
        ok = torch.tensor([STATUS_OK], dtype=torch.uint8, device=device)
        return torch.cat([ok, wire.frame(payloads).to(device)])

    # ---- stage 2 ----------------------------------------------------------------------------
    def _complete(self, bucket: Bucket, comp, flight: InFlight, result, scale: float) -> None:
        gathered, sizes = result
        messages = gathered.split(sizes)
        # every owner's status byte in one read (the messages may be on a GPU)
        starts = [0, *itertools.accumulate(sizes)][: len(sizes)]
        firsts = gathered[[a for a, n in zip(starts, sizes, strict=True) if n]].tolist()
        statuses = iter(firsts)
        for owner, message in enumerate(messages):  # the same checks on every rank
            status = next(statuses) if message.numel() else None
            if status == STATUS_FAILED:
                raise _reported_error(message, owner)
            if status == STATUS_DRAINING:
                raise RuntimeError(
                    f"two-stage exchange: rank {owner} stopped exchanging after an error of its "
                    f"own (see rank {owner}'s error); tensors {bucket.names} were not averaged"
                )
            if status != STATUS_OK:
                raise _staged(
                    PayloadError("status", f"unknown stage-2 status {status}"),
                    owner,
                    2,
                    None,
                )
        device = flight.ctxs[0].device if flight.ctxs else torch.device("cpu")
        outs = [
            torch.empty(math.prod(c.shape), dtype=torch.float32, device=device) for c in flight.ctxs
        ]
        for owner, message in enumerate(messages):
            pieces = flight.shards[owner]
            try:
                parsed = wire.unframe_parsed(
                    message[1:], owner, [pc.owner_key for pc in pieces], device
                )
                for (header, payload), pc in zip(parsed, pieces, strict=True):
                    comp.decode_parsed(
                        header,
                        payload,
                        expect=Ctx(pc.owner_key, (pc.numel,), torch.float32, device),
                        name=pc.owner_key,
                        rank=owner,
                        out=outs[pc.tensor][pc.start : pc.stop],
                    )
            except PayloadError as err:
                raise _staged(err, owner, 2, _piece_of(flight.shards, err.tensor)) from None
        for grad, out, ctx in zip(flight.grads, outs, flight.ctxs, strict=True):
            # the owners compressed the scaled sum: what is decoded is what is written
            self._write(grad, ctx.name, out, comp, 1.0, flight)

    def _absorb_rounding(
        self, comp, name: str, rounding: torch.Tensor, scale: float, flight
    ) -> None:
        """Every rank writes the same value; the owner of each piece compressed exactly
        it, so the rounding of the write goes, whole, into the owner residual."""
        flat = rounding.reshape(-1)
        for pc in flight.shards[self.transport.rank]:
            if pc.name == name:
                comp.absorb(pc.owner_key, flat[pc.start : pc.stop])


def _piece_of(shards: list[list[Piece]], key: str | None) -> Piece | None:
    """The piece whose stage-1 or stage-2 state name is ``key``."""
    for pieces in shards:
        for pc in pieces:
            if key in (pc.sender_key, pc.owner_key):
                return pc
    return None


def _report(err: PayloadError, sender: int, stage: int, piece: Piece | None) -> dict:
    """A stage-1 decode error as the owner sends it to every rank (JSON)."""
    return {
        "field": err.field,
        "detail": err.detail,
        "sender": sender,
        "stage": stage,
        "tensor": piece.name if piece else err.tensor,
        "range": [piece.start, piece.stop] if piece else None,
    }


def _reported_error(message: torch.Tensor, owner: int) -> PayloadError:
    """The PayloadError an owner reported in its stage-2 message (``_report``)."""
    try:
        r = json.loads(bytes(message[1:].tolist()).decode())
        where = f" elements {r['range'][0]}:{r['range'][1]}" if r["range"] else ""
        return PayloadError(
            r["field"],
            f"two-stage exchange stage {r['stage']} (reduce-scatter),{where} sent to rank "
            f"{owner}, which reports: {r['detail']}",
            rank=r["sender"],
            tensor=r["tensor"],
        )
    except (ValueError, KeyError, TypeError, IndexError):
        return PayloadError(
            "status", "two-stage exchange: an unreadable stage-1 error report", rank=owner
        )


def _staged(err: PayloadError, sender: int, stage: int, piece: Piece | None) -> PayloadError:
    """``err`` of a stage-2 payload, naming the stage, the sending owner and the tensor."""
    where = f", elements {piece.start}:{piece.stop}" if piece else ""
    return PayloadError(
        err.field,
        f"two-stage exchange stage {stage} (allgather of re-compressed shards{where}): "
        f"{err.detail}",
        rank=sender,
        tensor=piece.name if piece else err.tensor,
    )


# ---- choosing an exchange per bucket --------------------------------------------------------

EXCHANGES = ("auto", "allgather", "twostage")
PROBE_NUMEL = 1 << 16  # elements of the cost model's probe payload


@dataclass(frozen=True)
class PayloadEstimate:
    """A compressor's payload size model: a header per payload plus bits per value."""

    header_bytes: int
    bits_per_value: float

    def bytes(self, numel: int) -> int:
        return self.header_bytes + math.ceil(numel * self.bits_per_value / 8)


def estimate_payload(compressor: GatherCompressor, size: int) -> PayloadEstimate:
    """Measure the compressor on a probe: a copy of it (bound as rank 0, so that every
    rank measures the same bytes) compresses ``PROBE_NUMEL`` seeded normal values. The
    compressor itself is not touched."""
    probe = copy.deepcopy(compressor)
    probe.bind(0, size)
    x = torch.randn(PROBE_NUMEL, generator=torch.Generator().manual_seed(0))
    payload, _ = probe.compress(x, "hvdcompress.exchange.probe")
    header = wire.parse(payload)
    return PayloadEstimate(header.size, 8.0 * (payload.numel() - header.size) / PROBE_NUMEL)


def allgather_bytes(size: int, numels: list[int], est: PayloadEstimate) -> float:
    """Bytes one rank sends for a bucket on the allgather: its frame to N - 1 ranks."""
    frame = 8 * (len(numels) + 1) + sum(est.bytes(n) for n in numels)
    return float((size - 1) * frame)


def twostage_bytes(size: int, shards: list[list[Piece]], est: PayloadEstimate) -> float:
    """Bytes one rank sends for a bucket on the two-stage exchange, averaged over ranks:
    stage 1 sends the N - 1 shards of the others, stage 2 its own shard to N - 1 ranks;
    both move every shard's frame (N - 1) / N times per rank on average."""
    frames = sum(8 * (len(p) + 1) + sum(est.bytes(pc.numel) for pc in p) for p in shards)
    return 2.0 * (size - 1) / size * frames + (size - 1)  # + the status byte


def choose_exchanges(
    compressor: Compressor,
    uncompressed: SummableCompressor,
    transport: Transport,
    buckets: list[Bucket],
    mode: str = "auto",
) -> dict[int, _Exchange]:
    """The exchange of every bucket (by ``Bucket.index``), for ``exchange=mode``.

    Uncompressed buckets and summable compressors: the allreduce. Gather-only ones:
    "allgather"; "twostage" (ValueError if the compressor is not ``recompressible``, or
    is summable); "auto": the two-stage exchange where its modelled bytes per rank
    (``twostage_bytes``) are fewer than the allgather's (``allgather_bytes``), which needs
    N >= 3 (at N = 2 both move the payload once) and a bucket whose payload outweighs the
    extra headers; compressors that cannot re-compress stay on the allgather. The choice
    depends only on the buckets, N and the compressor's configuration: the same on every
    rank."""
    if mode not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGES))}, got {mode!r}")
    size = transport.size
    if isinstance(compressor, SummableCompressor):
        if mode == "twostage":
            raise ValueError(
                f"exchange='twostage' is for gather-only compressors; {compressor.name} is "
                "summable and its buckets are allreduced (already 2 (N - 1) / N x payload "
                "per rank): use exchange='auto'"
            )
    elif not isinstance(compressor, GatherCompressor):
        raise TypeError(
            f"{compressor!r} is neither a GatherCompressor nor a SummableCompressor "
            "(hvdcompress.compressors.base)"
        )
    elif mode == "twostage" and not compressor.recompressible:
        raise ValueError(
            f"exchange='twostage' needs a compressor whose averaged shards can be "
            f"re-compressed; {compressor.name} cannot (GatherCompressor.recompressible: "
            "it decodes with other ranks' payloads or its compress does more than encode): "
            "use exchange='allgather' or 'auto'"
        )
    estimate = None
    chosen: dict[int, _Exchange] = {}
    for b in buckets:
        if not b.compressed or isinstance(compressor, SummableCompressor):
            chosen[b.index] = SummedExchange(transport)
            continue
        if mode == "allgather" or not compressor.recompressible:
            chosen[b.index] = GatheredExchange(transport)
            continue
        numels = [p.numel() for p in b.params]
        alignment = compressor.shard_alignment()
        if mode == "auto":
            if size < 3:
                chosen[b.index] = GatheredExchange(transport)
                continue
            estimate = estimate or estimate_payload(compressor, size)
            shards = plan_shards(b.names, numels, size, alignment)
            if twostage_bytes(size, shards, estimate) >= allgather_bytes(size, numels, estimate):
                chosen[b.index] = GatheredExchange(transport)
                continue
        chosen[b.index] = TwoStageExchange(transport, b, alignment)
    return chosen
