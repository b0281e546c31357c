"""The single-pass codec kernels of kernels/sign.cu and kernels/quant.cu, compiled for the
host with g++ (kernels/cuda_host.h) and run through hvdcompress/backends/cuda/ itself
(the stand-in for CuPy of conftest.py), compared byte for byte with the CPU backend
(kernels/sign.c, kernels/quant.c) under several launch shapes: signSGD and EF-signSGD
bodies, residuals and decodes, QSGD bodies and decodes, TernGrad bodies, and the same
PayloadErrors (output untouched) on corrupt bodies. Also the CUDA module's torch forms of
random-k, GSpar, DGC and NDQSG (native passes on the CPU) against the CPU backend, and a
bucket's segment calls (kernels/sign.cu section 5; whole compressors through
tests/gpu/test_buckets_gpu.py's checks).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import _native, backends, framing, wire
from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.backends.cuda import FAMILIES, QUANT, SIGN, SPARSE, _runtime
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import quant
from hvdcompress.wire import PayloadError
from tests import bucket_of_one as one
from tests.codec_inputs import special_tensor
from tests.gpu import test_buckets_gpu
from tests.gpu.conftest import Setup
from tests.host_kernels.conftest import (
    KERNELS,
    HostLibrary,
    build_host_library,
    kernel_signatures,
    loaded_families,
    patch_cuda,
)

pytestmark = pytest.mark.host_kernels

SIZES = [1, 7, 8, 9, 511, 513, 1025, 5003]
KINDS = ["mixed", "zeros", "subnormal", "huge", "nan", "inf"]
# (threads per block, blocks per multiprocessor; the stand-in has 2 multiprocessors): a full
# grid, and small grids whose threads loop
SHAPES = [(256, 8), (64, 1), (32, 1)]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    return build_host_library(HostLibrary, "host_primitives.cpp", SIGN.file, tmp_path_factory)


@pytest.fixture(params=SHAPES, ids=lambda s: f"block{s[0]}x{s[1]}perSM")
def emulated(cuda_on_host, monkeypatch, request):
    """The CUDA backend on CPU tensors with the host-built kernels, at one launch shape."""
    backend = cuda_on_host.backend
    patch_cuda(monkeypatch, "BLOCK", request.param[0])
    patch_cuda(monkeypatch, "BLOCKS_PER_SM", request.param[1])
    return backend


def inputs():
    gen = torch.Generator().manual_seed(1)
    for n in SIZES:
        for kind in KINDS:
            yield special_tensor(n, kind), torch.randn(n, generator=gen)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_sign_kernels_match_cpu(emulated):
    for x, e in inputs():
        n = x.numel()
        want = one.sign_encode(cpu_backend, x)
        got = one.sign_encode(emulated, x)
        assert (got is None) == (want is None)
        if want is None:
            continue
        assert torch.equal(got, want)
        sums_cpu, sums_gpu = one.efsign_sums(cpu_backend, x, e), one.efsign_sums(emulated, x, e)
        assert same_bits(sums_gpu, sums_cpu)
        e_cpu, e_gpu = e.clone(), e.clone()
        body = one.efsign_encode(cpu_backend, x, e_cpu, 0.8125)
        assert torch.equal(one.efsign_encode(emulated, x, e_gpu, 0.8125), body)
        assert same_bits(e_gpu, e_cpu)
        for scale, accumulate in ((1.0, False), (0.8125, True), (0.0, False)):
            out_cpu, out_gpu = e.clone(), e.clone()
            one.sign_decode(cpu_backend, body, n, scale, out_cpu, accumulate)
            one.sign_decode(emulated, body, n, scale, out_gpu, accumulate)
            assert same_bits(out_gpu, out_cpu)
        if n % 8:
            bad = body.clone()
            bad[-1] |= 0x80
            out = e.clone()
            with pytest.raises(PayloadError, match="padding"):
                one.sign_decode(emulated, bad, n, 1.0, out, True)
            assert torch.equal(out, e)
    assert SIGN.file in loaded_families(emulated)


def test_efsign_sums_flag_nonfinite(emulated):
    g = torch.ones(3000)
    e = torch.zeros(3000)
    e[2999] = float("inf")
    assert one.efsign_sums(emulated, g, e) is None
    assert one.efsign_sums(cpu_backend, g, e) is None


@pytest.mark.parametrize("levels,bucket", [(16, 512), (1, 7), (3, 100), (127, 64), (5, 1)])
def test_qsgd_kernels_match_cpu(emulated, levels, bucket):
    bits = quant.qsgd_bits(levels)
    for x, out in inputs():
        n = x.numel()
        key = 2**64 - 1 - n
        want = one.qsgd_encode(cpu_backend, x, levels, bits, bucket, key)
        got = one.qsgd_encode(emulated, x, levels, bits, bucket, key)
        assert (got is None) == (want is None)
        if want is None:
            continue
        assert torch.equal(got, want)
        for accumulate in (False, True):
            out_cpu, out_gpu = out.clone(), out.clone()
            one.qsgd_decode(cpu_backend, want, n, levels, bits, bucket, out_cpu, accumulate)
            one.qsgd_decode(emulated, want, n, levels, bits, bucket, out_gpu, accumulate)
            assert same_bits(out_gpu, out_cpu)
    assert QUANT.file in loaded_families(emulated)


def test_qsgd_kernels_reject_what_the_cpu_rejects(emulated):
    levels, bucket, n = 2, 512, 700
    bits = quant.qsgd_bits(levels)
    body = one.qsgd_encode(cpu_backend, torch.randn(n), levels, bits, bucket, 3)
    bad_norm, bad_code, bad_pad = body.clone(), body.clone(), body.clone()
    bad_norm[4:8] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # NaN
    bad_code[8 + 100] = 0xFF  # codes 7: level 3 > 2
    bad_pad[-1] |= 0x80
    for bad, match in ((bad_norm, "norm"), (bad_code, "level"), (bad_pad, "padding")):
        for backend in (cpu_backend, emulated):
            out = torch.full((n,), 2.0)
            with pytest.raises(PayloadError, match=match):
                one.qsgd_decode(backend, bad, n, levels, bits, bucket, out, False)
            assert torch.equal(out, torch.full((n,), 2.0))


def test_terngrad_kernels_match_cpu(emulated):
    for x, _ in inputs():
        key = 12345 + x.numel()
        want = one.terngrad_encode(cpu_backend, x, key)
        got = one.terngrad_encode(emulated, x, key)
        assert (got is None) == (want is None)
        if want is not None:
            assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert QUANT.file in loaded_families(emulated)


def test_kernel_signatures_parse():
    for family in (SIGN, QUANT, SPARSE):
        sigs = kernel_signatures((KERNELS / family.file).read_text())
        assert set(sigs) == set(family.names)
    sigs = kernel_signatures((KERNELS / QUANT.file).read_text())
    assert sigs["quant_qsgd_encode"][5] == "unsigned long long"  # the stream key
    assert sigs["quant_terngrad_quartic"][3] == "unsigned long long"


def test_kernel_files_pair_by_family():
    """Kernels in pairs: every kernels/<family>.c (the CPU library's sources) has its
    kernels/<family>.cu (a CUDA kernel family) and the other way round, and each kernel
    name belongs to one family only."""
    c_sources = {p.stem for p in KERNELS.glob("*.c")}
    cu_sources = {p.stem for p in KERNELS.glob("*.cu")}
    assert c_sources == cu_sources
    assert {Path(name).stem for name in _native.C_SOURCES} == c_sources
    assert {Path(f.file).stem for f in FAMILIES} == cu_sources
    names = [name for f in FAMILIES for name in f.names]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("levels,bucket,code_offset", [(3, 512, 0), (1, 7, 0), (127, 64, 127)])
def test_dqsg_kernels_match_cpu(emulated, levels, bucket, code_offset):
    for w, out in inputs():
        key = 7 + w.numel()
        want = cpu_backend.dqsg_quantize(w, levels, bucket, key, code_offset)
        got = emulated.dqsg_quantize(w, levels, bucket, key, code_offset)
        assert (got is None) == (want is None)
        if want is None:
            continue
        assert torch.equal(got[0], want[0]) and same_bits(got[1], want[1])
        q = cpu_backend.dqsg_quantize(w, levels, bucket, key, 0)[0].view(torch.int8)
        for accumulate in (False, True):
            out_cpu, out_gpu = out.clone(), out.clone()
            cpu_backend.dqsg_dequantize(q, want[1], bucket, key, out_cpu, accumulate)
            emulated.dqsg_dequantize(q, want[1], bucket, key, out_gpu, accumulate)
            assert same_bits(out_gpu, out_cpu)
    assert QUANT.file in loaded_families(emulated)


@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "qsgd", "terngrad", "dqsg", "3lc"])
def test_emulated_bucket_frames_match_cpu(emulated, monkeypatch, name):
    """compress_bucket through the CUDA backend's code (segment encoders) gives the CPU
    backend's frame, step after step, and decode_frame (the backend's segment decoders
    where it has them) the CPU backend's sums."""
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(n, generator=gen) for n in (1, 9, 700, 5003)]
    names = [f"t{i}" for i in range(len(tensors))]
    on_cpu = hvdcompress.get_compressor(name)
    sent = [framing.compress_bucket(on_cpu, tensors, names) for _ in range(2)]
    sums = []
    for frame, ctxs in sent:
        outs = [torch.linspace(-1, 1, t.numel()) for t in tensors]
        framing.decode_frame(on_cpu, frame, outs, ctxs, rank=1)
        sums.append(outs)
    monkeypatch.setitem(backends._BACKENDS, "cpu", emulated)
    on_gpu = hvdcompress.get_compressor(name)
    for step, ((want, ctxs), want_sums) in enumerate(zip(sent, sums, strict=True)):
        assert torch.equal(framing.compress_bucket(on_gpu, tensors, names)[0], want), f"step {step}"
        outs = [torch.linspace(-1, 1, t.numel()) for t in tensors]
        framing.decode_frame(on_gpu, want, outs, ctxs, rank=1)
        assert all(same_bits(a, b) for a, b in zip(outs, want_sums, strict=True)), f"step {step}"


