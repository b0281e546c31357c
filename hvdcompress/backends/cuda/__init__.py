"""CUDA backend: the kernels of ``kernels/*.cu`` compiled by NVRTC through CuPy.

Same protocol and the same bytes as the CPU backend (``hvdcompress.backends``). Each .cu
file is one kernel family (``KernelFamily``: ``THREELC``, ``FRAME``, ``PRIMITIVES``,
``SIGN``, ``QUANT``, ``SPARSE``), compiled into its
own module once per process and device, on the first launch of one of its kernels, with
exactly ``NVRTC_OPTIONS`` (``hvdcompress._native``: FMA contraction, flush to zero and
approximate division turned off; ``_compile`` says why not through ``RawModule``). The
sources are found by ``kernel_dir()``: in ``hvdcompress/kernels/`` when the package was
installed with them, else in the source tree's ``kernels/`` (a checkout on PYTHONPATH).

Tensors stay torch tensors: kernels get their raw device pointers (zero-copy; the
tensors are alive for the whole call and every kernel and torch op of a call runs, in
order, on torch's current stream of the tensor's device, so the caching allocator's
stream-ordered reuse is safe). The scans of the zero-run coder are ``torch.cummax`` (in
two levels: ``_running_max``) and ``torch.cumsum`` on that stream. Each call makes one
small device-to-host copy (the handful of integers a call needs: output length, error
bits, scale, non-finite flag or checksum); the fused decode makes it before writing
anything, so a corrupt body raises ``PayloadError`` with ``out`` untouched. A bucket's
calls (the ``*_segments`` functions: 3LC, TernGrad, signSGD, EF-signSGD, QSGD, DQSG,
checksums) make at most that one copy for the whole bucket, after one launch
sequence over a segment table (kernels/threelc.cu section 7, sign.cu section 5, quant.cu
section 9); ``store_checksums`` and ``efsign_encode_segments`` make none. A frame
gathered on the device is scanned there (``frame_scan``, kernels/frame.cu section 3:
one read of a row per payload, not a copy of the frame).


The package (one module per kernel family and codec family; the same names as the one
module it was): ``_runtime`` (CuPy, the kernel families and their compiled modules, the
launches on torch's stream, segment tables, the kernels' constants), ``_bucket`` (the
helpers a bucket's segment calls share), ``primitives``, ``threelc`` (3LC and its zero-run
coder), ``frame`` (checksums and frames), ``sign``, ``quant`` (QSGD, the packed codes,
TernGrad), ``dqsg`` (DQSG's and NDQSG's digits), ``sparse`` (top-k, top-k + sign, DGC) and
``sparse_random`` (random-k, GSpar). Every name is defined once, in one of them, and
re-exported here; a name set here (the seams below, or a test's monkeypatch) is set in
every module that holds it, so patching the package patches what the code calls, as it did
the single module.
"""

from __future__ import annotations

import sys as _sys
from types import ModuleType as _ModuleType

