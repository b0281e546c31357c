"""Builds the CPU codec library (plain C, loaded with ctypes) and ships the CUDA sources.

Metadata lives in setup.cfg. The C library has no Python API on purpose: the
backends call it through ctypes on tensors' data pointers, so it builds with any C
compiler and needs no Python or torch headers.
"""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# The flags that make the CPU bytes match the CUDA bytes: no fast-math and no
# contraction of a - S * q into an FMA.
C_FLAGS = ["-O3", "-std=c11", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]


class BuildPyWithKernels(build_py):
    """Copy kernels/*.cu into the package so that installed wheels can JIT them with CuPy."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "hvdcompress" / "kernels"
        target.mkdir(parents=True, exist_ok=True)
        for src in Path("kernels").glob("*.cu*"):
            shutil.copy2(src, target / src.name)
        for src in Path("kernels").glob("*.h"):
            shutil.copy2(src, target / src.name)


setup(
    ext_modules=[
        Extension(
            "hvdcompress._codec_cpu",
            sources=["hvdcompress/csrc/threelc_cpu.c", "hvdcompress/csrc/baselines_cpu.c"],
            extra_compile_args=C_FLAGS,
        )
    ],
    cmdclass={"build_py": BuildPyWithKernels},
)
