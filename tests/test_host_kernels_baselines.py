"""The CUDA kernels of kernels/baselines.cu compiled for the host with g++
(kernels/cuda_host.h), compared byte for byte with the CPU backend (csrc/baselines_cpu.c)
under several launch shapes; then hvdcompress/backends/cuda.py itself run on CPU tensors
behind a stand-in for CuPy (as in tests/test_host_kernels.py), so that whole payloads of
every baseline compressor made through the CUDA backend's code equal the CPU's.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import backends
from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.codecs import primitives as prim
from hvdcompress.wire import PayloadError
from tests.test_host_kernels import (
    CXX,
    HOST,
    KERNELS,
    LAUNCHES,
    _compile,
    _FakeModule,
    _FakeTorchStream,
    _NoOpContext,
    kernel_signatures,
)

pytestmark = pytest.mark.host_kernels

_P = ctypes.c_void_p
_I64 = ctypes.c_longlong
SIZES = [0, 1, 7, 8, 9, 255, 512, 513, 4097, 100003]


def _p(a):
    return None if a is None else a.ctypes.data


class HostBaselines:
    def __init__(self, path):
        lib = ctypes.CDLL(str(path))
        sig = {
            "host_set_launch": (None, [ctypes.c_uint, ctypes.c_uint]),
            "host_launch": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, _P]),
            "host_uniform": (None, [ctypes.c_ulonglong, _I64, _I64, _P]),
            "host_bitpack": (None, [_P, _I64, ctypes.c_int, _P]),
            "host_bitunpack": (ctypes.c_uint, [_P, _I64, _I64, ctypes.c_int, _P]),
            "host_chunk_sums": (None, [_P, _I64, _I64, ctypes.c_int, _P]),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def uniform(self, key, n, offset=0):
        out = np.zeros(n, np.float32)
        self.lib.host_uniform(key, offset, n, _p(out))
        return out

    def bitpack(self, codes, bits):
        nbytes = (codes.size * bits + 7) // 8
        out = np.full(nbytes + 8, 0xEE, np.uint8)
        self.lib.host_bitpack(_p(codes), codes.size, bits, _p(out))
        assert (out[nbytes:] == 0xEE).all(), "bitpack wrote past its output"
        return out[:nbytes]

    def bitunpack(self, buf, n, bits):
        codes = np.full(n + 8, 0xEE, np.uint8)
        err = self.lib.host_bitunpack(_p(buf), buf.size, n, bits, _p(codes))
        assert (codes[n:] == 0xEE).all(), "bitunpack wrote past its output"
        return codes[:n], err

    def chunk_sums(self, x, chunk, square):
        out = np.zeros((x.size + chunk - 1) // chunk, np.float64)
        self.lib.host_chunk_sums(_p(x), x.size, chunk, int(square), _p(out))
        return out


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    if CXX is None:
        pytest.skip("g++ not found: the host build of kernels/baselines.cu needs a C++17 compiler")
    out = tmp_path_factory.mktemp("host_baselines") / "libhost_baselines.so"
    _compile(out, HOST / "host_baselines.cpp", "-shared", "-fPIC")
    lib = HostBaselines(out)
    yield lib
    lib.lib.host_set_launch(*LAUNCHES[0])


@pytest.fixture(params=LAUNCHES, ids=lambda c: f"grid{c[0]}x{c[1]}")
def shaped(host, request):
    host.lib.host_set_launch(*request.param)
    yield host
    host.lib.host_set_launch(*LAUNCHES[0])


KEYS = [0, 2**64 - 1, prim.rng_key(1, 2, 3, prim.tensor_id("w"))]


@pytest.mark.parametrize("n", SIZES)
def test_uniform_matches_cpu(shaped, n):
    for key in KEYS:
        want = cpu_backend.bl_uniform(key, n).numpy()
        np.testing.assert_array_equal(shaped.uniform(key, n).view(np.uint32), want.view(np.uint32))


def test_uniform_counter_is_64_bit(host):
    """Counters beyond 2**32 (elements of tensors over 2**32 values) match the CPU's."""
    for offset in [2**32 - 3, 2**33 + 5, 2**40]:
        want = np.zeros(100, np.float32)
        cpu_backend.LIB.hvdc_bl_uniform(KEYS[2], offset, 100, want.ctypes.data)
        np.testing.assert_array_equal(host.uniform(KEYS[2], 100, offset), want)
        np.testing.assert_array_equal(want, prim.uniform_numpy(KEYS[2], 100, offset))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", SIZES)
def test_bitpack_unpack_match_cpu(shaped, bits, n):
    rng = np.random.default_rng(bits * 7 + n)
    codes = rng.integers(0, 256, n).astype(np.uint8)  # high bits must be ignored
    want = cpu_backend.bl_bitpack(torch.from_numpy(codes), bits).numpy()
    got = shaped.bitpack(codes, bits)
    np.testing.assert_array_equal(got, want)
    back, err = shaped.bitunpack(got, n, bits)
    assert err == 0
    np.testing.assert_array_equal(back, codes & ((1 << bits) - 1))
    if (n * bits) % 8:
        bad = got.copy()
        bad[-1] |= 0x80
        _, err = shaped.bitunpack(bad, n, bits)
        assert err == 4
        with pytest.raises(PayloadError, match="padding"):
            cpu_backend.bl_bitunpack(torch.from_numpy(bad), n, bits)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [1, 7, 512, 4096])
