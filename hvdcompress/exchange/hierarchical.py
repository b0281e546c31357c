"""The hierarchical exchange: full precision inside a node, compressed across nodes
(docs/exchanges.md, "The hierarchical exchange"), as Horovod's hierarchical allreduce,
BytePS and CGX split the two links.

For a job of M nodes x K ranks (``transports.topology``), a bucket goes in three stages:

1. **Inside the node, a reduce-scatter in float32** (one alltoallv on the node's
   transport): the bucket's flat gradient is cut into K shards (``plan_shards``, per
   tensor, aligned for the codec), local rank j receives every local rank's part of shard j
   and sums them in local-rank order: the node's sum of shard j.
2. **Across nodes, the compressed exchange of that shard** among the ranks with the same
   local rank (the cross-node transport): the allgather or the two-stage exchange of the
   node sums' pieces, each piece a tensor of its own to the compressor (its error-feedback
   residual is the node's, keyed ``name[a:b]``), averaged over all M x K ranks.
3. **Inside the node, an allgather** of the averaged shards (a status word, then float32),
   written into every rank's gradients.

Bytes across a node's link per step: stage 2 only, that is the K local ranks' compressed
shards of the node sum, about one rank's compressed gradient in all, whatever K.

Invariants: every rank runs every stage of every bucket it started, in the same order
(stage 3 runs even after a stage-2 error, carrying the error as its status), so no
rank is left waiting; a payload that fails to decode in stage 2 raises its
``PayloadError`` on the ranks that decoded it (one per node) and a ``PayloadError``
naming that local rank on the others; every rank ends with bit-identical gradients
(stage 1 sums in a fixed order on one rank, stage 2's ranks decode the same payloads in
the same order, stage 3 hands every rank the same bytes).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hvdcompress.buckets import Bucket, PieceKey
from hvdcompress.compressors import GatherCompressor
from hvdcompress.errors import PayloadError
from hvdcompress.exchange.allgather import GatheredExchange
from hvdcompress.exchange.base import Collective, InFlight, _Exchange, site, waited
from hvdcompress.exchange.twostage import TwoStageExchange, plan_shards
from hvdcompress.transports import Transport, topology
from hvdcompress.transports.simulated import sum_in_rank_order
from hvdcompress.transports.topology import Topology

STATUS_OK, STATUS_FAILED = 0, 1


@dataclass
class _Stages:
    """What ``start`` leaves for ``finish``: the shard plan, this rank's shard pieces (the
    node sum, averaged in place by stage 2) and stage 2's own in-flight bucket."""

    shards: list
    pieces: list[torch.Tensor]
    names: list[PieceKey]
    cross: InFlight | None


