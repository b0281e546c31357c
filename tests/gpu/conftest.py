"""Shared by the GPU tests: the ``gpu`` fixture, which skips every test that takes it, with
the reason from ``hvdcompress.backends.cuda.gpu_unavailable_reason()``, where the CUDA
kernels cannot run (no CuPy, no CUDA device, no driver, NVRTC missing); the ``Setup`` it
gives (also used by tests/host_kernels, which run the same checks on the host kernels);
``bits``; and the GPU-less checks of a kernel family's source.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from hvdcompress.backends import cuda as cuda_backend


class Setup(NamedTuple):
    backend: object  # the backend under test (hvdcompress.backends.cuda)
    cpu: object  # the reference (hvdcompress.backends.cpu)
    dev: torch.device  # where the backend under test wants its tensors


def gpu_skip_reason() -> str | None:
    """Why the GPU tests skip here, or None where the CUDA kernels run."""
    reason = cuda_backend.gpu_unavailable_reason()
    return None if reason is None else f"CUDA kernels cannot run here: {reason}"


@pytest.fixture(scope="module")
def gpu() -> Setup:
    reason = gpu_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from hvdcompress.backends import cpu

    return Setup(cuda_backend, cpu, torch.device("cuda", torch.cuda.current_device()))


def bits(t: torch.Tensor) -> np.ndarray:
    """float32 bit patterns with every NaN mapped to one: NaN payloads are the hardware's
    (a GPU gives 0x7fffffff, x86 0xffc00000 for Inf * 0) and carry no meaning."""
    a = t.detach().cpu().float().numpy()
    b = a.view(np.uint32).copy()
    b[np.isnan(a)] = 0x7FC00000
    return b


def check_nvrtc_compiles(family: cuda_backend.KernelFamily) -> None:
    """NVRTC (the compiler CuPy uses at run time) accepts the family's .cu file with the
    backend's options for sm_80 and sm_90, without warnings; needs no GPU, only a loadable
    libnvrtc (pip install cupy-cuda13x nvidia-cuda-nvrtc). Skips without one."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC not loadable ({type(exc).__name__}: {str(exc)[:200]})")
    source = (cuda_backend.kernel_dir() / family.file).read_text()
    for arch in ("compute_80", "sm_90"):
        prog = nvrtc.createProgram(source, family.file, [], [])
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *cuda_backend.NVRTC_OPTIONS])
        except Exception as exc:
            pytest.fail(f"NVRTC {arch}: {exc}\n{nvrtc.getProgramLog(prog)}")
        log = nvrtc.getProgramLog(prog).strip("\x00 \n")
        assert not log, f"NVRTC {arch} warnings:\n{log}"
        nvrtc.destroyProgram(prog)


def check_kernel_source_found(family: cuda_backend.KernelFamily) -> None:
    """The family's .cu file is where the backend looks and defines every kernel it launches."""
    path = cuda_backend.kernel_dir() / family.file
    assert path.is_file(), path
    text = path.read_text()
    for name in family.names:
        assert f'extern "C" __global__ void {name}(' in text, name