@pytest.mark.parametrize(
    "name,params,rank",
    [
        ("randomk", {"ratio": 0.1}, 0),
        ("randomk", {"ratio": 0.3, "unbiased": False, "error_feedback": True}, 0),
        ("gspar", {"ratio": 0.05}, 0),
        ("gspar", {"ratio": 0.2, "error_feedback": True}, 0),
        ("dgc", {"ratio": 0.05}, 0),
        ("dgc", {"ratio": 0.05, "momentum": 0.0}, 0),
        ("ndqsg", {}, 0),
        ("ndqsg", {}, 1),
    ],
)
def test_emulated_torch_forms_match_cpu(emulated, monkeypatch, name, params, rank):
    """The CUDA backend's torch forms of random-k, GSpar, DGC and NDQSG (the CPU backend
    runs native passes for them) give the CPU backend's payloads, residuals and decoded
    sums, tensor by tensor over several steps: the CUDA module's code, run on CPU tensors
    with its uniforms and chunk sums from the host-built kernels. NDQSG at rank 1 of 2 is
    its nested code, decoded with side information."""
    gen = torch.Generator().manual_seed(3)
    xs = [
        torch.randn(n, generator=gen) * torch.randn(n, generator=gen).abs() ** 4
        for n in (7, 700, 5003)
    ]
    xs[2][:1024] = 0.0  # whole zero buckets (NDQSG's delta 0)
    names = [f"t{i}" for i in range(len(xs))]

    def run(compressor):
        compressor.bind(rank, 2)
        payloads, sums = [], []
        for _ in range(3):
            for x, n in zip(xs, names, strict=True):
                payload, ctx = compressor.compress(x, n)
                out = torch.linspace(-1, 1, x.numel())
                side = x * 0.999 if compressor.uses_side_info and rank else None
                compressor.decode(payload, expect=ctx, out=out, accumulate=True, side_info=side)
                payloads.append(payload)
                sums.append(out)
        return payloads, sums

    want = run(hvdcompress.get_compressor(name, **params))
    monkeypatch.setitem(backends._BACKENDS, "cpu", emulated)
    got = run(hvdcompress.get_compressor(name, **params))
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"payload {i}"
    for i, (a, b) in enumerate(zip(got[1], want[1], strict=True)):
        assert same_bits(a, b), f"decoded {i}"


