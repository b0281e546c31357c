"""The exchange: who sends what to whom, per bucket (docs/exchanges.md; the per-step
driver: docs/design.md, "The exchange").

``choose_exchanges`` gives each bucket a ``SummedExchange`` (summable compressors: one
allreduce per phase), a ``GatheredExchange`` (one allgather of every rank's bucket frame)
or a ``TwoStageExchange`` (a compressed reduce-scatter, then an allgather of
re-compressed shards). Each averages in place the gradient tensors it is handed:
``start`` returns the bucket's ``InFlight``, which ``finish`` completes (no future per
bucket: the DDP hook returns one future per call).

Invariants: every rank starts the same collectives in the same order (the two-stage
exchange runs stage 2 of every bucket it started, even while draining after an error);
on the gather paths every rank decodes the same bytes in the same order, so all ranks
hold bit-identical gradients; a payload that fails to decode raises ``PayloadError``
naming the sending rank and the tensor, on every rank.
"""

from hvdcompress.exchange.allgather import GatheredExchange
from hvdcompress.exchange.base import InFlight
from hvdcompress.exchange.choose import (
    EXCHANGES,
    ExchangePlan,
    PayloadEstimate,
    allgather_bytes,
    check_exchange,
    check_mode,
    choose_exchanges,
    estimate_payload,
    twostage_bytes,
)
from hvdcompress.exchange.hierarchical import HierarchicalExchange, hierarchical_exchange
from hvdcompress.exchange.summed import SummedExchange
from hvdcompress.exchange.twostage import (
    Piece,
    TwoStageExchange,
    plan_shards,
    plan_shards_per_tensor,
)

__all__ = [
    "EXCHANGES",
    "ExchangePlan",
    "GatheredExchange",
    "HierarchicalExchange",
    "InFlight",
    "PayloadEstimate",
    "Piece",
    "SummedExchange",
    "TwoStageExchange",
    "allgather_bytes",
    "check_exchange",
    "check_mode",
    "choose_exchanges",
    "estimate_payload",
    "hierarchical_exchange",
    "plan_shards",
    "plan_shards_per_tensor",
    "twostage_bytes",
]
