"""CPU backend: the C library of ``kernels/*.c`` (``threelc.c``, ``primitives.c``,
``sign.c``, ``quant.c``, ``sparse.c``, ``frame.c``) called through ctypes.

The library is built by ``pip install`` (setup.py) as ``hvdcompress._codec_cpu``. When
the package runs without that build (a GPU node that only has the checkout on
PYTHONPATH), or a source is newer than it (an edited checkout), it is compiled once with
the system C compiler into ``$HVDC_CACHE`` (default ``~/.cache/hvdcompress``), keyed by a
hash of the sources and flags. Sources, flags and where to find them (the repo's
``kernels/`` or the installed package's copy) come from ``hvdcompress._native``.

Each call passes raw data pointers of contiguous tensors; the C functions neither
allocate nor keep pointers, so the GIL is released (ctypes does this) and tensors stay
owned by torch. The package binds the protocol's operations from its modules
(``protocol.bind_operations``) and re-exports the CPU-only extras and what tests and the
codecs name. Each operation's signature, types and contract are the protocol's
(``backends.protocol``); a module's docstrings say only how the CPU does it. An operation
without a docstring of its own is one native call (the sign encoders and EF-signSGD's sums: a
call a part for a tensor the codec threads cut, ``_library._Rows``).
"""

# ruff: noqa: F401 - re-exports

from hvdcompress.backends import protocol
from hvdcompress.backends.cpu._library import LIB, NONFINITE_BITS, _ptr, num_threads
from hvdcompress.backends.cpu.frame import frame_write
from hvdcompress.backends.cpu.sparse import TOPK_MIN_STRIDE, TOPK_SAMPLE
from hvdcompress.backends.cpu.threelc import scale_for

protocol.bind_operations(globals())
