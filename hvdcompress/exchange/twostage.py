"""The two-stage exchange: compressed reduce-scatter (alltoallv), re-compression by each
shard's owner, allgatherv of the re-compressed shards; and its shard plan."""

from __future__ import annotations

import itertools
import json
import math
import time
import zlib
from dataclasses import dataclass

import torch

from hvdcompress import framing, wire
from hvdcompress.buckets import Bucket, PieceKey
from hvdcompress.compressors import Ctx, GatherCompressor
from hvdcompress.compressors.levels import PerTensorLevels
from hvdcompress.errors import PayloadError
from hvdcompress.exchange.base import Collective, InFlight, _Exchange, site, waited
from hvdcompress.transports import Transport


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
    def sender_key(self) -> PieceKey:
        return PieceKey(self.name, self.start, self.stop)

    @property
    def owner_key(self) -> PieceKey:
        return PieceKey(self.name, self.start, self.stop, owner=True)


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
    offsets = [0, *itertools.accumulate(numels)]
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


def plan_shards_per_tensor(
    names: list[str], numels: list[int], size: int, alignment: int
) -> list[list[Piece]]:
    """Shards that do not depend on which tensors share the bucket: each tensor is cut on
    its own (``plan_shards`` of the one tensor), and its pieces go to the owners rotated
    by a hash of its name, so that small tensors, which ``plan_shards`` gives to few
    owners, spread over the ranks. The DDP hook's plan: DDP rebuilds its buckets after the
    first step (and again in every new process, so after a resume), and a piece's state
    names must mean the same elements whichever bucket the tensor is in."""
    shards: list[list[Piece]] = [[] for _ in range(size)]
    for t, (name, n) in enumerate(zip(names, numels, strict=True)):
        turn = zlib.crc32(name.encode()) % size
        for owner, pieces in enumerate(plan_shards([name], [n], size, alignment)):
            to = (owner + turn) % size
            shards[to] += [Piece(to, t, name, pc.start, pc.stop) for pc in pieces]
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
    """The two-stage exchange of one bucket (module doc): the shards of what is launched
    (the bucket, or its dense part when some gradients are sparse) are ``plan_shards`` of
    its tensors with the compressor's ``shard_alignment`` (``plan_shards_per_tensor`` with
    ``per_tensor``: the DDP hook's)."""

    kind = "twostage"

    def __init__(
        self,
        transport: Transport,
        bucket: Bucket,
        alignment: int,
        finish_transport: Transport | None = None,
        per_tensor: bool = False,
    ) -> None:
        super().__init__(transport, finish_transport)
        self.alignment = alignment
        self.planner = plan_shards_per_tensor if per_tensor else plan_shards
        self._plans: dict[tuple[str, ...], list[list[Piece]]] = {}
        self.plan(bucket)

    def plan(self, bucket: Bucket) -> list[list[Piece]]:
        """The shards of ``bucket``'s tensors (computed once per set of tensors)."""
        key = tuple(bucket.names)
        if key not in self._plans:
            numels = [p.numel() for p in bucket.params]
            self._plans[key] = self.planner(
                bucket.names, numels, self.transport.size, self.alignment
            )
        return self._plans[key]

    def residual_keys(self, bucket: Bucket, comp) -> set:
        """Every piece's sender key, and the owner key of each piece this rank owns."""
        shards = self.plan(bucket)
        mine = shards[self.transport.rank] if self.transport.rank < len(shards) else []
        return {pc.sender_key for pcs in shards for pc in pcs} | {pc.owner_key for pc in mine}

    def state_shapes(self) -> dict[str, tuple[int]]:
        """The compressor state names this exchange makes on this rank (as a checkpoint
        writes them, ``str`` of the pieces' keys), and their shapes:
        a stage-1 entry per piece of every shard, a stage-2 entry per piece this rank owns
        (for checking a loaded checkpoint)."""
        shapes = {}
        for shards in self._plans.values():
            shapes.update({str(pc.sender_key): (pc.numel,) for pcs in shards for pc in pcs})
            shapes.update({str(pc.owner_key): (pc.numel,) for pc in shards[self.transport.rank]})
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
            frame, _ = framing.compress_bucket(
                comp,
                [flats[pc.tensor][pc.start : pc.stop] for pc in pieces],
                [pc.sender_key for pc in pieces],
            )
            parts.append(frame.to(self._bytes_device(frame.device)))
        ctxs = [
            Ctx(name, tuple(g.shape), g.dtype, g.device)
            for name, g in zip(bucket.names, grads, strict=True)
        ]
        handle = self.transport.start_alltoallv(parts, key=site(bucket, "stage1"))
        rank = self.transport.rank
        to_others = sum(p.numel() for j, p in enumerate(parts) if j != rank)
        collective = Collective(handle, sum(p.numel() for p in parts), to_others)
        return InFlight(ctxs, [collective], list(grads), shards=shards)

    def _finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        """Wait for stage 1, make this rank's stage-2 message (its re-compressed shard, or
        the report of a stage-1 payload it could not decode, or with ``decode`` False only
        a placeholder), run stage 2 and decode it. Stage 2 runs on every rank in every
        case, so no rank is left waiting in it."""
        try:
            received, stage1_error = waited(flight, flight.collectives[0]), None
        except PayloadError as err:  # a slot this rank could not read (transports.slots)
            received, stage1_error = None, err
        t1 = time.perf_counter()
        local_error = None  # raised after stage 2, which every rank must take part in
        device = self._bytes_device(flight.ctxs[0].device if flight.ctxs else None)
        message = torch.tensor([STATUS_DRAINING], dtype=torch.uint8, device=device)
        if decode:
            try:
                if stage1_error is not None:  # every rank learns of it from the report
                    message = _failed_message(stage1_error, stage1_error.rank, None)
                else:
                    message = self._owner_message(comp, flight, received, scale)
                message = message.to(device)
            except Exception as err:  # noqa: BLE001 - the others learn of it from the status
                local_error = err
        t2 = time.perf_counter()
        flight.decode_s += t2 - t1
        size = self.transport.size
        stage2 = Collective(
            self.finish_transport.start_allgatherv(message, key=site(bucket, "stage2")),
            message.numel(),
            (size - 1) * message.numel(),
        )
        flight.collectives.append(stage2)
        result = stage2.handle.wait()
        t3 = time.perf_counter()
        flight.wait_s += t3 - t2  # from the start: an inline transport moves the bytes there
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
                framing.decode_frame(comp, frame, accs, ctxs, rank=sender)
            except PayloadError as err:
                return _failed_message(err, sender, _piece_of(flight.shards, err.tensor))
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
                    framing.decode_parsed(
                        comp,
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


def _piece_of(shards: list[list[Piece]], key: PieceKey | None) -> Piece | None:
    """The piece whose stage-1 or stage-2 state key is ``key``."""
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


def _failed_message(err: PayloadError, sender: int | None, piece: Piece | None) -> torch.Tensor:
    """The stage-2 message reporting a stage-1 payload this rank could not read."""
    body = json.dumps(_report(err, sender, 1, piece)).encode()
    return torch.tensor([STATUS_FAILED, *body], dtype=torch.uint8)


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
