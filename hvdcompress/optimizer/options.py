"""The op names and Horovod's keywords of ``DistributedOptimizer``, and their checks."""

from __future__ import annotations

from dataclasses import dataclass

Average = "average"
Sum = "sum"
Adasum = "adasum"


def _normalize_op(op) -> str:
    if isinstance(op, str) and op in (Average, Sum, Adasum):
        return op
    # Horovod's ReduceOp values (horovod/common/basics.py): Average 0, Sum 1, Adasum 2.
    if isinstance(op, int) and not isinstance(op, bool) and op in (0, 1, 2):
        return (Average, Sum, Adasum)[op]
    raise ValueError(
        "op must be hvdcompress.Average, hvdcompress.Sum, hvd.Average (0), hvd.Sum (1) or "
        f"hvd.Adasum (2), got {op!r}"
    )


@dataclass(frozen=True)
class HorovodOptions:
    """The keywords of ``hvd.DistributedOptimizer`` (Horovod 0.28.1) beyond those every
    hvdcompress optimizer has, with Horovod's defaults and meaning (``num_groups``: folded
    into ``groups`` by the factory)."""

    gradient_predivide_factor: float = 1.0
    groups: object = None
    sparse_as_dense: bool = False
    process_set: object = None
