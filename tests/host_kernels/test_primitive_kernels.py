"""The CUDA kernels of kernels/primitives.cu compiled for the host with g++
(kernels/cuda_host.h), compared byte for byte with the CPU backend (kernels/primitives.c)
under several launch shapes; then hvdcompress/backends/cuda/ itself run on CPU tensors
behind the stand-in for CuPy of conftest.py, so that whole payloads of every compressor
that uses the primitives, made through the CUDA backend's code, equal the CPU's.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import backends
from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.backends.cuda import FRAME, PRIMITIVES, QUANT, SIGN, SPARSE
from hvdcompress.codecs import primitives as prim
from hvdcompress.wire import PayloadError
from tests.host_kernels.conftest import (
    I64,
    KERNELS,
    LAUNCHES,
    HostLibrary,
    P,
    build_host_library,
    kernel_signatures,
    loaded_families,
    ptr,
)

pytestmark = pytest.mark.host_kernels

SIZES = [0, 1, 7, 8, 9, 255, 512, 513, 4097, 100003]


class HostPrimitives(HostLibrary):
    """ctypes view of libhost_primitives.so; numpy arrays in and out."""

    SIGNATURES = {
        "host_uniform": (None, [ctypes.c_ulonglong, I64, I64, P]),
        "host_bitpack": (None, [P, I64, ctypes.c_int, P]),
        "host_bitunpack": (ctypes.c_uint, [P, I64, I64, ctypes.c_int, P]),
        "host_chunk_sums": (None, [P, I64, I64, ctypes.c_int, P]),
    }

    def uniform(self, key, n, offset=0):
        out = np.zeros(n, np.float32)
        self.lib.host_uniform(key, offset, n, ptr(out))
        return out

    def bitpack(self, codes, bits):
        nbytes = (codes.size * bits + 7) // 8
        out = np.full(nbytes + 8, 0xEE, np.uint8)
        self.lib.host_bitpack(ptr(codes), codes.size, bits, ptr(out))
        assert (out[nbytes:] == 0xEE).all(), "bitpack wrote past its output"
        return out[:nbytes]

    def bitunpack(self, buf, n, bits):
        codes = np.full(n + 8, 0xEE, np.uint8)
        err = self.lib.host_bitunpack(ptr(buf), buf.size, n, bits, ptr(codes))
        assert (codes[n:] == 0xEE).all(), "bitunpack wrote past its output"
        return codes[:n], err

    def chunk_sums(self, x, chunk, square):
        out = np.zeros((x.size + chunk - 1) // chunk, np.float64)
        self.lib.host_chunk_sums(ptr(x), x.size, chunk, int(square), ptr(out))
        return out


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    lib = build_host_library(
        HostPrimitives, "host_primitives.cpp", PRIMITIVES.file, tmp_path_factory
    )
    yield lib
    lib.launch_shape(*LAUNCHES[0])


KEYS = [0, 2**64 - 1, prim.rng_key(1, 2, 3, prim.tensor_id("w"))]


@pytest.mark.parametrize("n", SIZES)
def test_uniform_matches_cpu(shaped, n):
    for key in KEYS:
        want = cpu_backend.uniform(key, n).numpy()
        np.testing.assert_array_equal(shaped.uniform(key, n).view(np.uint32), want.view(np.uint32))


def test_uniform_counter_is_64_bit(host):
    """Counters beyond 2**32 (elements of tensors over 2**32 values) match the CPU's."""
    for offset in [2**32 - 3, 2**33 + 5, 2**40]:
        want = np.zeros(100, np.float32)
        cpu_backend.LIB.hvdc_prim_uniform(KEYS[2], offset, 100, want.ctypes.data)
        np.testing.assert_array_equal(host.uniform(KEYS[2], 100, offset), want)
        np.testing.assert_array_equal(want, prim.uniform_numpy(KEYS[2], 100, offset))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", SIZES)
def test_bitpack_unpack_match_cpu(shaped, bits, n):
    rng = np.random.default_rng(bits * 7 + n)
    codes = rng.integers(0, 256, n).astype(np.uint8)  # high bits must be ignored
    want = cpu_backend.bitpack(torch.from_numpy(codes), bits).numpy()
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
            cpu_backend.bitunpack(torch.from_numpy(bad), n, bits)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("chunk", [1, 7, 512, 4096])
def test_chunk_sums_match_cpu(shaped, n, chunk):
    rng = np.random.default_rng(n + chunk)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    for square in (False, True):
        want = cpu_backend.chunk_sums(torch.from_numpy(x), chunk, square).numpy()
        got = shaped.chunk_sums(x, chunk, square)
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


def test_kernel_signatures_parse():
    sigs = kernel_signatures((KERNELS / PRIMITIVES.file).read_text())
    assert sigs == {
        "primitives_uniform": ["unsigned long long", "long long", "long long", "pointer"],
        "primitives_bitpack": ["pointer", "long long", "int", "pointer", "long long"],
        "primitives_bitunpack": ["pointer", "long long", "long long", "int", "pointer", "pointer"],
        "primitives_chunk_sums": ["pointer", "long long", "long long", "int", "pointer"],
    }
    assert set(sigs) == set(PRIMITIVES.names)


# ---- hvdcompress/backends/cuda/ on the host ---------------------------------------------


@pytest.fixture
def emulated(cuda_on_host):
    """The CUDA backend module, running on CPU tensors with the host-compiled kernels."""
    return cuda_on_host.backend


def test_emulated_primitives_match_cpu(emulated):
    rng = np.random.default_rng(0)
    for n in SIZES:
        key = KEYS[2] + n
        assert torch.equal(emulated.uniform(key, n, None), cpu_backend.uniform(key, n))
        x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
        for square in (False, True):
            assert torch.equal(
                emulated.chunk_sums(x, 512, square), cpu_backend.chunk_sums(x, 512, square)
            )
        codes = torch.from_numpy(rng.integers(0, 32, n).astype(np.uint8))
        packed = emulated.bitpack(codes, 5)
        assert torch.equal(packed, cpu_backend.bitpack(codes, 5))
        assert torch.equal(emulated.bitunpack(packed, n, 5), codes)
        if (5 * n) % 8:
            bad = packed.clone()
            bad[-1] |= 0x80
            with pytest.raises(PayloadError, match="padding"):
                emulated.bitunpack(bad, n, 5)
        with pytest.raises(PayloadError):
            emulated.bitunpack(torch.zeros(packed.numel() + 1, dtype=torch.uint8), n, 5)


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
    # the checksum kernel ran emulated, and so did the codec's own family (the single-pass
    # sign or quantiser kernels) and, where the codec uses them, the uniforms / bit packing
    assert FRAME.file in loaded_families(emulated)
    own = {"signsgd": SIGN, "efsignsgd": SIGN, "qsgd": QUANT, "terngrad": QUANT, "dqsg": QUANT}
    own["randomk"] = SPARSE  # random-k's one path, the bucket kernels (sparse.cu)
    if name in own:
        assert own[name].file in loaded_families(emulated)
    if name == "dqsg" and kw.get("levels", 3) > 1:
        assert PRIMITIVES.file in loaded_families(emulated)
