"""Policies: pick a compression level per tensor during training (docs/policies.md).

The interface is ``Policy`` (hvdcompress.policies.base); Accordion and CAT implement it.
"""

from hvdcompress.policies.accordion import Accordion, accordion_critical
from hvdcompress.policies.base import Policy
from hvdcompress.policies.cat import CAT, cat_best_budget
from hvdcompress.transports.cost import AffineCost, CostModel, PacketCost, calibrate

__all__ = [
    "CAT",
    "Accordion",
    "AffineCost",
    "CostModel",
    "PacketCost",
    "Policy",
    "accordion_critical",
    "calibrate",
    "cat_best_budget",
]