def test_emulated_randomk_keeps_strictly_below_the_threshold(emulated):
    """The CUDA form's mask (u < T 2^-24 in float32) and the CPU's integer compare agree
    at a tie: T set to chosen elements' hashes, which are not kept."""
    key, n = prim.rng_key(9, 0, 0, 1), 2000
    hashes = (prim.uniform_numpy(key, n) * 2**24).astype(np.int64)
    a = torch.arange(1, n + 1, dtype=torch.float32)
    for j in (0, 777, n - 1):
        want = one.randomk_encode(cpu_backend, a, key, int(hashes[j]), None)
        got = one.randomk_encode(emulated, a, key, int(hashes[j]), None)
        assert torch.equal(got, want) and float(a[j]) not in got.tolist()


# ---- a bucket as one launch sequence (kernels/sign.cu section 5) ---------------------------


@pytest.fixture(params=[16, 2048], ids=lambda t: f"tile{t}")
def setup(emulated, monkeypatch, request):
    """A ``tests.gpu.conftest.Setup`` of the emulated backend, segment tiles of 16 units
    (tensors of many tiles) or the default."""
    patch_cuda(monkeypatch, "SEGMENT_TILE", request.param)
    return Setup(emulated, cpu_backend, torch.device("cpu"))


def test_emulated_sign_segments(setup):
    test_buckets_gpu.check_sign_segments(setup)


