"""Shared by the host-kernel tests: the kernels/*.cu sources built for the host with g++
(kernels/cuda_host.h) behind the C++ drivers of this folder, their launch shapes, and a
stand-in for CuPy that runs hvdcompress/backends/cuda/ on CPU tensors with them.

No GPU is needed. The stand-in launches the host-built kernels like cuLaunchKernel (a
pointer to each argument's value, host_launch in host_launch.h), after checking every
argument's numpy type against the parameter list parsed from the .cu source: on a GPU a
wrong argument type would be read with the wrong size.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from hvdcompress import _native

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / _native.SOURCE_DIR
HOST = Path(__file__).resolve().parent
CXX = os.environ.get("HVDC_HOST_CXX") or shutil.which("g++")
CXXFLAGS = [*_native.HOST_CXX_FLAGS, "-Wall", "-Wextra", "-Werror", f"-I{KERNELS}"]
if os.environ.get("HVDC_SANITIZE"):  # run_tests.sh's sanitizer stage: the CUDA sources too
    CXXFLAGS += [f"-fsanitize={os.environ['HVDC_SANITIZE']}", "-fno-sanitize-recover=all"]

# (most blocks, threads per block): a full grid, a few blocks looping, one warp looping.
LAUNCHES = [(1024, 256), (3, 64), (1, 32)]

P = ctypes.c_void_p
I64 = ctypes.c_longlong
U32 = ctypes.c_uint


def compile_host(out: Path, source: Path, *extra: str) -> None:
    """g++ with CXXFLAGS (warnings are errors); fails the test with the compiler's output."""
    cmd = [CXX, *CXXFLAGS, *extra, str(source), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}{res.stderr}"


def ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data


class HostLibrary:
    """ctypes view of one driver of this folder built as a shared library: host_set_launch
    and host_launch (host_launch.h), plus the driver's own ``SIGNATURES``."""

    SIGNATURES: dict[str, tuple] = {}

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        sig = {
            "host_set_launch": (None, [U32, U32]),
            "host_launch": (ctypes.c_int, [ctypes.c_char_p, U32, U32, P]),
            **self.SIGNATURES,
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def launch_shape(self, max_grid: int, block: int) -> None:
        self.lib.host_set_launch(max_grid, block)


def build_host_library(cls, driver: str, kernel_file: str, tmp_path_factory):
    """Build tests/host_kernels/<driver> into a shared library and wrap it in ``cls``;
    skips when there is no C++ compiler."""
    if CXX is None:
        pytest.skip(
            f"g++ not found: the host build of kernels/{kernel_file} needs a C++17 compiler"
        )
    out = tmp_path_factory.mktemp(Path(driver).stem) / f"lib{Path(driver).stem}.so"
    compile_host(out, HOST / driver, "-shared", "-fPIC")
    return cls(out)


@pytest.fixture(params=LAUNCHES, ids=lambda c: f"grid{c[0]}x{c[1]}")
def shaped(host, request):
    """The module's ``host`` library under each launch shape of LAUNCHES."""
    host.launch_shape(*request.param)
    yield host
    host.launch_shape(*LAUNCHES[0])


# ---- the CUDA backend's Python code on the host kernels ----------------------------------

# C parameter type in kernels/*.cu -> the numpy scalar type cuda.py must pass.
ARG_DTYPES = {
    "pointer": np.uint64,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "float": np.float32,
    "int": np.int32,
    "unsigned char": np.uint8,
}


def kernel_signatures(source: str) -> dict[str, list[str]]:
    sigs = {}
    for match in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source):
        params = []
        for param in match.group(2).split(","):
            words = param.replace("__restrict__", " ").replace("*", " * ").split()
            if "*" in words:
                params.append("pointer")
            else:
                params.append(" ".join(w for w in words[:-1] if w != "const"))
        sigs[match.group(1)] = params
    return sigs


