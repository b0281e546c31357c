"""DistributedOptimizer: hvd.DistributedOptimizer with compressed gradients.

``DistributedOptimizer(optimizer, named_parameters, compression=..., backend=...)`` returns
an instance of a subclass of ``optimizer``'s class (as Horovod does), so it is a drop-in:
``loss.backward(); opt.step()``. ``factory`` checks the arguments and builds the wrapper
(``wrapper``: hooks, launch order, ``synchronize``/``step``, checkpoints); ``options``
holds the op names and Horovod's keywords, ``process_sets`` the transport of a
``process_set``, ``adasum`` the ``op=hvd.Adasum`` path (docs/design.md, "The gradient
walk"; every keyword means what it means in Horovod 0.28.1: docs/horovod-parity.md).

Invariants: after ``synchronize()`` every rank holds bit-identical gradients on the gather
path; ranks that disagree on what they communicate get ``RankAgreementError`` at
construction, on every rank; a payload that fails to decode raises ``PayloadError``
naming the sending rank and tensor, on every rank. Compressor state is per rank: each
rank saves its own under ``"hvdcompress"``; another rank's state loads without its
error-feedback residuals, with a warning.
"""

from hvdcompress.buckets import RankAgreementError
from hvdcompress.optimizer.factory import DistributedOptimizer
from hvdcompress.optimizer.options import Adasum, Average, Sum
from hvdcompress.optimizer.wrapper import NonFiniteGradientError
from hvdcompress.stats import StepStats

__all__ = [
    "Adasum",
    "Average",
    "Sum",
    "DistributedOptimizer",
    "NonFiniteGradientError",
    "RankAgreementError",
    "StepStats",
]
