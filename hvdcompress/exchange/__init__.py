"""The exchange: who sends what to whom, per bucket (docs/exchanges.md).

``choose_exchanges`` gives each bucket one, from the compressor's kind and the
optimizer's ``exchange=`` ("auto", "allgather", "twostage"): ``SummedExchange`` (summable
compressors: one allreduce per phase), ``GatheredExchange`` (one allgather of every
rank's bucket frame, decoded by every rank in rank order) or ``TwoStageExchange`` (a
compressed reduce-scatter, then an allgather of re-compressed shards).

Each averages in place the gradient tensors it was handed (the optimizer's ``p.grad``,
the DDP hook's views of its bucket buffer; no exchange touches a parameter): ``start``
returns the bucket's ``InFlight``, whose ``future`` ``finish`` completes with those
tensors or with the error. Invariants: every rank starts the same collectives in the
same order (the two-stage exchange runs stage 2 of every bucket it started, even while
draining after an error); on the gather paths every rank decodes the same bytes in the
same order, so all ranks hold bit-identical gradients; a payload that fails to decode
raises ``PayloadError`` naming the sending rank, the tensor (and the stage), on every
rank.
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
    PIECE,
    STATUS_DRAINING,
    STATUS_FAILED,
    STATUS_OK,
    Piece,
    TwoStageExchange,
    plan_shards,
    plan_shards_per_tensor,
)

__all__ = [
    "EXCHANGES",
    "LOW_PRECISION",
    "PIECE",
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
    "plan_shards_per_tensor",
    "twostage_bytes",
]