class _NoOpContext:
    attributes = {"MultiProcessorCount": 2}  # few blocks: grid-stride loops do run

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class _FakeKernel:
    def __init__(self, lib, name: str, params: list[str], calls: list[str]):
        self.lib, self.name, self.params, self.calls = lib, name, params, calls

    def __call__(self, grid, block, args, **kwargs):
        assert not kwargs
        assert len(grid) == 1 and grid[0] >= 1, grid
        assert len(block) == 1 and block[0] % 32 == 0, block
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments"
        values = []
        for i, (arg, param) in enumerate(zip(args, self.params, strict=True)):
            want = ARG_DTYPES[param]
            assert isinstance(arg, np.generic) and arg.dtype == want, (
                f"{self.name} argument {i} ({param}): got {type(arg).__name__} "
                f"{getattr(arg, 'dtype', '')}, want {np.dtype(want)}"
            )
            values.append(np.array(arg))
        params = (ctypes.c_void_p * len(values))(*[v.ctypes.data for v in values])
        assert self.lib.host_launch(self.name.encode(), grid[0], block[0], params) == 0
        self.calls.append(self.name)


_FAKE_CUBIN = b"\x7fELF host stand-in\n"  # what the stand-in compiler returns, then the source


def _fake_compile_using_nvrtc(source: str, options, arch, filename):
    """cupy.cuda.compiler.compile_using_nvrtc: the options must reach NVRTC as they are
    (CuPy's RawModule path would append -ftz=true after them)."""
    assert tuple(options) == _native.NVRTC_OPTIONS, options
    assert arch is None and filename.endswith(".cu"), (arch, filename)
    return _FAKE_CUBIN + source.encode(), {}


class _FakeModule:
    """cupy.cuda.function.Module: load() takes the stand-in compiler's output."""

    def __init__(self, lib, calls: list[str]):
        self.lib, self.calls, self.sigs = lib, calls, None

    def load(self, binary: bytes) -> None:
        assert binary.startswith(_FAKE_CUBIN), binary[:32]
        self.sigs = kernel_signatures(binary[len(_FAKE_CUBIN) :].decode())

    def get_function(self, name: str) -> _FakeKernel:
        return _FakeKernel(self.lib, name, self.sigs[name], self.calls)


class _FakeTorchStream:
    def __cuda_stream__(self):
        return (0, 0)


class CudaOnHost(NamedTuple):
    backend: object  # hvdcompress.backends.cuda, patched to run on CPU tensors
    calls: list  # kernel names launched, in order


def patch_cuda(monkeypatch, name: str, value) -> None:
    """Set ``name`` to ``value`` (undone after the test) in every module of
    hvdcompress.backends.cuda that holds it: each family module binds the runtime names it
    imports (its launch seams, tile sizes), so a stand-in must reach all of them."""
    for module_name, module in list(sys.modules.items()):
        if module_name.split(".")[:3] == ["hvdcompress", "backends", "cuda"] and name in vars(
            module
        ):
            monkeypatch.setattr(module, name, value)


@pytest.fixture
def cuda_on_host(host, monkeypatch) -> CudaOnHost:
    """hvdcompress/backends/cuda/ on CPU tensors, its kernels the module's ``host``
    library's (through host_launch), its modules cache emptied."""
    from hvdcompress.backends import cuda as cuda_backend

    calls: list[str] = []
    fake = types.SimpleNamespace(
        __version__="host-emulation",
        cuda=types.SimpleNamespace(
            compiler=types.SimpleNamespace(compile_using_nvrtc=_fake_compile_using_nvrtc),
            function=types.SimpleNamespace(Module=lambda: _FakeModule(host.lib, calls)),
            Device=lambda index: _NoOpContext(),
            Stream=types.SimpleNamespace(from_external=lambda stream: _NoOpContext()),
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        ),
    )
    patch_cuda(monkeypatch, "DEVICE_TYPE", "cpu")
    patch_cuda(monkeypatch, "_import_cupy", lambda: fake)
    patch_cuda(monkeypatch, "_device_index", lambda device: 0)
    patch_cuda(monkeypatch, "_torch_stream", lambda index: _FakeTorchStream())
    patch_cuda(monkeypatch, "_modules", {})
    return CudaOnHost(cuda_backend, calls)


def loaded_families(cuda_backend) -> set[str]:
    """The .cu files whose module the (emulated) CUDA backend has loaded."""
    from hvdcompress.backends.cuda import _runtime

    return {file for file, _device in _runtime._modules}
