"""The shared primitives on a real GPU: the CuPy kernels of kernels/primitives.cu, and whole
payloads of every compressor that uses them, byte for byte against the CPU backend. Every
test marked ``gpu`` takes the ``gpu`` fixture of conftest.py, which skips it, with the
reason from ``hvdcompress.backends.cuda.gpu_unavailable_reason()``, where the kernels
cannot run. On a GPU machine: ``python -m pytest -m gpu tests/gpu`` (scripts/gpu_check.sh).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import framing, wire
from hvdcompress.codecs import primitives as prim
from hvdcompress.wire import PayloadError
from tests.gpu.conftest import bits

SIZES = [0, 1, 7, 9, 513, 100003, 1 << 22 | 3]
CONFIGS = [
    ("topk", {}),
    ("topk", {"ratio": 0.3}),
    ("randomk", {"ratio": 0.1}),
    ("randomk", {"ratio": 0.3, "unbiased": False, "error_feedback": True}),
    ("topkq", {"ratio": 0.05}),
    ("gspar", {"ratio": 0.05}),
    ("qsgd", {}),
    ("qsgd", {"levels": 3, "bucket_size": 100}),
    ("terngrad", {}),
    ("signsgd", {}),
    ("efsignsgd", {}),
    ("dqsg", {}),
    ("dqsg", {"levels": 1}),
    ("dqsg", {"levels": 100, "bucket_size": 64}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_primitives_match_cpu(gpu, n):
    key = prim.rng_key(1, 2, 3, n)
    u = gpu.backend.uniform(key, n, gpu.dev)
    np.testing.assert_array_equal(bits(u.cpu()), bits(gpu.cpu.uniform(key, n)))
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for chunk in (7, 512, 4096):
        for square in (False, True):
            got = gpu.backend.chunk_sums(x.to(gpu.dev), chunk, square).cpu()
            want = gpu.cpu.chunk_sums(x, chunk, square)
            assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
    for b in range(1, 9):
        packed = gpu.backend.bitpack(codes.to(gpu.dev), b)
        assert torch.equal(packed.cpu(), gpu.cpu.bitpack(codes, b))
        back = gpu.backend.bitunpack(packed, n, b).cpu()
        assert torch.equal(back, codes & ((1 << b) - 1))
        if (n * b) % 8:
            packed[-1:] |= 0x80
            with pytest.raises(PayloadError, match="padding"):
                gpu.backend.bitunpack(packed, n, b)


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}{kw}" for n, kw in CONFIGS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compressor_payloads_match_cpu(gpu, name, kw, dtype):
    """Whole payloads from a CUDA tensor equal the CPU's over steps (error feedback and
    step counters carried); decoding and the rank-order sum agree bit for bit."""
    gen = torch.Generator().manual_seed(3)
    shape = (37, 1011)
    grads = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    grads[1].view(-1)[::3] = 0
    on_gpu = hvdcompress.get_compressor(name, **kw)
    on_cpu = hvdcompress.get_compressor(name, **kw)
    total_gpu = torch.zeros(grads[0].numel(), device=gpu.dev)
    total_cpu = torch.zeros(grads[0].numel())
    for step, g in enumerate(grads):
        p_gpu, _ = on_gpu.compress(g.to(gpu.dev), "w")
        p_cpu, _ = on_cpu.compress(g, "w")
        assert torch.equal(p_gpu.cpu(), p_cpu), f"{name} {dtype} step {step}"
        dec = on_gpu.decode(p_cpu.to(gpu.dev))
        assert dec.dtype == dtype and dec.shape == shape and dec.device == gpu.dev
        np.testing.assert_array_equal(bits(dec.float().cpu()), bits(on_cpu.decode(p_cpu).float()))
        on_gpu.decode(p_cpu.to(gpu.dev), out=total_gpu, accumulate=True)
        on_cpu.decode(p_cpu, out=total_cpu, accumulate=True)
    np.testing.assert_array_equal(bits(total_gpu.cpu()), bits(total_cpu))


@pytest.mark.gpu
def test_beyond_2_pow_31_elements(gpu):
    """64-bit counters and bit offsets: the tail of a > 2^31-element uniform / bit pack
    equals the CPU's computation of that tail alone."""
    n = (1 << 31) + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip(f"needs about 16 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    key = prim.rng_key(5, 0, 0, 1)
    u = gpu.backend.uniform(key, n, gpu.dev)
    tail = u[-1000:].cpu().numpy()
    del u
    np.testing.assert_array_equal(tail, prim.uniform_numpy(key, 1000, n - 1000))
    codes = torch.zeros(n, dtype=torch.uint8, device=gpu.dev)
    codes[-16:] = torch.arange(16, dtype=torch.uint8, device=gpu.dev)
    for b in (1, 3, 8):
        packed = gpu.backend.bitpack(codes, b)
        start = (n - 16) * b  # bit offset of the first non-zero code, > 2^31
        got = gpu.backend.bitunpack(packed, n, b)[-16:].cpu()
        assert torch.equal(got, torch.arange(16, dtype=torch.uint8) & ((1 << b) - 1))
        assert int(packed[: start // 8].sum()) == 0
        del packed, got


# ---- without a GPU -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}{kw}" for n, kw in CONFIGS])
def test_compress_bucket_frame_on_the_device_matches_cpu(gpu, name, kw):
    """A bucket's frame made on the GPU (bodies, headers and checksums on the device) is the
    CPU's, byte for byte, and decode_bucket accumulates the same sums."""
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randn(n, generator=gen) for n in (1, 7, 513, 100003)]
    names = [f"t{i}" for i in range(len(tensors))]
    on_gpu = hvdcompress.get_compressor(name, **kw)
    on_cpu = hvdcompress.get_compressor(name, **kw)
    for step in range(2):
        frame_gpu, ctxs_gpu = framing.compress_bucket(
            on_gpu, [t.to(gpu.dev) for t in tensors], names
        )
        frame_cpu, ctxs_cpu = framing.compress_bucket(on_cpu, tensors, names)
        assert frame_gpu.device == gpu.dev
        assert torch.equal(frame_gpu.cpu(), frame_cpu), f"{name} step {step}"
        outs_gpu = [torch.zeros(t.numel(), device=gpu.dev) for t in tensors]
        outs_cpu = [torch.zeros(t.numel()) for t in tensors]
        framing.decode_bucket(
            on_gpu, wire.unframe_parsed(frame_gpu, 0, names, gpu.dev), outs_gpu, ctxs_gpu, rank=0
        )
        framing.decode_bucket(
            on_cpu,
            wire.unframe_parsed(frame_cpu, 0, names, torch.device("cpu")),
            outs_cpu,
            ctxs_cpu,
        )
        for got, want in zip(outs_gpu, outs_cpu, strict=True):
            assert torch.equal(got.cpu(), want)