def test_emulated_terngrad_segments(setup):
    test_buckets_gpu.check_terngrad_segments(setup)


@pytest.mark.parametrize("levels,bucket", [(16, 64), (1, 7), (127, 512)])
def test_emulated_qsgd_segments(setup, levels, bucket):
    test_buckets_gpu.check_qsgd_segments(setup, levels, bucket)


@pytest.mark.parametrize("levels,bucket", [(3, 64), (2, 5), (127, 512)])
def test_emulated_dqsg_segments(setup, levels, bucket):
    test_buckets_gpu.check_dqsg_segments(setup, levels, bucket)


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error_feedback"])
@pytest.mark.parametrize("ratio", [0.1, 0.01, 1.0])
def test_emulated_randomk_encode_segments(setup, ratio, ef):
    test_buckets_gpu.check_randomk_encode_segments(setup, ratio, ef)


@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error_feedback"])
@pytest.mark.parametrize("ratio", [0.1, 0.01, 1.0])
def test_emulated_gspar_encode_segments(setup, ratio, ef):
    test_buckets_gpu.check_gspar_encode_segments(setup, ratio, ef)


@pytest.mark.parametrize("ratio,scale", [(0.1, 1.0), (0.01, 100.0), (1.0, 1.0)])
def test_emulated_randomk_segments(setup, ratio, scale):
    test_buckets_gpu.check_randomk_segments(setup, ratio, scale)


@pytest.mark.parametrize("signs", [False, True], ids=["topk", "topkq"])
@pytest.mark.parametrize("ratio", [0.05, 1.0])
def test_emulated_topk_segments(setup, ratio, signs):
    test_buckets_gpu.check_topk_segments(setup, ratio, signs=signs)


@pytest.mark.parametrize("ratio", [0.05, 0.3, 1.0])
@pytest.mark.parametrize("momentum", [None, 0.9, 0.0], ids=["topk", "dgc", "dgc_no_momentum"])
def test_emulated_topk_encode_segments(setup, ratio, momentum):
    test_buckets_gpu.check_topk_encode_segments(setup, ratio, momentum)


@pytest.mark.parametrize("ratio", [0.05, 0.3, 1.0])
def test_emulated_topkq_encode_segments(setup, ratio):
    test_buckets_gpu.check_topk_encode_segments(setup, ratio, signs=True)


@pytest.mark.parametrize("momentum,signs", [(None, False), (0.9, False), (None, True)],
                         ids=["topk", "dgc", "topkq"])  # fmt: skip
def test_emulated_topk_encode_segments_of_int64_indices(setup, monkeypatch, momentum, signs):
    """The int64 index layout, with the limit lowered to 64 elements in the codec and the
    backend: the codec's per-tensor encode is the reference (the CPU's native encoder keeps
    the real limit). Bodies at odd k put int64 indices at 4-byte offsets."""
    from hvdcompress.codecs import sparse

    monkeypatch.setattr(sparse, "INDEX32_LIMIT", 64)
    patch_cuda(monkeypatch, "TOPK_INDEX32_LIMIT", 64)

    def reference(gs, es, ks, us, m):
        return test_buckets_gpu.topk_encode_per_tensor(gs, es, ks, us, m, signs)

    test_buckets_gpu.check_topk_encode_segments(setup, 0.05, momentum, reference, signs)