from hvdcompress._native import NVRTC_OPTIONS, kernel_dir  # noqa: F401  (tests/gpu use them)
from hvdcompress.backends.cuda import (
    _bucket,
    _runtime,
    dqsg,
    frame,
    primitives,
    quant,
    sign,
    sparse,
    sparse_random,
    threelc,
)
from hvdcompress.backends.cuda._bucket import (  # noqa: F401  (re-exports)
    _bodies_on,
    _bucket_device,
    _check_residuals,
    _encode_bucket,
    _first_rows,
    _gather_bodies,
    _rows,
    splits,
)
from hvdcompress.backends.cuda._runtime import (  # noqa: F401  (re-exports)
    _FAMILY_OF,
    _MAX_RUN,
    _NULL,
    _PRIM_ERR_PADDING,
    _QUANT_ERR_CODE,
    _QUANT_ERR_NORM,
    _QUANT_SEG_BODY_LEN,
    _QUANT_SEG_DECODE_KEY,
    _QUANT_SEG_DELTAS,
    _QUANT_SEG_FLAGS,
    _QUANT_SEG_KEY,
    _QUANT_SEG_KS,
    _QUANT_SEG_QUARTIC,
    _QUANT_SEG_VALUE_TILE,
    _RUN_GROUP,
    _SEG_AUX,
    _SEG_BLEN,
    _SEG_BOFF,
    _SEG_COLS,
    _SEG_F32,
    _SEG_IN,
    _SEG_N,
    _SEG_QOFF,
    _SEG_TILE,
    _SIGN_SEG_OUT,
    _SPARSE_SEG_INDICES,
    _SPARSE_SEG_K,
    _SPARSE_SEG_N,
    _SPARSE_SEG_OUT,
    _SPARSE_SEG_SIGNS,
    _SPARSE_SEG_VALUES,
    _SPARSE_SEG_WIDE,
    _ST_ABSMAX,
    _ST_COUNT,
    _ST_ERROR,
    _ST_LAST,
    _ST_NONFINITE,
    _ST_SCALE,
    _ST_SUM,
    _STATE_WORDS,
    _ZERO_GROUP,
    BLOCK,
    BLOCKS_PER_SM,
    DEVICE_TYPE,
    ERR_BYTE,
    ERR_INPUT,
    ERR_LENGTH,
    ERR_OVERFLOW,
    ERR_PADDING,
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
    _check_tensor,
    _compile,
    _count,
    _cupy_stream,
    _device_index,
    _f32,
    _f32_bits,
    _find_reason,
    _import_cupy,
    _Launcher,
    _Module,
    _module,
    _modules,
    _modules_lock,
    _ptr,
    _read_state,
    _reason,
    _reason_lock,
    _Segments,
    _segments,
    _stacked_tilings,
    _tilings,
    _torch_stream,
    gpu_unavailable_reason,
)
from hvdcompress.backends.cuda.dqsg import (  # noqa: F401  (re-exports)
    _DQSG_ERRORS,
    _digits_ternary_decode,
    _digits_ternary_encode,
    digits_decode_segments,
    digits_encode_segments,
    dqsg_decode_segments,
    dqsg_encode_segments,
    ndqsg_coset,
    ndqsg_side_decode,
)
from hvdcompress.backends.cuda.frame import (  # noqa: F401  (re-exports)
    _FRAME_FIELDS,
    _FRAME_OK,
    _FRAME_PARAMS,
    _FRAME_PARAMS_LEN,
    _FRAME_ROW,
    _FRAME_SHAPE,
    _FRAME_STORED,
    _checksum_table,
    checksum_segments,
    frame_scan,
    length_prefixes,
    store_checksums,
)
from hvdcompress.backends.cuda.primitives import (  # noqa: F401  (re-exports)
    bitpack,
    bitunpack,
    chunk_sums,
    uniform,
)
from hvdcompress.backends.cuda.quant import (  # noqa: F401  (re-exports)
    _aliased,
    _aliasing_counts,
    _packed_bucket_decode,
    _packed_bucket_encode,
    _qsgd_refusal,
    dqsg_dequantize,
    dqsg_quantize,
    qsgd_decode_segments,
    qsgd_encode_segments,
    terngrad_encode_segments,
)
from hvdcompress.backends.cuda.sign import (  # noqa: F401  (re-exports)
    EF_CHUNK,
    efsign_encode_segments,
    efsign_sums_segments,
    sign_decode_segments,
    sign_encode_segments,
)
from hvdcompress.backends.cuda.sparse import (  # noqa: F401  (re-exports)
    _TOPK_BINS,
    _TOPK_SEG_BODY,
    _TOPK_SEG_FLAGS,
    _TOPK_SEG_K,
    _TOPK_SEG_U,
    _TOPKQ_SEG_A,
    _TOPKQ_SEG_BODY,
    TOPK_SAMPLE,
    TOPKQ_CHUNK,
    TopKSignSelection,
    _kept_decode_segments,
    _topk_candidates,
    _topk_select,
    _topk_table,
    dgc_update,
    topk_decode_segments,
    topk_encode_segments,
    topk_select,
    topkq_decode_segments,
    topkq_select_segments,
    topkq_write_segments,
)
from hvdcompress.backends.cuda.sparse_random import (  # noqa: F401  (re-exports)
    _GSPAR_SEG_CHUNK,
    gspar_draw,
    gspar_encode_segments,
    gspar_round,
    randomk_decode_segments,
    randomk_encode_segments,
)
from hvdcompress.backends.cuda.threelc import (  # noqa: F401  (re-exports)
    _SCAN_ROW,
    _body_error,
    _quantize_quartic,
    _quartic_bucket,
    _quartic_table,
    _running_max,
    _segment_bodies,
    _sparsity,
    _zre_check_segments,
    _zre_emit_scan,
    _zre_encode,
    _zre_encode_segments,
    _zre_expand_rows,
    _zre_prepare,
    quantize,
    quartic_decode,
    quartic_encode,
    threelc_decode_segments,
    threelc_encode_segments,
    zero_run_decode,
    zero_run_encode,
)

_SUBMODULES = (
    _runtime,
    _bucket,
    primitives,
    threelc,
    frame,
    sign,
    quant,
    dqsg,
    sparse,
    sparse_random,
)


class _Package(_ModuleType):
    """This package's module type: setting a name sets it in each submodule that holds it
    too (where the code reads it), then here."""

    def __setattr__(self, name: str, value) -> None:
        for module in _SUBMODULES:
            if name in vars(module):
                setattr(module, name, value)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