def test_chunk_sums_match_cpu(shaped, n, chunk):
    rng = np.random.default_rng(n + chunk)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    for square in (False, True):
        want = cpu_backend.bl_chunk_sums(torch.from_numpy(x), chunk, square).numpy()
        got = shaped.chunk_sums(x, chunk, square)
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


def test_kernel_signatures_parse():
    sigs = kernel_signatures((KERNELS / "baselines.cu").read_text())
    assert sigs == {
        "hvd_bl_uniform": ["unsigned long long", "long long", "long long", "pointer"],
        "hvd_bl_bitpack": ["pointer", "long long", "int", "pointer", "long long"],
        "hvd_bl_bitunpack": ["pointer", "long long", "long long", "int", "pointer", "pointer"],
        "hvd_bl_chunk_sums": ["pointer", "long long", "long long", "int", "pointer"],
    }


# ---- hvdcompress/backends/cuda.py on the host ---------------------------------------------


@pytest.fixture
def emulated(host, monkeypatch):
    """The CUDA backend module, running on CPU tensors with the host-compiled kernels."""
    from hvdcompress.backends import cuda as cuda_backend

    calls: list[str] = []
    fake = types.SimpleNamespace(
        __version__="host-emulation",
        RawModule=lambda code, options: _FakeModule(host.lib, code, options, calls),
        cuda=types.SimpleNamespace(
            Device=lambda index: _NoOpContext(),
            Stream=types.SimpleNamespace(from_external=lambda stream: _NoOpContext()),
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        ),
    )
    monkeypatch.setattr(cuda_backend, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(cuda_backend, "_import_cupy", lambda: fake)
    monkeypatch.setattr(cuda_backend, "_device_index", lambda device: 0)
    monkeypatch.setattr(cuda_backend, "_torch_stream", lambda index: _FakeTorchStream())
    monkeypatch.setattr(cuda_backend, "_modules", {})
    monkeypatch.setattr(cuda_backend, "_bl_modules", {})
    return cuda_backend


def test_emulated_primitives_match_cpu(emulated):
    rng = np.random.default_rng(0)
    for n in SIZES:
        key = KEYS[2] + n
        assert torch.equal(emulated.bl_uniform(key, n, None), cpu_backend.bl_uniform(key, n))
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        for square in (False, True):
            assert torch.equal(
                emulated.bl_chunk_sums(x, 512, square), cpu_backend.bl_chunk_sums(x, 512, square)
            )
        codes = torch.from_numpy(rng.integers(0, 32, n).astype(np.uint8))
        packed = emulated.bl_bitpack(codes, 5)
        assert torch.equal(packed, cpu_backend.bl_bitpack(codes, 5))
        assert torch.equal(emulated.bl_bitunpack(packed, n, 5), codes)
        if (5 * n) % 8:
            bad = packed.clone()
            bad[-1] |= 0x80
            with pytest.raises(PayloadError, match="padding"):
                emulated.bl_bitunpack(bad, n, 5)
        with pytest.raises(PayloadError):
            emulated.bl_bitunpack(torch.zeros(packed.numel() + 1, dtype=torch.uint8), n, 5)


CONFIGS = [
    ("topk", {"ratio": 0.05}),
    ("randomk", {"ratio": 0.1}),
    ("randomk", {"ratio": 0.3, "unbiased": False, "error_feedback": True}),
    ("qsgd", {}),
    ("qsgd", {"levels": 3, "bucket_size": 100}),
    ("terngrad", {}),
    ("signsgd", {}),
    ("efsignsgd", {}),
    ("dqsg", {}),
    ("dqsg", {"levels": 1}),
    ("dqsg", {"levels": 100, "bucket_size": 64}),
]


@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}{kw}" for n, kw in CONFIGS])
def test_emulated_compressor_payloads_match_cpu(emulated, monkeypatch, name, kw):
    """Whole payloads through the CUDA backend's code equal the CPU backend's, over steps
    (error feedback and step counters carried), and so do the decoded sums."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(5003, generator=gen) for _ in range(3)]
    grads[1][::3] = 0.0
    on_cpu = hvdcompress.get_compressor(name, **kw)
    payloads = [on_cpu.compress(g, "w")[0] for g in grads]
    sums_cpu = torch.zeros(5003)
    for p in payloads:
        on_cpu.decode(p, out=sums_cpu, accumulate=True)
    monkeypatch.setitem(backends._BACKENDS, "cpu", emulated)
    on_gpu = hvdcompress.get_compressor(name, **kw)
    sums_gpu = torch.zeros(5003)
    for step, (g, want) in enumerate(zip(grads, payloads, strict=True)):
        got, _ = on_gpu.compress(g, "w")
        assert torch.equal(got, want), f"{name} step {step}"
        on_gpu.decode(want, out=sums_gpu, accumulate=True)
    assert torch.equal(sums_gpu, sums_cpu)
    assert emulated._modules  # the checksum kernel (and threelc's coders) ran emulated
    if name not in ("topk", "signsgd", "efsignsgd"):
        assert emulated._bl_modules  # the uniforms / bit packing ran emulated