class HierarchicalExchange(_Exchange):
    """Reduce-scatter inside the node, compressed exchange across nodes, allgather inside
    the node (module doc). ``intra`` / ``cross``: this rank's node and cross-node
    transports (``Transport.split`` of ``nodes``' groups); across nodes the allgather,
    or with ``two_stage`` the two-stage exchange; ``intra_finish`` / ``cross_finish``:
    where the later stages start (the DDP hook's finisher thread has its own)."""

    kind = "hierarchical"

    def __init__(
        self,
        transport: Transport,
        nodes: Topology,
        intra: Transport,
        cross: Transport,
        *,
        two_stage: bool = False,
        intra_finish: Transport | None = None,
        cross_finish: Transport | None = None,
    ) -> None:
        super().__init__(transport)
        self.topology, self.intra, self.cross = nodes, intra, cross
        self.intra_finish = intra_finish or intra
        self.cross_finish = cross_finish or cross
        self.two_stage = two_stage  # across nodes: two-stage, else the allgather
        self._plans: dict[tuple, list] = {}
        self._inner: dict[tuple, _Exchange] = {}  # the cross-node exchange of each shard
        self._state_shapes: dict[str, tuple[int, ...]] = {}

    def cross_exchange(self, shard: Bucket, comp: GatherCompressor) -> _Exchange:
        """The compressed exchange of this rank's shard of a bucket across nodes."""
        key = tuple(shard.names)
        if key not in self._inner:
            if self.two_stage:
                self._inner[key] = TwoStageExchange(
                    self.cross, shard, comp.shard_alignment(), self.cross_finish
                )
            else:
                self._inner[key] = GatheredExchange(self.cross, self.cross_finish)
        return self._inner[key]

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._state_shapes)

    def residual_keys(self, bucket: Bucket, comp: GatherCompressor) -> set:
        """The keys of the cross-node exchange of this rank's shard (its pieces, or with
        the two-stage exchange across nodes, the pieces of those)."""
        mine = self.plan(bucket, comp)[self.intra.rank]
        if not mine:
            return set()
        names = [_piece_name(pc) for pc in mine]
        sizes = [torch.empty(pc.stop - pc.start, device="meta") for pc in mine]  # numels only
        shard = Bucket(bucket.index, sizes, names)
        return self.cross_exchange(shard, comp).residual_keys(shard, comp)

    def plan(self, bucket: Bucket, comp: GatherCompressor) -> list:
        """The bucket's K shards (``plan_shards``), made once per set of tensors; this
        rank's pieces become compressor state names (``state_shapes``), so a checkpoint
        of them loads before the first step."""
        key = tuple(bucket.names)
        if key not in self._plans:
            numels = [p.numel() for p in bucket.params]
            shards = plan_shards(
                list(bucket.names), numels, self.intra.size, comp.shard_alignment()
            )
            self._plans[key] = shards
            for pc in shards[self.intra.rank]:
                self._state_shapes[str(_piece_name(pc))] = (pc.stop - pc.start,)
        return self._plans[key]

    def start(self, bucket: Bucket, comp: GatherCompressor, grads: list[torch.Tensor]) -> InFlight:
        shards = self.plan(bucket, comp)
        flats = [g.reshape(-1) for g in grads]
        parts = [
            _cat([flats[pc.tensor][pc.start : pc.stop] for pc in pieces]).view(torch.uint8)
            for pieces in shards
        ]
        stage1 = self.intra.start_alltoallv(parts, key=site(bucket, "intra1"))
        flight = InFlight([], [], list(grads), shards=shards)
        received = waited(flight, Collective(stage1, 0, 0.0))  # the fast link: wait here
        node_sum = sum_in_rank_order([r.view(torch.float32) for r in received])
        mine = shards[self.intra.rank]
        pieces = list(node_sum.split([pc.stop - pc.start for pc in mine])) if mine else []
        names = [_piece_name(pc) for pc in mine]
        cross = None
        if mine:
            shard_bucket = Bucket(bucket.index, pieces, names)
            cross = self.cross_exchange(shard_bucket, comp).start(shard_bucket, comp, pieces)
            flight.ctxs, flight.collectives = cross.ctxs, cross.collectives
        flight.stages = _Stages(shards, pieces, names, cross)
        return flight

    def _finish(self, bucket: Bucket, comp, flight: InFlight, scale: float, decode: bool) -> None:
        stages: _Stages = flight.stages
        error, status = None, STATUS_OK
        if stages.cross is not None:
            shard_bucket = Bucket(bucket.index, stages.pieces, stages.names)
            try:  # the average of every rank's shard, written into the pieces
                inner = self.cross_exchange(shard_bucket, comp)
                inner.finish(shard_bucket, comp, stages.cross, scale, decode)
            except PayloadError as err:  # the sender by its global rank, on every rank
                error, status = err, STATUS_FAILED
                if err.rank is not None:
                    error = err.renamed(self.topology.nodes[err.rank][self.intra.rank])
            except Exception as err:  # noqa: BLE001 - stage 3 must still run on every rank
                error, status = err, STATUS_FAILED
            flight.wait_s += stages.cross.wait_s
            flight.decode_s += stages.cross.decode_s
        if not decode:
            status = STATUS_FAILED
        mine = _cat(stages.pieces).view(torch.uint8)
        # a 4-byte status first, so that every part's floats stay 4-byte aligned: the
        # status, then the global rank a failed payload came from, plus one (0: none)
        blamed = getattr(error, "rank", None) if isinstance(error, PayloadError) else None
        word = [status, *((0 if blamed is None else blamed + 1).to_bytes(3, "little"))]
        message = torch.cat([torch.tensor(word, dtype=torch.uint8), mine.cpu()])
        handle = self.intra_finish.start_allgatherv(message, key=site(bucket, "intra3"))
        stage3 = Collective(handle, message.numel(), 0.0)
        gathered, sizes = waited(flight, stage3)
        parts = list(gathered.split(sizes))
        if error is not None:
            raise error
        failed = [j for j, part in enumerate(parts) if int(part[0]) != STATUS_OK]
        if failed and decode:
            node = self.topology.node_of(self.transport.rank)
            ranks = [self.topology.nodes[node][j] for j in failed]
            blamed = [int.from_bytes(bytes(parts[j][1:4].tolist()), "little") for j in failed]
            senders = [b - 1 for b in blamed if b]
            raise PayloadError(
                "frame",
                f"the cross-node stage of the hierarchical exchange failed on rank(s) {ranks} "
                "of this node (their own error names the payload)",
                rank=senders[0] if senders else ranks[0],
            )
        if not decode:
            return
        flats = [g.reshape(-1) for g in flight.grads]
        for pieces, part in zip(stages.shards, parts, strict=True):
            values = part[4:].view(torch.float32)
            offset = 0
            for pc in pieces:
                n = pc.stop - pc.start
                flats[pc.tensor][pc.start : pc.stop].copy_(values[offset : offset + n])
                offset += n