def test_topk_gather_writes_indices_above_2_to_the_32(host):
    """sparse_topk_gather_segments on the elements [2^32, 2^32 + 5) of a segment of
    2^32 + 5 (its one tile starts there; the pointers are offset so that only those
    elements exist): the int64 indices keep their high words, the second at a 4-byte
    offset, and the kept elements are zeroed."""
    import ctypes

    base = 2**32

    def before(arr: np.ndarray, elements: int) -> int:
        """arr's address less `elements` of its items, modulo 2^64 (the kernel adds them
        back: 64-bit address arithmetic wraps; the low address itself is never read)."""
        return (arr.ctypes.data - elements * arr.itemsize) % 2**64

    a = np.array([1.5, -2.5, 3.5, 4.5, -5.5], np.float32)
    keep = np.array([0, 1, 1, 0, 1], np.uint8)
    incl = np.cumsum(keep).astype(np.int64)
    body = np.zeros(3 * 4 + 3 * 8, np.uint8)
    # the row: g (unused), a, n, no velocity, k = 3, flags from 0, the first tile -1 (the
    # one launched tile is the segment's tile 1, so it starts at element 2^32), the body
    row = np.array([0, before(a, base), base + 5, 0, 3, 0, 0, body.ctypes.data], np.uint64)
    row = row.view(np.int64)
    row[6] = -1
    args = [
        np.uint64(row.ctypes.data),
        np.int64(1),  # segments
        np.int64(1),  # tiles
        np.int64(base),  # tile size
        np.int64(2**31),  # int64 indices from 2^31 elements on
        np.uint64(before(keep, base)),
        np.uint64(before(incl, base)),
        np.uint64(0),  # no slots: top-k's bodies
        np.uint64(0),
    ]
    sig = kernel_signatures((KERNELS / SPARSE.file).read_text())["sparse_topk_gather_segments"]
    assert len(args) == len(sig)  # a raw launch: a wrong count would read past the array
    values = [np.array(v) for v in args]
    params = (ctypes.c_void_p * len(values))(*[v.ctypes.data for v in values])
    assert host.lib.host_launch(b"sparse_topk_gather_segments", 1, 32, params) == 0
    np.testing.assert_array_equal(body[:12].view(np.float32), [-2.5, 3.5, -5.5])
    np.testing.assert_array_equal(body[12:].view(np.int64), [base + 1, base + 2, base + 4])
    np.testing.assert_array_equal(a, [1.5, 0.0, 0.0, 4.5, 0.0])


