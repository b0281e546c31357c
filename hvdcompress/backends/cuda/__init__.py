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

The package (one module per kernel family and codec family): ``_runtime`` (CuPy, the
kernel families and their compiled modules, the launches on torch's stream, segment
tables, the kernels' constants), ``_bucket`` (the helpers a bucket's segment calls share),
``primitives``, ``threelc`` (3LC and its zero-run coder), ``frame`` (checksums and
frames), ``sign``, ``quant`` (QSGD, the packed codes, TernGrad), ``dqsg`` (DQSG's and
NDQSG's digits), ``sparse`` (top-k, top-k + sign, DGC) and ``sparse_random`` (random-k,
GSpar), each an attribute of the package once its names are imported below. Every name is
defined once, in one of them, and its public names re-exported here
(the protocol's operations, the kernel families, what tests and scripts name); private
names stay in their modules.
"""

from __future__ import annotations

from hvdcompress._native import NVRTC_OPTIONS, kernel_dir  # noqa: F401  (tests/gpu use them)
from hvdcompress.backends.cuda._bucket import splits  # noqa: F401  (re-exports)
from hvdcompress.backends.cuda._runtime import (  # noqa: F401  (re-exports)
    BLOCK,
    BLOCKS_PER_SM,
    DEVICE_TYPE,
    FAMILIES,
    FRAME,
    PRIMITIVES,
    QUANT,
    SEGMENT_TILE,
    SIGN,
    SPARSE,
    THREELC,
    TOPK_INDEX32_LIMIT,
    KernelFamily,
    gpu_unavailable_reason,
)
from hvdcompress.backends.cuda.dqsg import (  # noqa: F401  (re-exports)
    digits_decode_segments,
    digits_encode_segments,
    dqsg_decode_segments,
    dqsg_encode_segments,
    ndqsg_coset,
    ndqsg_side_decode,
)
from hvdcompress.backends.cuda.frame import (  # noqa: F401  (re-exports)
    checksum_segments,
    frame_scan,
    length_prefixes,
    store_checksums,
)
from hvdcompress.backends.cuda.primitives import (  # noqa: F401  (re-exports)
    bitpack,
    bitunpack,
    chunk_sums,
    nonfinite,
    uniform,
)
from hvdcompress.backends.cuda.quant import (  # noqa: F401  (re-exports)
    dqsg_dequantize,
    dqsg_quantize,
    qsgd_decode_segments,
    qsgd_encode_segments,
    terngrad_encode_segments,
)
from hvdcompress.backends.cuda.sign import (  # noqa: F401  (re-exports)
    efsign_encode_segments,
    efsign_sums_segments,
    sign_decode_segments,
    sign_encode_segments,
)
from hvdcompress.backends.cuda.sparse import (  # noqa: F401  (re-exports)
    TopKSignSelection,
    dgc_update,
    topk_decode_segments,
    topk_encode_segments,
    topk_select,
    topkq_decode_segments,
    topkq_select_segments,
    topkq_write_segments,
)
from hvdcompress.backends.cuda.sparse_random import (  # noqa: F401  (re-exports)
    gspar_draw,
    gspar_encode_segments,
    gspar_round,
    randomk_decode_segments,
    randomk_encode_segments,
)
from hvdcompress.backends.cuda.threelc import (  # noqa: F401  (re-exports)
    quantize,
    quartic_decode,
    quartic_encode,
    threelc_decode_segments,
    threelc_encode_segments,
    zero_run_decode,
    zero_run_encode,
)
