"""CUDA backend: the kernels of ``kernels/*.cu`` compiled by NVRTC through CuPy.

Same protocol and the same bytes as the CPU backend (``hvdcompress.backends``). Each .cu
file is one kernel family (``KernelFamily``: ``THREELC``, ``FRAME``, ``PRIMITIVES``,
``SIGN``, ``QUANT``, ``SPARSE``), compiled into its own module once per process and device,
on the first launch of one of its kernels, with exactly ``NVRTC_OPTIONS``
(``hvdcompress._native``: FMA contraction, flush to zero and approximate division turned
off; ``_compile`` says why not through ``RawModule``). The sources are found by
``kernel_dir()``: in ``hvdcompress/kernels/`` when the package was installed with them,
else in the source tree's ``kernels/`` (a checkout on PYTHONPATH).

Tensors stay torch tensors: kernels get their raw device pointers (zero-copy; the tensors
are alive for the whole call and every kernel and torch op of a call runs, in order, on
torch's current stream of the tensor's device, so the caching allocator's stream-ordered
reuse is safe). The scans of the zero-run coder are ``torch.cummax`` (in two levels:
``_running_max``) and ``torch.cumsum`` on that stream. Device-to-host copies are few and
small (a bucket's ``*_segments`` call: mostly one for the whole bucket, after one launch
sequence over a segment table); a decode reads its checks before writing anything, so a
corrupt body leaves ``out`` untouched. Each operation's signature, types and contract
are the protocol's (``backends.protocol``); a function's docstring counts its launches and
reads.

The package: ``_runtime`` (CuPy, the kernel families, the launches on torch's stream,
segment tables, the kernels' constants), ``_bucket`` (what a bucket's segment calls share)
and a module per codec family, each described by its docstring. Every name is defined once;
the package binds the protocol's operations (``protocol.bind_operations``) and re-exports
the kernel families and what tests and scripts name.
"""

# ruff: noqa: F401 - re-exports

from hvdcompress._native import NVRTC_OPTIONS, kernel_dir
from hvdcompress.backends import protocol
from hvdcompress.backends.cuda._runtime import (
    FAMILIES,
    FRAME,
    PRIMITIVES,
    QUANT,
    SIGN,
    SPARSE,
    THREELC,
    KernelFamily,
    gpu_unavailable_reason,
)
from hvdcompress.backends.cuda.frame import length_prefixes

protocol.bind_operations(globals())