def test_emulated_topk_segments_of_int64_indices(setup, monkeypatch):
    """The int64 index layout (tensors of 2^31 elements or more), with the limit lowered
    to 64 elements in the codec and the backend: the per-payload decoder is the reference
    (the CPU's native decoder keeps the real limit)."""
    from hvdcompress.codecs import sparse

    monkeypatch.setattr(sparse, "INDEX32_LIMIT", 64)
    patch_cuda(monkeypatch, "TOPK_INDEX32_LIMIT", 64)

    def per_payload(decode_into, size):
        """A bucket decoder that calls ``decode_into`` payload by payload."""

        def decode(frame, starts, ks, ns, outs):
            for i, (a, k, n) in enumerate(
                zip(starts.tolist(), ks.tolist(), ns.tolist(), strict=True)
            ):
                try:
                    decode_into(frame[a : a + size(k, sparse.index_dtype(n).itemsize)], n, k,
                                outs[i], True)  # fmt: skip
                except PayloadError:
                    return i, "refused"
            return None

        return decode

    topk = per_payload(sparse.topk_decode_into, lambda k, isz: k * (4 + isz))
    test_buckets_gpu.check_topk_segments(setup, 0.05, topk)
    topkq = per_payload(sparse.topk_sign_decode_into, lambda k, isz: 4 + k * isz + (k + 7) // 8)
    test_buckets_gpu.check_topk_segments(setup, 0.05, topkq, signs=True)


@pytest.mark.parametrize("fine,rho,bucket", [(3, 3, 64), (2, 2, 5), (8, 8, 64), (127, 127, 512)])
def test_emulated_nested_segments(setup, fine, rho, bucket):
    test_buckets_gpu.check_nested_segments(setup, fine, rho, bucket)


@pytest.mark.parametrize("bucket", [64, 5, 512])
def test_emulated_dqsg_ternary_segments(setup, bucket):
    test_buckets_gpu.check_dqsg_ternary_segments(setup, bucket)


@pytest.mark.parametrize(
    "name,params", test_buckets_gpu.BUCKET_FRAME_CASES, ids=test_buckets_gpu.BUCKET_FRAME_IDS
)
def test_emulated_bucket_frames_on_segment_calls(setup, monkeypatch, name, params):
    """Whole compressors through the emulated backend's segment calls: frames and sums
    as on the CPU, the fast decode path taken, a corrupt body refused alike."""

    @contextlib.contextmanager
    def serving():
        with monkeypatch.context() as patch:
            patch.setitem(backends._BACKENDS, "cpu", setup.backend)
            yield

    test_buckets_gpu.check_bucket_frames(setup, name, serving, params)


def test_emulated_sign_bucket_launches(cuda_on_host):
    """A bucket of 30 tensors: signSGD takes one launch and one read to encode, two
    launches and one read for EF-signSGD, two launches and one read to decode; TernGrad
    the 3LC bucket encoder's five launches."""
    cuda, calls = cuda_on_host.backend, cuda_on_host.calls
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=gen) for n in range(1, 301, 10)]
    es = [torch.zeros_like(x) for x in xs]
    reads = []
    read_state = _runtime._read_state
    with pytest.MonkeyPatch.context() as patch:
        patch_cuda(patch, "_read_state", lambda st: reads.append(1) or read_state(st))
        bodies = cuda.sign_encode_segments(xs)
        assert calls == ["sign_encode_segments"] and len(reads) == 1
        sums, bad = cuda.efsign_sums_segments(xs, es)
        cuda.efsign_encode_segments(xs, es, [0.5] * len(xs), bad)
        assert calls[1:] == ["sign_ef_sums_segments", "sign_ef_encode_segments"]
        assert len(reads) == 2
        frame = torch.cat(bodies)
        lens = np.array([b.numel() for b in bodies], np.int64)
        ns = np.array([x.numel() for x in xs], np.int64)
        outs = [torch.zeros_like(x) for x in xs]
        starts = np.cumsum(lens) - lens
        assert cuda.sign_decode_segments(frame, starts, ns, np.ones(len(xs)), outs) is None
        assert calls[3:] == ["sign_decode_check_segments", "sign_decode_add_segments"]
        assert len(reads) == 3
    for x, out in zip(xs, outs, strict=True):
        assert torch.equal(out, torch.where(x < 0, -1.0, 1.0))
    calls.clear()
    encoded = cuda.terngrad_encode_segments(xs, list(range(len(xs))))
    assert all(e is not None for e in encoded)
    assert calls == [
        "threelc_absmax_segments",
        "quant_terngrad_quartic_segments",
        "threelc_zre_run_starts_segments",
        "threelc_zre_flags",
        "threelc_zre_scatter_segments",
    ]


