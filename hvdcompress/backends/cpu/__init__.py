"""CPU backend: the C library of ``kernels/*.c`` (``threelc.c``, ``primitives.c``,
``sign.c``, ``quant.c``, ``sparse.c``, ``frame.c``) called through ctypes.

The library is built by ``pip install`` (setup.py) as ``hvdcompress._codec_cpu``. When
the package runs without that build (a GPU node that only has the checkout on
PYTHONPATH), or a source is newer than it (an edited checkout), it is compiled once with
the system C compiler into ``$HVDC_CACHE`` (default ``~/.cache/hvdcompress``), keyed by a
hash of the sources and flags. Sources, flags and where to find them (the repo's
``kernels/`` or the installed package's copy) come from ``hvdcompress._native``.

Each call passes raw data pointers of contiguous tensors; the C functions neither
allocate nor keep pointers, so the GIL is released (ctypes does this) and tensors
stay owned by torch. The package re-exports the protocol's operations, the CPU-only
extras and what tests and the codecs name; private names stay in their modules. Each
operation's signature, types and contract are the protocol's (``backends.protocol``);
a module's docstrings say only how the CPU does it.
"""

from hvdcompress.backends.cpu._library import (  # noqa: F401  (re-exports)
    LIB,
    NONFINITE_BITS,
    _ptr,
    num_threads,
    splits,
)
from hvdcompress.backends.cpu.frame import (  # noqa: F401  (re-exports)
    checksum_segments,
    frame_scan,
    frame_write,
    store_checksums,
)
from hvdcompress.backends.cpu.primitives import (  # noqa: F401  (re-exports)
    bitpack,
    bitunpack,
    chunk_sums,
    nonfinite,
    uniform,
)
from hvdcompress.backends.cpu.quant import (  # noqa: F401  (re-exports)
    digits_decode_segments,
    digits_encode_segments,
    dqsg_decode_segments,
    dqsg_dequantize,
    dqsg_encode_segments,
    dqsg_quantize,
    ndqsg_coset,
    ndqsg_side_decode,
    qsgd_decode_segments,
    qsgd_encode_segments,
    terngrad_encode_segments,
)
from hvdcompress.backends.cpu.sign import (  # noqa: F401  (re-exports)
    efsign_encode_segments,
    efsign_sums_segments,
    sign_decode_segments,
    sign_encode_segments,
)
from hvdcompress.backends.cpu.sparse import (  # noqa: F401  (re-exports)
    _TOPKQ_ERRORS,
    TOPK_MIN_STRIDE,
    TOPK_SAMPLE,
    TopKSignSelection,
    dgc_update,
    gspar_draw,
    gspar_encode_segments,
    gspar_round,
    randomk_decode_segments,
    randomk_encode_segments,
    topk_decode_segments,
    topk_encode_segments,
    topk_select,
    topkq_decode_segments,
    topkq_select_segments,
    topkq_write_segments,
)
from hvdcompress.backends.cpu.threelc import (  # noqa: F401  (re-exports)
    quantize,
    quartic_decode,
    quartic_encode,
    scale_for,
    threelc_decode_segments,
    threelc_encode_segments,
    zero_run_decode,
    zero_run_encode,
)
