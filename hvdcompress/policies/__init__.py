"""Policies: pick a compression level per tensor during training (SPEC sections 5 and 6).

A policy is given to ``hvdcompress.DistributedOptimizer(..., policy=...)``, which calls
``bind(optimizer, compressor, transport, names)`` once, ``observe(name, grad)`` for every
uncompressed local gradient just before it is compressed, and ``after_step()`` once every
rank has the step's averaged gradients (all collectives of the step are done, so a
policy's own small agreement collective cannot interleave with them). Its
``pop_metrics()`` goes into ``optimizer.last_stats.metrics``.
"""

from hvdcompress.policies.accordion import Accordion, accordion_critical
from hvdcompress.policies.cat import (
    CAT,
    AffineCost,
    CostModel,
    PacketCost,
    calibrate,
    cat_best_budget,
)

__all__ = [
    "CAT",
    "Accordion",
    "AffineCost",
    "CostModel",
    "PacketCost",
    "accordion_critical",
    "calibrate",
    "cat_best_budget",
]
