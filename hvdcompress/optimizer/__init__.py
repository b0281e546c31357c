"""DistributedOptimizer: hvd.DistributedOptimizer with compressed gradients.

``DistributedOptimizer(optimizer, named_parameters, compression=..., backend=...)`` returns
an instance of a subclass of ``optimizer``'s class (as Horovod does), so it is a drop-in:
``loss.backward(); opt.step()``.

This package is the wrapper (``wrapper``: hooks, launch order, ``synchronize``/``step``,
checkpoints), built by ``factory``; ``options`` holds the op names and Horovod's keywords,
``process_sets`` the transport of a ``process_set``, ``adasum`` the ``op=hvd.Adasum`` path;
buckets and the agreement check are in ``buckets``, who sends what to whom in
``exchange``, the step record in ``stats`` (docs/design.md, "The gradient walk").

A post-accumulate-grad hook counts backward passes; when a bucket's gradients are all
ready, the policy observes them and the bucket's exchange compresses them and starts its
collective, overlapping the rest of backward. ``synchronize()`` (called by ``step()``)
starts what is left and finishes every bucket in order, draining every collective even
after an error so that no rank leaves one pending.

Horovod parity (docs/horovod-parity.md, "Horovod parity and the DDP hook"): every keyword of
``hvd.DistributedOptimizer`` 0.28.1 means what it means there: ``gradient_predivide_factor``
scales by 1/f before the exchange and f/size after; ``groups`` / ``num_groups`` make the
buckets; sparse gradients take an uncompressed sparse path (``sparse_grads``) unless
``sparse_as_dense``; ``process_set`` restricts every collective to the set (ranks outside
it step on their local gradients); ``op=hvd.Adasum`` returns Horovod's own Adasum optimizer
for a compression it has (none, fp16) and is refused for the others. Horovod's
attributes (``op``, ``process_set``, ``_parameter_names``, ...), warnings and errors are
the same, and ``hvd.broadcast_optimizer_state`` initialises state with the inner
optimizer's ``step()`` as it does for Horovod's own optimizer (``__module__`` in ``wrapper``).

Invariants: after ``synchronize()`` every rank holds bit-identical gradients on the gather
path; ranks that disagree on what they communicate get ``RankAgreementError`` at
construction, on every rank; a payload that fails to decode raises ``PayloadError``
naming the sending rank and tensor, on every rank. Compressor state is per rank:
``state_dict()`` carries it under ``"hvdcompress"``, and each rank saves its own; a state
saved by another rank (Horovod's rank-0 checkpoint recipe) loads with that rank's
error-feedback residuals left out and a warning (``load_state_dict``).
"""

# Every name the module hvdcompress/optimizer.py had (public and private), from where it
# lives now, so that user code and hvdcompress.DistributedOptimizer keep working.
from hvdcompress.buckets import RankAgreementError  # noqa: F401
from hvdcompress.checkpoint import PER_RANK_STATE, without_other_ranks_state  # noqa: F401
from hvdcompress.optimizer.adasum import _adasum_optimizer  # noqa: F401
from hvdcompress.optimizer.factory import DistributedOptimizer  # noqa: F401
from hvdcompress.optimizer.options import (  # noqa: F401
    Adasum,
    Average,
    HorovodOptions,
    Sum,
    _check_int,
    _normalize_op,
)
from hvdcompress.optimizer.process_sets import (  # noqa: F401
    _is_global,
    _OutsideProcessSet,
    _ranks_of,
    _transport_for,
)
from hvdcompress.optimizer.wrapper import (  # noqa: F401
    STATE_KEY,
    BackwardPassesError,
    NonFiniteGradientError,
    _check_dtypes,
    _DistributedOptimizer,
    _Launched,
)
from hvdcompress.stats import StepStats  # noqa: F401

__all__ = [
    "Adasum",
    "Average",
    "Sum",
    "DistributedOptimizer",
    "NonFiniteGradientError",
    "RankAgreementError",
    "StepStats",
]
