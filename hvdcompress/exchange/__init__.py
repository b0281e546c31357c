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

from hvdcompress.exchange.allgather import GatheredExchange
from hvdcompress.exchange.base import LOW_PRECISION, Collective, InFlight
from hvdcompress.exchange.choose import (
    EXCHANGES,
    PROBE_NUMEL,
    PayloadEstimate,
    allgather_bytes,
    choose_exchanges,
    estimate_payload,
    twostage_bytes,
)
from hvdcompress.exchange.summed import SummedExchange
from hvdcompress.exchange.twostage import (
    STATUS_DRAINING,
    STATUS_FAILED,
    STATUS_OK,
    Piece,
    TwoStageExchange,
    plan_shards,
)

__all__ = [
    "EXCHANGES",
    "LOW_PRECISION",
    "PROBE_NUMEL",
    "STATUS_DRAINING",
    "STATUS_FAILED",
    "STATUS_OK",
    "Collective",
    "GatheredExchange",
    "InFlight",
    "PayloadEstimate",
    "Piece",
    "SummedExchange",
    "TwoStageExchange",
    "allgather_bytes",
    "choose_exchanges",
    "estimate_payload",
    "plan_shards",
    "twostage_bytes",
]