def test_emulated_topk_bucket_encode_launches(cuda_on_host):
    """A bucket of 30 tensors: top-k's (and DGC's) encode is one launch sequence of ten
    kernels (two scans on torch between) and one read, after the last launch."""
    cuda, calls = cuda_on_host.backend, cuda_on_host.calls
    gen = torch.Generator().manual_seed(8)
    gs = [torch.randn(n, generator=gen) for n in range(1, 301, 10)]
    es = [torch.zeros_like(g) for g in gs]
    us = [torch.zeros_like(g) for g in gs]
    ks = [max(1, g.numel() // 10) for g in gs]
    reads = []
    read_state = _runtime._read_state
    with pytest.MonkeyPatch.context() as patch:
        patch_cuda(patch, "_read_state", lambda st: reads.append(list(calls)) or read_state(st))
        for velocities in (None, us):
            calls.clear()
            reads.clear()
            cuda.topk_encode_segments(gs, es, ks, velocities, 0.9)
            assert calls == [
                "sparse_topk_finite_segments",
                "sparse_topk_update_segments",
                "sparse_topk_pick_segments",
                "sparse_topk_histogram_segments",
                "sparse_topk_pick_segments",
                "sparse_topk_histogram_segments",
                "sparse_topk_pick_segments",
                "sparse_topk_ties_segments",
                "sparse_topk_keep_segments",
                "sparse_topk_gather_segments",
            ]
            assert reads == [calls]  # one read, after every launch


# ---- the whole training path on the emulated CUDA backend ------------------------------------

TRAINING_CASES = [
    ("3lc", {}),
    ("dqsg", {"levels": 1}),
    ("qsgd", {}),
    ("efsignsgd", {}),
    ("topk", {"ratio": 0.05}),
    ("topkq", {"ratio": 0.05}),
    ("dgc", {"ratio": 0.05, "momentum": 0.0}),  # the helpers' optimizer has momentum
    ("randomk", {"ratio": 0.1}),
    ("gspar", {"ratio": 0.1, "error_feedback": True}),
    ("randomk", {"ratio": 0.2, "unbiased": False, "error_feedback": True}),
    ("ndqsg", {"bucket_size": 64}),
]


@pytest.mark.parametrize("exchange", ["allgather", "auto"])
@pytest.mark.parametrize("name,params", TRAINING_CASES, ids=[f"{n}{p}" for n, p in TRAINING_CASES])
def test_emulated_cuda_path_trains_as_the_cpu_path(
    cuda_on_host, monkeypatch, name, params, exchange
):
    """Three simulated ranks train four steps with ``DistributedOptimizer`` (the allgather
    exchange, or the one "auto" picks: two-stage where the compressor re-compresses): with
    the emulated CUDA backend serving every tensor (bucket encoders, device frame scan,
    bucket decoders, kernels/*.cu built for the host) every rank ends with the parameters
    the CPU backend gives, bit for bit; the allgather path decodes no payload on its own."""
    from hvdcompress.training.simulate import run_ranks
    from tests.mpi.helpers import digest, make_model, train, wrap

    start = make_model()  # once: the ranks' threads share torch's global generator

    def run(transport):
        model = copy.deepcopy(start)
        comp = hvdcompress.get_compressor(name, **params)
        train(model, wrap(model, comp, backend=transport, exchange=exchange), transport.rank, 4)
        return digest(model.parameters())

    want = run_ranks(3, run)
    cuda_on_host.calls.clear()
    per_payload = []
    unframe_parsed = wire.unframe_parsed
    with monkeypatch.context() as patch:
        patch.setitem(backends._BACKENDS, "cpu", cuda_on_host.backend)
        patch.setattr(
            wire, "unframe_parsed", lambda *a: per_payload.append(1) or unframe_parsed(*a)
        )
        got = run_ranks(3, run)
    assert len(set(want)) == 1
    assert got == want
    assert "hvd_frame_table" in cuda_on_host.calls  # the frames were scanned as on a GPU
    if name in ("topk", "topkq", "dgc"):  # selected by the bucket encoder's radix select
        assert "sparse_topk_gather_segments" in cuda_on_host.calls
    if name == "gspar":  # every tensor's scale iteration at once
        assert "quant_gspar_gather_segments" in cuda_on_host.calls
    if name == "ndqsg":  # the nested code (rho 3: ternary) encoded and decoded as buckets
        assert "quant_dqsg_quartic_segments" in cuda_on_host.calls
        assert "quant_dqsg_quartic_decode_add_segments" in cuda_on_host.calls
    if exchange == "allgather":  # decoded by the bucket decoders (stage 2 of the
        assert per_payload == []  # two-stage exchange decodes payload by payload)


def test_emulated_gspar_segments_of_subnormal_gradients_match_cpu(setup):
    """c capped at the largest float32 on the device's host loop as in the C encoder."""
    gs = [torch.full((4099,), 1e-40), torch.full((77,), -3e-41), torch.randn(513)]
    budgets = [409.9, 7.7, 51.3]
    want = cpu_backend.gspar_encode_segments(gs, [5, 6, 7], budgets, 1024)
    got = setup.backend.gspar_encode_segments(gs, [5, 6, 7], budgets, 1024)
    assert got[1] == want[1]
    for g_body, w_body in zip(got[0], want[0], strict=True):
        assert (g_body is None) == (w_body is None)
        if w_body is not None:
            assert torch.equal(g_body, w_body)
    assert want[0][0] is not None and want[0][0].numel() > 0  # the native path kept some
