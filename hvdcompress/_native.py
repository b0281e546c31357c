"""The native sources' one source of truth: where they are, which files make the CPU
library, and the compiler flags of every compiler that builds them.

Standard library only: setup.py loads this file by path (importlib) without importing
the package (``hvdcompress/__init__`` imports torch), and shell scripts run it:

    python3 hvdcompress/_native.py nvrtc   # NVRTC_OPTIONS, one a line (check_kernels.sh)

The sources live side by side in the repo's top-level ``kernels/``, one family per file
pair, C for the CPU backend and CUDA for the GPU backend, byte for byte the same results
(docs/backends.md, "The kernel families"). ``setup.py`` builds the ``.c`` files into
``hvdcompress._codec_cpu`` and copies the whole folder into the installed package as
``hvdcompress/kernels`` (for NVRTC, and for the CPU backend's fallback compile when no
built library is there).
"""

from __future__ import annotations

import sys
from pathlib import Path

# IEEE arithmetic on a host compiler: every float operation rounded on its own (no FMA
# contraction of a - S * q, no fast-math), like the CUDA intrinsics __fadd_rn & co.
FP_FLAGS = ("-ffp-contract=off", "-fno-fast-math")
# The CPU library (C, cc / gcc): setup.py's Extension and backends/cpu/'s fallback.
C_FLAGS = ("-O3", "-std=c11", *FP_FLAGS, "-fno-math-errno")
# The .cu sources built for the host with g++ through kernels/cuda_host.h (the host-kernel
# tests add warnings as errors and the include path).
HOST_CXX_FLAGS = ("-std=c++17", "-O2", *FP_FLAGS)
# The .cu sources for the GPU: NVRTC at run time (backends/cuda/), and nvcc, which takes
# the same spelling, in scripts/check_kernels.sh. IEEE float32 everywhere (no FMA
# contraction, no flush to zero, IEEE division and square root).
NVRTC_OPTIONS = (
    "--std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
)

SOURCE_DIR = "kernels"  # in the repo, relative to its root; in the package, "kernels" too
# the CPU library, in SOURCE_DIR
C_SOURCES = ("threelc.c", "primitives.c", "sign.c", "quant.c", "sparse.c", "frame.c")
CPU_LIBRARY = "_codec_cpu"  # its extension module: hvdcompress._codec_cpu

PACKAGE_DIR = Path(__file__).resolve().parent


def kernel_dir() -> Path:
    """The folder of the native sources: the installed package's ``hvdcompress/kernels``
    (copied there by setup.py) when it is there, else the source tree's ``kernels/`` (a
    checkout on PYTHONPATH, or an editable install)."""
    packaged = PACKAGE_DIR / SOURCE_DIR
    if (packaged / "threelc.cu").is_file():
        return packaged
    return PACKAGE_DIR.parent / SOURCE_DIR


LISTS = {"c": C_FLAGS, "host-cxx": HOST_CXX_FLAGS, "nvrtc": NVRTC_OPTIONS, "c-sources": C_SOURCES}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in LISTS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(LISTS)}}}")
    print("\n".join(LISTS[sys.argv[1]]))
