"""Builds the CPU codec library (plain C, loaded with ctypes) and ships the native sources.

Metadata lives in setup.cfg. The C library has no Python API on purpose: the
backends call it through ctypes on tensors' data pointers, so it builds with any C
compiler and needs no Python or torch headers. Its sources, their flags and the CUDA
sources are described once, in hvdcompress/_native.py (loaded here by path: importing
the package would import torch).
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


def _load_native():
    spec = importlib.util.spec_from_file_location(
        "hvdcompress_native", Path(__file__).resolve().parent / "hvdcompress" / "_native.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native = _load_native()


class BuildPyWithKernels(build_py):
    """Copy kernels/ (.cu, .h and .c) into the package as hvdcompress/kernels, so that
    installed wheels can JIT the CUDA kernels with CuPy and the CPU backend can compile
    its library again if needed."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "hvdcompress" / native.SOURCE_DIR
        target.mkdir(parents=True, exist_ok=True)
        for pattern in ("*.cu", "*.cuh", "*.h", "*.c"):
            for src in Path(native.SOURCE_DIR).glob(pattern):
                shutil.copy2(src, target / src.name)


setup(
    ext_modules=[
        Extension(
            f"hvdcompress.{native.CPU_LIBRARY}",
            sources=[f"{native.SOURCE_DIR}/{name}" for name in native.C_SOURCES],
            extra_compile_args=list(native.C_FLAGS),
        )
    ],
    cmdclass={"build_py": BuildPyWithKernels},
)