def _piece_name(pc) -> PieceKey:
    """The compressor-state key of a piece of this rank's shard: ``name[a:b]``, the same
    on every rank of its cross-node group (they own the same pieces)."""
    return PieceKey(pc.name, pc.start, pc.stop)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(
        [t.detach().reshape(-1).to(device="cpu", dtype=torch.float32) for t in tensors]
    )


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport -> exchanges
_TOPOLOGY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport -> Topology


def node_topology(transport: Transport) -> Topology:
    """``topology.detect(transport)``, once per transport (collective the first time)."""
    known = _TOPOLOGY.get(transport)
    if known is None:
        known = _TOPOLOGY[transport] = topology.detect(transport)
    return known


def hierarchical_open(transport: Transport) -> bool:
    """Whether the hierarchical exchange can serve ``transport``'s ranks and send fewer
    bytes across nodes than a flat one: a transport that splits, on several nodes of the
    same K > 1 ranks each (collective the first time: ``node_topology``)."""
    if not transport.splits or transport.size < 4:
        return False
    top = node_topology(transport)
    return len(top.nodes) > 1 and (top.ranks_per_node or 1) > 1


def hierarchical_exchange(
    transport: Transport, compressor: GatherCompressor, finish_transport: Transport | None = None
) -> HierarchicalExchange:
    """The hierarchical exchange of ``transport``'s ranks, on the topology it detects
    (``transports.topology.detect``): its node and cross-node transports split from
    ``transport`` (and from ``finish_transport`` for stage 3 and the cross-node stage's
    later collectives, when it is another). Made once per pair of transports (the splits
    are collective: every rank makes them at the same point); across two nodes the
    cross-node stage is an allgather, across more the two-stage exchange where the codec
    allows it."""
    finish_transport = finish_transport or transport
    built = _BUILT.setdefault(transport, {})
    key = (id(finish_transport), compressor.recompressible)
    if key in built:
        return built[key]
    top = node_topology(transport)
    per_node = top.ranks_per_node
    if per_node is None:
        raise ValueError(
            "exchange='hierarchical' needs the same number of ranks on every node, got nodes "
            f"{top.nodes} (HVDC_RANKS_PER_NODE sets it where the launcher does not)"
        )
    cross_groups = [tuple(node[j] for node in top.nodes) for j in range(per_node)]
    intra, cross = transport.split(top.nodes), transport.split(cross_groups)
    if finish_transport is transport:
        intra_finish, cross_finish = intra, cross
    else:
        intra_finish = finish_transport.split(top.nodes)
        cross_finish = finish_transport.split(cross_groups)
    built[key] = HierarchicalExchange(
        transport, top, intra, cross, two_stage=len(top.nodes) > 2 and compressor.recompressible,
        intra_finish=intra_finish, cross_finish=cross_finish,
    )  # fmt: skip
    return built[key]
