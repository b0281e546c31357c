"""CPU backend: the C library of ``kernels/*.c`` (``threelc.c``, ``primitives.c``,
``sign.c``, ``quant.c``, ``sparse.c``, ``frame.c``) called through ctypes.

The library is built by ``pip install`` (setup.py) as ``hvdcompress._codec_cpu``. When
the package runs without that build (a GPU node that only has the checkout on
PYTHONPATH), or a source is newer than it (an edited checkout), it is compiled once with
the system C compiler into ``$HVDC_CACHE`` (default ``~/.cache/hvdcompress``), keyed by a
hash of the sources and flags. Sources, flags and where to find them (the repo's
``kernels/`` or the installed package's copy) come from ``hvdcompress._native``.

Each call passes raw data pointers of contiguous tensors; the C functions neither
allocate nor keep pointers, so the GIL is released (ctypes does this) and tensors
stay owned by torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import math
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from hvdcompress import _native
from hvdcompress.backends.records import FIXED_HEADER_BYTES, SCAN, FrameScan, ThreeLCEncoded
from hvdcompress.errors import PayloadError

_SOURCES = [_native.kernel_dir() / name for name in _native.C_SOURCES]

_i64, _u32, _f32, _int, _p = (
    ctypes.c_int64,
    ctypes.c_uint32,
    ctypes.c_float,
    ctypes.c_int,
    (ctypes.c_void_p),
)
_SIGNATURES = {
    "hvdc_tlc_absmax_bits": (_u32, [_p, _p, _i64]),
    "hvdc_tlc_quantize": (None, [_p, _p, _p, _f32, _i64, _p, _p]),
    "hvdc_tlc_quartic_encode": (None, [_p, _i64, _p]),
    "hvdc_tlc_scale": (_f32, [_u32, _f32]),
    "hvdc_tlc_encode": (_i64, [_p, _p, _f32, _i64, _p]),
    "hvdc_tlc_zre_encode": (_i64, [_p, _i64, _p]),
    "hvdc_tlc_zre_encode_portable": (_i64, [_p, _i64, _p]),
    "hvdc_tlc_zre_decoded_len": (_i64, [_p, _i64]),
    "hvdc_tlc_zre_decode": (_i64, [_p, _i64, _p, _i64]),
    "hvdc_tlc_quartic_decode": (_i64, [_p, _i64, _p]),
    "hvdc_tlc_dequantize": (_i64, [_p, _i64, _f32, _p, _int]),
    "hvdc_tlc_decode": (_i64, [_p, _i64, _i64, _f32, _p, _int]),
    "hvdc_checksum": (_u32, [_p, _i64, _i64]),
    "hvdc_checksum_segments": (None, [_p, _i64, _p, _p, _p]),
    "hvdc_tlc_encode_segments": (None, [_i64, _p, _p, _p, _p, _p, _p, _p, _p]),
    "hvdc_tlc_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p, _p, _p]),
    # kernels/frame.c
    "hvdc_frame_scan": (_i64, [_p, _i64, _i64, _p, _p]),
    "hvdc_frame_write": (None, [_i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p]),
    # shared primitives (kernels/primitives.c)
    "hvdc_prim_uniform": (None, [ctypes.c_uint64, _i64, _i64, _p]),
    "hvdc_prim_bitpack": (None, [_p, _i64, _int, _p]),
    "hvdc_prim_bitunpack": (_i64, [_p, _i64, _i64, _int, _p]),
    "hvdc_prim_chunk_sums": (None, [_p, _i64, _i64, _int, _p]),
    # sign codecs (kernels/sign.c)
    "hvdc_sign_encode": (_int, [_p, _i64, _p]),
    "hvdc_efsign_sums": (_int, [_p, _p, _i64, _i64, _p]),
    "hvdc_efsign_encode": (None, [_p, _p, _f32, _i64, _p]),
    "hvdc_sign_decode": (_i64, [_p, _i64, _f32, _p, _int]),
    "hvdc_sign_encode_segments": (None, [_i64, _p, _p, _p, _p]),
    "hvdc_sign_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p]),
    "hvdc_efsign_sums_segments": (None, [_i64, _p, _p, _p, _i64, _p, _p, _p]),
    "hvdc_efsign_encode_segments": (None, [_i64, _p, _p, _p, _p, _p, _p]),
    # stochastic quantisers (kernels/quant.c)
    "hvdc_qsgd_encode": (_int, [_p, _i64, _int, _int, _i64, ctypes.c_uint64, _i64, _p, _p]),
    "hvdc_qsgd_decode": (_i64, [_p, _i64, _int, _int, _i64, _p, _int]),
    "hvdc_prim_unpack_groups": (None, [_p, _i64, _int, _p, _int]),
    "hvdc_prim_pack_groups": (None, [_p, _i64, _int, _p, _int]),
    "hvdc_terngrad_quartic": (None, [_p, _i64, _f32, ctypes.c_uint64, _i64, _p]),
    "hvdc_dqsg_quantize": (_int, [_p, _i64, _int, _i64, ctypes.c_uint64, _i64, _int, _p, _p]),
    "hvdc_dqsg_dequantize": (None, [_p, _i64, _p, _i64, ctypes.c_uint64, _i64, _p, _int]),
    # top-k selection (kernels/sparse.c)
    "hvdc_ndqsg_coset": (None, [_p, _i64, _int, _int, _p]),
    "hvdc_ndqsg_side_decode": (
        _i64,
        [_p, _i64, _p, _p, _int, _i64, ctypes.c_uint64, _p, _int, _p],
    ),
    "hvdc_dgc_update": (_int, [_p, _p, _p, _i64, _f32, _int]),
    "hvdc_randomk_encode_segments": (
        None,
        [_i64, _p, _p, _p, _u32, _p, _p, _p, _p, _p],
    ),
    "hvdc_randomk_ef_encode_segments": (None, [_i64, _p, _p, _p, _p, _u32] + [_p] * 6),
    "hvdc_randomk_decode_segments": (
        _i64,
        [_i64, _p, _p, _p, _p, _p, _u32, _f32, _p, _p, _p],
    ),
    "hvdc_gspar_encode_segments": (None, [_i64, _p, _p, _int, _p, _p, _p, _i64] + [_p] * 9),
    "hvdc_gspar_round": (_i64, [_p, _i64, _f32, _i64, _p]),
    "hvdc_gspar_draw": (_i64, [_p, _i64, _f32, _int, ctypes.c_uint64, _int, _p, _p, _i64]),
    "hvdc_randomk_encode": (_i64, [_p, _i64, ctypes.c_uint64, _u32, _p, _p, _i64]),
    "hvdc_randomk_decode": (
        _i64,
        [_p, _i64, _i64, ctypes.c_uint64, _u32, _f32, _p, _int, _p],
    ),
    "hvdc_topk_kth_bits": (_u32, [_p, _i64, _i64, _u32, _i64, _p]),
    "hvdc_topk_collect": (_i64, [_p, _i64, _u32, _p, _p, _i64]),
    "hvdc_topk_keep": (_i64, [_p, _i64, _u32, _p, _u32, _i64, _p]),
    "hvdc_topk_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p, _p, _p]),
    "hvdc_topk_encode_segments": (None, [_i64, _p, _p, _p, _f32] + [_p] * 10),
    "hvdc_topkq_select_segments": (None, [_i64] + [_p] * 13),
    "hvdc_topkq_write_segments": (None, [_i64] + [_p] * 10),
    "hvdc_topkq_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p, _p, _p]),
    "hvdc_qsgd_decode_segments": (_i64, [_i64, _p, _p, _p, _int, _int, _i64, _p, _p]),
    "hvdc_terngrad_encode_segments": (None, [_i64, _p, _p, _p, _p, _p, _p, _p, _p]),
    "hvdc_dqsg_encode_segments": (None, [_i64, _p, _p, _p, _int, _int, _i64] + [_p] * 5),
    "hvdc_dqsg_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p, _int, _int, _i64, _p, _p, _p]),
    "hvdc_digits_encode_segments": (None, [_i64, _p, _p, _p, _int, _int, _int, _i64] + [_p] * 8),
    "hvdc_digits_decode_segments": (
        _i64,
        [_i64, _p, _p, _p, _p, _p, _int, _int, _i64, _f32] + [_p] * 6,
    ),
}
# Negative return codes of the decoders, per source file.
_ERRORS = {  # kernels/threelc.c (TLC_ERR_*)
    -1: "zero-run decoding does not give exactly ceil(numel / 5) quartic bytes",
    -2: "a quartic byte is above 242",
    -3: "a padding digit of the last group is not zero",
}
_PRIM_ERRORS = {  # kernels/primitives.c (PRIM_ERR_*), sign.c and quant.c (QUANT_ERR_*)
    -1: "the packed body does not have ceil(numel * bits / 8) bytes",
    -4: "a padding bit after the last packed value is set",
    -5: "a QSGD norm is negative or not finite",
    -6: "a QSGD level is above the levels or a zero is signed",
    -7: "QSGD levels outside 1..127 or code bits outside 1..8 (the caller's arguments)",
}
NONFINITE_BITS = 0x7F800000  # abs bits at or above this are Inf or NaN


def _built_library() -> Path | None:
    """The library pip built, unless a source file is newer (an edited checkout). The
    sources an installed package ships (hvdcompress/kernels) come from the library's own
    build, whatever their file times after unpacking: they never make it stale."""
    newest_source = 0.0
    if _native.kernel_dir() != _native.PACKAGE_DIR / _native.SOURCE_DIR:
        newest_source = max((src.stat().st_mtime for src in _SOURCES if src.is_file()), default=0)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _native.PACKAGE_DIR / f"{_native.CPU_LIBRARY}{suffix}"
        if candidate.exists() and candidate.stat().st_mtime >= newest_source:
            return candidate
    return None


def _compile_library() -> Path:
    missing = [str(src) for src in _SOURCES if not src.is_file()]
    if missing:
        raise RuntimeError(
            f"hvdcompress: the CPU codec library needs compiling but its sources are "
            f"missing ({', '.join(missing)}); run `pip install .`"
        )
    digest = hashlib.sha256()
    for src in _SOURCES:
        digest.update(src.read_bytes())
    digest.update(" ".join(_native.C_FLAGS).encode())
    cache = Path(os.environ.get("HVDC_CACHE", Path.home() / ".cache" / "hvdcompress"))
    target = cache / f"codec_cpu-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(
            "hvdcompress: the CPU codec library is not built and no C compiler "
            "was found; run `pip install .` or set CC"
        )
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [cc, *_native.C_FLAGS, "-shared", "-fPIC", "-o", str(out), *map(str, _SOURCES)],
            check=True,
        )
        os.replace(out, target)  # atomic: concurrent ranks may compile at once
    return target


def _load() -> ctypes.CDLL:
    path = _built_library()
    if path is None or os.environ.get("HVDC_REBUILD_CPU") == "1":
        path = _compile_library()
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


LIB = _load()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_local = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """A per-thread byte buffer that grows to the largest tensor seen and is then reused:
    a fresh allocation of that size would pay its page faults on every call."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 4096), dtype=torch.uint8)
        _local.scratch = buf
    return buf


def _check(code: int, errors: dict[int, str] = _ERRORS) -> None:
    """Raise PayloadError (field "body") for a negative return code of the C library."""
    if code < 0:
        raise PayloadError("body", errors.get(code, f"error code {code}"))


def scale_for(max_bits: int, sparsity: float) -> tuple[float, bool]:
    """S = float32(sparsity) * M in float32, and whether the input (or S) is non-finite."""
    if max_bits >= NONFINITE_BITS:
        return 0.0, True
    scale = LIB.hvdc_tlc_scale(max_bits, sparsity)
    if not math.isfinite(scale):  # s * M overflowed float32
        return 0.0, True
    return scale, False


# ---- fused codec path -------------------------------------------------------------------


def threelc_encode(g: torch.Tensor, e: torch.Tensor | None, sparsity: float) -> ThreeLCEncoded:
    n = g.numel()
    scale, nonfinite = scale_for(LIB.hvdc_tlc_absmax_bits(_ptr(g), _ptr(e), n), sparsity)
    if nonfinite:
        return ThreeLCEncoded(torch.empty(0, dtype=torch.uint8), 0.0, True)
    scratch = _scratch((n + 4) // 5 + 2)
    length = LIB.hvdc_tlc_encode(_ptr(g), _ptr(e), scale, n, _ptr(scratch))
    return ThreeLCEncoded(scratch[:length].clone(), scale, False)


def threelc_decode(
    body: torch.Tensor, numel: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    _check(LIB.hvdc_tlc_decode(_ptr(body), body.numel(), numel, scale, _ptr(out), int(accumulate)))


def checksum(buf: torch.Tensor, offset: int) -> int:
    return int(LIB.hvdc_checksum(_ptr(buf), buf.numel(), offset))


def checksum_segments(buf: torch.Tensor, starts: list[int], lengths: list[int]) -> list[int]:
    """``checksum`` (offset 0) of each segment [start, start + length) of buf: one call."""
    count = len(starts)
    table = np.array([starts, lengths], dtype=np.int64)
    out = np.empty(count, dtype=np.uint32)
    if count:
        LIB.hvdc_checksum_segments(
            _ptr(buf), count, table[0].ctypes.data, table[1].ctypes.data, out.ctypes.data
        )
    return out.tolist()


def store_checksums(buf: torch.Tensor, starts: list[int], lengths: list[int], field: int) -> None:
    """Write each segment's ``checksum`` (offset 0, computed with its 4 bytes at ``start +
    field`` zero) little-endian into those 4 bytes: a frame's checksum fields."""
    sums = np.asarray(checksum_segments(buf, starts, lengths), dtype="<u4")
    at = np.asarray(starts, dtype=np.int64)[:, None] + field + np.arange(4)
    buf.numpy()[at.reshape(-1)] = sums.view(np.uint8)


# ---- building blocks --------------------------------------------------------------------


def quantize(x: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    scale, nonfinite = scale_for(LIB.hvdc_tlc_absmax_bits(_ptr(x), None, n), sparsity)
    if nonfinite:
        raise ValueError("quantize: input holds NaN or Inf (or max|x| * sparsity overflows)")
    q = torch.empty(n, dtype=torch.int8)
    LIB.hvdc_tlc_quantize(_ptr(x), None, None, scale, n, _ptr(q), None)
    return q, torch.tensor(scale, dtype=torch.float32)


def quartic_encode(q: torch.Tensor) -> torch.Tensor:
    if q.numel() and (q.min() < -1 or q.max() > 1):
        raise ValueError("quartic_encode: digits must be in {-1, 0, 1}")
    out = torch.empty((q.numel() + 4) // 5, dtype=torch.uint8)
    LIB.hvdc_tlc_quartic_encode(_ptr(q), q.numel(), _ptr(out))
    return out


def quartic_decode(buf: torch.Tensor, numel: int) -> torch.Tensor:
    q = torch.empty(numel, dtype=torch.int8)
    _check(LIB.hvdc_tlc_quartic_decode(_ptr(buf), numel, _ptr(q)))
    return q


def zero_run_encode(buf: torch.Tensor) -> torch.Tensor:
    if buf.numel() and buf.max() > 242:
        raise ValueError("zero_run_encode: quartic bytes are at most 242")
    out = torch.empty(buf.numel() + 2, dtype=torch.uint8)  # 2 bytes of encoder slack
    length = LIB.hvdc_tlc_zre_encode(_ptr(buf), buf.numel(), _ptr(out))
    return out[:length].clone()


def zero_run_decode(buf: torch.Tensor, expected_len: int | None = None) -> torch.Tensor:
    total = LIB.hvdc_tlc_zre_decoded_len(_ptr(buf), buf.numel())
    if expected_len is not None and total != expected_len:
        raise PayloadError(
            "body", f"zero-run decoding gives {total} bytes, expected {expected_len}"
        )
    out = torch.empty(total, dtype=torch.uint8)
    _check(LIB.hvdc_tlc_zre_decode(_ptr(buf), buf.numel(), _ptr(out), total))
    return out


# ---- shared primitives (kernels/primitives.c; see hvdcompress.codecs.primitives) ----------


def uniform(key: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """n float32 uniforms in [0, 1): counter-based, element i from (key, i)."""
    out = torch.empty(n, dtype=torch.float32)
    if n:
        LIB.hvdc_prim_uniform(key, 0, n, _ptr(out))
    return out


def bitpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    if n:
        LIB.hvdc_prim_bitpack(_ptr(codes), n, bits, _ptr(out))
    return out


def bitunpack(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    codes = torch.empty(n, dtype=torch.uint8)
    _check(LIB.hvdc_prim_bitunpack(_ptr(buf), buf.numel(), n, bits, _ptr(codes)), _PRIM_ERRORS)
    return codes


def chunk_sums(x: torch.Tensor, chunk: int, square: bool) -> torch.Tensor:
    n = x.numel()
    out = torch.empty((n + chunk - 1) // chunk, dtype=torch.float64)
    if n:
        LIB.hvdc_prim_chunk_sums(_ptr(x), n, chunk, int(square), _ptr(out))
    return out


# ---- threads --------------------------------------------------------------------------------

_MIN_PART = 1 << 18  # elements: below this a part costs more to hand out than to encode


def num_threads() -> int:
    """Threads for the CPU codecs: ``$HVDC_NUM_THREADS`` when set (an int >= 1), else the
    CPUs this process may run on divided by the ranks on this node (Open MPI's, MPICH's,
    Slurm's or Horovod's local size), at least 1. The bytes never depend on it."""
    return _threads_for(os.environ.get("HVDC_NUM_THREADS", "").strip())


def splits(n: int) -> bool:
    """Whether a tensor of n elements is cut into parts for the codec threads: a bucket's
    one-call encoders leave such tensors to the per-tensor (threaded) path."""
    return n >= 2 * _MIN_PART and num_threads() > 1


@functools.lru_cache(maxsize=8)
def _threads_for(setting: str) -> int:
    if setting:
        if not setting.isdigit() or int(setting) < 1:
            raise ValueError(f"HVDC_NUM_THREADS must be an int >= 1, got {setting!r}")
        return int(setting)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = 1
    for var in (
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "MPI_LOCALNRANKS",
        "SLURM_NTASKS_PER_NODE",
        "HOROVOD_LOCAL_SIZE",
    ):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) >= 1:
            local = int(value)
            break
    return max(1, (cpus or 1) // local)


_pool_lock = threading.Lock()
_pool: list = []  # [ThreadPoolExecutor, its size]


def _executor(threads: int):
    from concurrent.futures import ThreadPoolExecutor

    with _pool_lock:
        if not _pool or _pool[1] != threads:
            if _pool:
                _pool[0].shutdown(wait=False)
            _pool[:] = [ThreadPoolExecutor(threads, thread_name_prefix="hvdc-codec"), threads]
        return _pool[0]


def _parts(n: int, align: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering 0..n, every lo a multiple of ``align``: one per thread (fewer
    when the parts would be under _MIN_PART elements)."""
    if n < 2 * _MIN_PART:
        return [(0, n)]
    count = min(num_threads(), n // _MIN_PART)
    if count <= 1:
        return [(0, n)]
    per_part = -(-n // count)
    step = -(-per_part // align) * align  # ceil(n / count), rounded up to align
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def _run_parts(fn, parts: list[tuple[int, int]]) -> list:
    """fn(lo, hi) for every part, on the pool when there is more than one (ctypes releases
    the GIL during each C call)."""
    if len(parts) == 1:
        return [fn(*parts[0])]
    return list(_executor(len(parts)).map(lambda part: fn(*part), parts))


# ---- sign codecs (kernels/sign.c; see hvdcompress.codecs.sign) -------------------------------

_F32 = 4


def sign_encode(x: torch.Tensor) -> torch.Tensor | None:
    """The packed sign bits of x (bit 1 for x < 0), or None when x holds a NaN or an Inf."""
    n = x.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    base, dst = _ptr(x), _ptr(out)

    def part(lo: int, hi: int) -> int:
        return LIB.hvdc_sign_encode(base + _F32 * lo, hi - lo, dst + lo // 8)

    return None if any(_run_parts(part, _parts(n, 8))) else out


def sign_encode_segments(xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``sign_encode`` of each tensor (a bucket) in one native call over a segment table;
    the bodies are views of one buffer."""
    sizes = [x.numel() for x in xs]
    nbytes = [(n + 7) // 8 for n in sizes]
    buf = torch.empty(sum(nbytes), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes)) if xs else []
    table = np.array(
        [[x.data_ptr() for x in xs], sizes, [b.data_ptr() for b in bodies]], dtype=np.uint64
    )
    flags = np.zeros(len(xs), dtype=np.int32)
    if xs:
        LIB.hvdc_sign_encode_segments(
            len(xs),
            table[0].ctypes.data,
            table[1].ctypes.data,
            table[2].ctypes.data,
            flags.ctypes.data,
        )
    return [None if bad else body for bad, body in zip(flags.tolist(), bodies, strict=True)]


EF_CHUNK = 1024  # elements per order-fixed partial sum of EF-signSGD's mean |a|


def efsign_sums(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
    """float64 sums of |g + e| over EF_CHUNK-element chunks (each left to right), or None
    when g + e holds a NaN or an Inf."""
    n = g.numel()
    sums = torch.empty((n + EF_CHUNK - 1) // EF_CHUNK, dtype=torch.float64)
    pg, pe, ps = _ptr(g), _ptr(e), _ptr(sums)

    def part(lo: int, hi: int) -> int:
        off = _F32 * lo
        return LIB.hvdc_efsign_sums(
            pg + off, pe + off, hi - lo, EF_CHUNK, ps + 8 * (lo // EF_CHUNK)
        )

    return None if any(_run_parts(part, _parts(n, EF_CHUNK))) else sums


def efsign_encode(g: torch.Tensor, e: torch.Tensor, scale: float) -> torch.Tensor:
    """The sign bits of a = g + e; e <- a - (a < 0 ? -scale : scale). a is finite."""
    n = g.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8)
    pg, pe, po = _ptr(g), _ptr(e), _ptr(out)

    def part(lo: int, hi: int) -> None:
        LIB.hvdc_efsign_encode(pg + _F32 * lo, pe + _F32 * lo, scale, hi - lo, po + lo // 8)

    _run_parts(part, _parts(n, 8))
    return out


def sign_decode(
    body: torch.Tensor, n: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    """out = (bit ? -scale : scale), or out += that; body has ceil(n / 8) bytes."""
    _check(LIB.hvdc_sign_decode(_ptr(body), n, scale, _ptr(out), int(accumulate)), _PRIM_ERRORS)


# ---- stochastic quantisers (kernels/quant.c; see hvdcompress.codecs.quant) --------------------


def qsgd_encode(
    x: torch.Tensor, levels: int, bits: int, bucket: int, key: int
) -> torch.Tensor | None:
    """The QSGD body (norms, then packed codes) of x, or None when x holds a NaN or an Inf
    or a norm overflows float32."""
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    body = torch.empty(4 * nb + (n * bits + 7) // 8, dtype=torch.uint8)
    px, pb = _ptr(x), _ptr(body)
    packed = pb + 4 * nb
    align = bucket * 8 // math.gcd(bucket, 8)  # whole buckets and whole bytes

    def part(lo: int, hi: int) -> int:
        return LIB.hvdc_qsgd_encode(
            px + _F32 * lo,
            hi - lo,
            levels,
            bits,
            bucket,
            key,
            lo,
            pb + 4 * (lo // bucket),
            packed + lo * bits // 8,
        )

    return None if any(_run_parts(part, _parts(n, align))) else body


def qsgd_decode(
    body: torch.Tensor,
    n: int,
    levels: int,
    bits: int,
    bucket: int,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """Decode a QSGD body of the right length into out; PayloadError, out untouched, on a
    bad norm, padding or code."""
    code = LIB.hvdc_qsgd_decode(_ptr(body), n, levels, bits, bucket, _ptr(out), int(accumulate))
    _check(code, _PRIM_ERRORS)


def terngrad_encode(x: torch.Tensor, key: int) -> tuple[torch.Tensor, float] | None:
    """(zero-run-encoded quartic body, M = max|x|) of x, or None when x holds a NaN or an
    Inf."""
    n = x.numel()
    bits = LIB.hvdc_tlc_absmax_bits(_ptr(x), None, n)
    if bits >= NONFINITE_BITS:
        return None
    scale = struct.unpack("<f", struct.pack("<I", bits))[0]
    m = (n + 4) // 5
    quartic = _scratch(2 * m + 2)
    px, pq = _ptr(x), _ptr(quartic)

    def part(lo: int, hi: int) -> None:
        LIB.hvdc_terngrad_quartic(px + _F32 * lo, hi - lo, scale, key, lo, pq + lo // 5)

    _run_parts(part, _parts(n, 5 * 8))
    out = pq + m
    length = LIB.hvdc_tlc_zre_encode(pq, m, out)
    return quartic[m : m + length].clone(), scale


def dqsg_quantize(
    w: torch.Tensor, levels: int, bucket: int, key: int, code_offset: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q + code_offset as uint8, deltas float32 per bucket) of DQSG's quantiser, or None
    when w holds a NaN or an Inf."""
    n = w.numel()
    nb = (n + bucket - 1) // bucket
    deltas = torch.empty(nb, dtype=torch.float32)
    q = torch.empty(n, dtype=torch.uint8)
    pw, pd, pq = _ptr(w), _ptr(deltas), _ptr(q)

    def part(lo: int, hi: int) -> int:
        return LIB.hvdc_dqsg_quantize(
            pw + _F32 * lo, hi - lo, levels, bucket, key, lo, code_offset,
            pd + 4 * (lo // bucket), pq + lo,
        )  # fmt: skip

    return None if any(_run_parts(part, _parts(n, bucket))) else (q, deltas)


def dqsg_dequantize(
    q: torch.Tensor,
    deltas: torch.Tensor,
    bucket: int,
    key: int,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """out = delta * (q - dither), or out += that (q int8, deltas validated float32 bytes)."""
    n = q.numel()
    pq, pd, po = _ptr(q), _ptr(deltas), _ptr(out)

    def part(lo: int, hi: int) -> None:
        LIB.hvdc_dqsg_dequantize(
            pq + lo, hi - lo, pd + 4 * (lo // bucket), bucket, key, lo, po + _F32 * lo,
            int(accumulate),
        )  # fmt: skip

    _run_parts(part, _parts(n, bucket))


def ndqsg_coset(k: torch.Tensor, rho: int, code_offset: int) -> torch.Tensor:
    """m + code_offset as uint8 for NDQSG's coset m = k - rho * rint(k / rho) of the int8 k."""
    out = torch.empty(k.numel(), dtype=torch.uint8)
    LIB.hvdc_ndqsg_coset(_ptr(k), k.numel(), rho, code_offset, _ptr(out))
    return out


def ndqsg_side_decode(
    m: torch.Tensor,
    deltas: torch.Tensor,
    y: torch.Tensor,
    rho: int,
    bucket: int,
    key: int,
    out: torch.Tensor | None,
    accumulate: bool,
    k_true: torch.Tensor | None,
) -> int:
    """NDQSG's side-information decode of the int8 cosets m: out <- (or +=) w_hat (out
    None: not formed); returns how many decoded fine indices differ from the int8 k_true
    (None: 0). One pass."""
    return int(
        LIB.hvdc_ndqsg_side_decode(
            _ptr(m), m.numel(), _ptr(deltas), _ptr(y), rho, bucket, key, _ptr(out),
            int(accumulate), _ptr(k_true),
        )
    )  # fmt: skip


# ---- top-k selection (kernels/sparse.c; see hvdcompress.codecs.sparse) ----------------------

TOPK_SAMPLE = 65536  # elements of the strided sample that bounds the threshold from below
# Tensors from this size on are sampled (every TOPK_MIN_STRIDE-th element at least): a
# bucket's mid-size tensors then cost one collecting pass instead of five radix passes.
# The kept set is exact either way (kernels/sparse.c, topk_select_into, does the same).
TOPK_MIN_SAMPLED = 16384
TOPK_MIN_STRIDE = 16  # a sparser sample cost a 160-tensor bucket 0.3x one tensor's time
_ABS = 0x7FFFFFFF
_ALL = 0xFFFFFFFF


def topk_select(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest |a| (0 < k < n, a finite), ties by lowest
    index: t = the k-th largest abs bits by radix select, then one ordered pass. A strided
    sample's bound first narrows the work to about 2 k candidates (one pass over a); the
    candidates hold every element >= t whenever there are at least k of them, so the
    result is the same as the selection over all of a."""
    n = a.numel()
    hist = _scratch(4 * 2048)
    out = torch.empty(k, dtype=torch.int64)
    pa, ph = _ptr(a), _ptr(hist)
    if n >= TOPK_MIN_SAMPLED and 8 * k <= n:
        stride = max(TOPK_MIN_STRIDE, n // TOPK_SAMPLE)
        m = (n - 1) // stride + 1
        j = min(m, math.ceil(m * 2.0 * k / n) + 64)  # aim at about 2 k candidates
        bound = LIB.hvdc_topk_kth_bits(pa, m, stride, _ABS, j, ph)
        cap = 4 * k + 4096
        cand_idx = torch.empty(cap + 1, dtype=torch.int64)
        cand_bits = torch.empty(cap + 1, dtype=torch.int32)
        count = LIB.hvdc_topk_collect(pa, n, bound, _ptr(cand_idx), _ptr(cand_bits), cap)
        if count >= k:
            t = LIB.hvdc_topk_kth_bits(_ptr(cand_bits), count, 1, _ALL, k, ph)
            LIB.hvdc_topk_keep(_ptr(cand_bits), count, _ALL, _ptr(cand_idx), t, k, _ptr(out))
            return out
    t = LIB.hvdc_topk_kth_bits(pa, n, 1, _ABS, k, ph)
    LIB.hvdc_topk_keep(pa, n, _ABS, None, t, k, _ptr(out))
    return out


def _kept_room(n: int, mean: float) -> int:
    """Room for the kept entries of a random draw with this mean count: 8 standard
    deviations (Poisson bound) and 64 above it, at most n. The draw calls again with the
    exact count when it keeps more (far rarer than once in 10^12 draws)."""
    return min(n, math.ceil(mean + 8.0 * math.sqrt(mean) + 64))


def randomk_encode(
    a: torch.Tensor, key: int, threshold: int, residual: torch.Tensor | None
) -> torch.Tensor:
    """The kept values of the finite flat float32 a (element i kept iff its 24-bit hash is
    below threshold), in index order, from one pass of hashes; residual (not None: error
    feedback) <- a with the kept elements zeroed."""
    n = a.numel()
    cap = _kept_room(n, n * threshold / 2**24)
    while True:
        values = torch.empty(cap + 1, dtype=torch.float32)
        k = LIB.hvdc_randomk_encode(_ptr(a), n, key, threshold, _ptr(values), _ptr(residual), cap)
        if k <= cap:
            return values[:k]
        cap = k


def randomk_encode_segments(
    gs: list[torch.Tensor], keys: list[int], threshold: int, es: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[bool]]:
    """``randomk_encode`` of each (g, key) of a bucket in one native call: (bodies, views
    of one new buffer; non-finite flags). With the residuals ``es`` (error feedback) of
    a = g + e, formed in e (untouched where a is not finite), each e becoming a with the
    kept entries zeroed. A tensor that keeps more than its room (mean + 8 standard
    deviations) is encoded again on its own."""
    count = len(gs)
    ns = _numels(gs)
    caps = np.array([_kept_room(n, n * threshold / 2**24) for n in ns.tolist()], np.int64)
    buf, starts = _bodies_buffer(4 * (caps + 1))
    ks = np.zeros(count, dtype=np.int64)
    bad = np.zeros(count, dtype=np.int32)
    g_at = _addresses(gs)  # locals: alive across the call
    key_at = np.asarray(keys, dtype=np.uint64).reshape(count)
    tail = (_ptr(buf), starts.ctypes.data, caps.ctypes.data, ks.ctypes.data, bad.ctypes.data)
    if es is None:
        LIB.hvdc_randomk_encode_segments(
            count, g_at.ctypes.data, ns.ctypes.data, key_at.ctypes.data, threshold, *tail
        )
    else:
        idx = np.empty(int(caps.max()) + 1 if count else 1, dtype=np.int64)
        e_at = _addresses(es)
        LIB.hvdc_randomk_ef_encode_segments(
            count, g_at.ctypes.data, e_at.ctypes.data, ns.ctypes.data, key_at.ctypes.data,
            threshold, *tail, idx.ctypes.data,
        )  # fmt: skip
    flags = [bool(b) for b in bad.tolist()]
    bodies = []
    for i, (a, k, cap, nonfinite) in enumerate(
        zip(starts.tolist(), ks.tolist(), caps.tolist(), flags, strict=True)
    ):
        if nonfinite:
            bodies.append(buf[:0])
        elif k > cap and es is None:  # more kept than the room: again, alone, with room
            bodies.append(randomk_encode(gs[i], keys[i], threshold, None).view(torch.uint8))
        elif k > cap:  # e holds a: from a copy (randomk_encode's retry reads a after it
            # wrote the residual), e <- a with the kept entries zeroed
            values = randomk_encode(es[i].clone(), keys[i], threshold, es[i])
            bodies.append(values.view(torch.uint8))
        else:
            bodies.append(buf[a : a + 4 * k])
    return bodies, flags


def randomk_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    keys: list[int],
    threshold: int,
    scale: float,
    outs: list[torch.Tensor],
) -> tuple[int, int] | None:
    """``randomk_decode`` (accumulating) of each body of a host frame, one native call:
    None, or (p, code) for the first body p that does not decode (code -1: a value is not
    finite; else the regenerated kept count, which the body does not hold)."""
    count = len(outs)
    most = int(np.minimum(lens // 4, ns).max()) if count else 0
    idx = np.empty(max(most, 1), dtype=np.int64)
    key_at = np.asarray(keys, dtype=np.uint64).reshape(count)
    out_at = _addresses(outs)  # a local: alive across the call
    code = ctypes.c_int64(0)
    rc = LIB.hvdc_randomk_decode_segments(
        count, _ptr(frame), _i64_array(starts), _i64_array(lens), _i64_array(ns),
        key_at.ctypes.data, threshold, scale, out_at.ctypes.data, idx.ctypes.data,
        ctypes.byref(code),
    )  # fmt: skip
    return None if rc == 0 else (-1 - rc, int(code.value))


def randomk_decode(
    body: torch.Tensor,
    key: int,
    n: int,
    threshold: int,
    scale: float,
    out: torch.Tensor,
    accumulate: bool,
) -> int | None:
    """Write (or add) the random-k values of body, times scale, at the regenerated kept
    indices of out. Returns None; or the regenerated kept count, out untouched, when the
    body does not hold exactly that many values. PayloadError, out untouched, for a value
    that is not finite."""
    count = body.numel() // 4 if body.numel() % 4 == 0 else -1
    idx = torch.empty(max(0, min(count, n)), dtype=torch.int64)  # at most the body's values
    got = LIB.hvdc_randomk_decode(
        _ptr(body), count, n, key, threshold, scale, _ptr(out), int(accumulate), _ptr(idx)
    )
    if got == -1 and count != -1:
        raise PayloadError("body", "a random-k value is not finite")
    return None if got == count else got


def dgc_update(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float) -> bool:
    """u <- momentum * u + g (u <- g at momentum 0), v <- v + u in place; True, u and v
    untouched, when the new v would hold a NaN or an Inf."""
    n = g.numel()
    return bool(LIB.hvdc_dgc_update(_ptr(g), _ptr(u), _ptr(v), n, momentum, int(momentum == 0)))


def gspar_encode_segments(
    gs: list[torch.Tensor],
    keys: list[int],
    budgets: list[float],
    chunk: int,
    es: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor | None], list[bool]]:
    """GSpar's encode of each (g, key, budget) of a bucket in one native call: scaled
    values, or with the residuals ``es`` (error feedback) a = g + e, formed in e, with
    unscaled values and e = a with the kept entries zeroed. Returns (bodies in top-k's
    layout, views of one new buffer, or None for a tensor the caller encodes alone: more
    kept than its room, or a scale iteration the native sum does not finish, its e then
    holding a; non-finite flags, e untouched there)."""
    count = len(gs)
    ns = _numels(gs)
    caps = np.array([_kept_room(n, b) for n, b in zip(ns.tolist(), budgets, strict=True)], np.int64)
    wide = (ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT
    buf, starts = _bodies_buffer(caps * np.where(wide == 1, 12, 8))
    most = int(caps.max()) if count else 0
    values = np.empty(max(most, 1), dtype=np.float32)
    idx = np.empty(max(most, 1), dtype=np.int64)
    sums = np.empty(max(int(((ns + chunk - 1) // chunk).max()) if count else 0, 1), np.float64)
    ks = np.zeros(count, dtype=np.int64)
    bad = np.zeros(count, dtype=np.int32)
    g_at = _addresses(gs)  # locals: alive across the call
    e_at = None if es is None else _addresses(es)
    key_at = np.asarray(keys, dtype=np.uint64).reshape(count)
    budget_at = np.asarray(budgets, dtype=np.float64).reshape(count)
    LIB.hvdc_gspar_encode_segments(
        count, g_at.ctypes.data, None if e_at is None else e_at.ctypes.data, int(es is None),
        ns.ctypes.data, key_at.ctypes.data, budget_at.ctypes.data,
        chunk, caps.ctypes.data, wide.ctypes.data, _ptr(buf), starts.ctypes.data,
        ks.ctypes.data, bad.ctypes.data, values.ctypes.data, idx.ctypes.data, sums.ctypes.data,
    )  # fmt: skip
    flags = [bool(b) for b in bad.tolist()]
    bodies: list[torch.Tensor | None] = []
    for a, k, cap, w, nonfinite in zip(
        starts.tolist(), ks.tolist(), caps.tolist(), wide.tolist(), flags, strict=True
    ):
        if nonfinite:
            bodies.append(buf[:0])
        elif k < 0 or k > cap:
            bodies.append(None)
        else:
            bodies.append(buf[a : a + k * (12 if w else 8)])
    return bodies, flags


def gspar_round(a: torch.Tensor, c: float, chunk: int) -> tuple[int, torch.Tensor]:
    """(how many |a_i| * float32(c) >= 1, the float64 sums of the other |a_i| per chunk)."""
    sums = torch.empty((a.numel() + chunk - 1) // chunk, dtype=torch.float64)
    count = LIB.hvdc_gspar_round(_ptr(a), a.numel(), c, chunk, _ptr(sums))
    return int(count), sums


def gspar_draw(
    a: torch.Tensor, c: float, key: int, scaled: bool, budget: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept values, ascending int64 indices) of GSpar's draw at scale float32(c) (c = inf:
    every non-zero entry), from one pass of hashed counters; budget: sum p_i, the mean
    kept count."""
    n = a.numel()
    inf = math.isinf(c)
    cap = n if inf else _kept_room(n, budget)
    while True:
        values = torch.empty(cap, dtype=torch.float32)
        idx = torch.empty(cap, dtype=torch.int64)
        k = LIB.hvdc_gspar_draw(
            _ptr(a), n, 0.0 if inf else c, int(inf), key, int(scaled), _ptr(values), _ptr(idx),
            cap,
        )  # fmt: skip
        if k <= cap:
            return values[:k], idx[:k]
        cap = k


# ---- whole buckets: segment tables (kernels/threelc.c, sign.c, frame.c) -------------------


def _addresses(tensors) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.uint64, count=len(tensors))


def _numels(tensors) -> np.ndarray:
    return np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))


def _bodies_buffer(room: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """One new byte buffer for a bucket's bodies, ``room[p]`` bytes for body p (so that the
    bodies stay valid after the next call), and where each starts in it."""
    starts = np.zeros(room.size, dtype=np.int64)
    np.cumsum(room[:-1], out=starts[1:])
    return torch.empty(int(room.sum()), dtype=torch.uint8), starts


def threelc_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor], sparsities: list[float]
) -> tuple[list[torch.Tensor], list[float], list[bool]]:
    """``threelc_encode`` of each (g, e, sparsity) of a bucket in one native call: (bodies,
    views of one new buffer; scales; non-finite flags)."""
    count = len(gs)
    ns = _numels(gs)
    room = (ns + 4) // 5 + 2
    buf, starts = _bodies_buffer(room)
    scales = np.empty(count, dtype=np.float32)
    lens = np.empty(count, dtype=np.int64)
    s = np.asarray(sparsities, dtype=np.float32)
    g_at, e_at = _addresses(gs), _addresses(es)  # locals: alive across the call
    LIB.hvdc_tlc_encode_segments(
        count,
        g_at.ctypes.data,
        e_at.ctypes.data,
        ns.ctypes.data,
        s.ctypes.data,
        _ptr(buf),
        starts.ctypes.data,
        scales.ctypes.data,
        lens.ctypes.data,
    )
    bad = (lens < 0).tolist()
    bodies = [
        buf[a : a + n] if n >= 0 else buf[:0]
        for a, n in zip(starts.tolist(), lens.tolist(), strict=True)
    ]
    return bodies, scales.tolist(), bad


def threelc_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """``threelc_decode`` (accumulating) of each body ``frame[starts[p]:][:lens[p]]`` into
    ``outs[p]``, one native call: None, or (p, message) of the first body that does not
    decode (the ones before it are added, its output untouched)."""
    code = ctypes.c_int64(0)
    scales32, out_at = np.ascontiguousarray(scales, dtype=np.float32), _addresses(outs)
    rc = LIB.hvdc_tlc_decode_segments(
        len(outs),
        _ptr(frame),
        _i64_array(starts),
        _i64_array(lens),
        _i64_array(ns),
        scales32.ctypes.data,
        out_at.ctypes.data,
        ctypes.byref(code),
    )
    return None if rc == 0 else (-1 - rc, _ERRORS.get(code.value, f"error code {code.value}"))


def sign_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """``sign_decode`` (accumulating) of each body at ``frame[starts[p]:]`` (the caller
    checked the lengths) into ``outs[p]``, one native call: None, or (p, message) of the
    first body with a padding bit set (the ones before it are added)."""
    scales32, out_at = np.ascontiguousarray(scales, dtype=np.float32), _addresses(outs)
    rc = LIB.hvdc_sign_decode_segments(
        len(outs),
        _ptr(frame),
        _i64_array(starts),
        _i64_array(ns),
        scales32.ctypes.data,
        out_at.ctypes.data,
    )
    return None if rc == 0 else (-1 - rc, _PRIM_ERRORS[-4])


def _i64_array(a: np.ndarray) -> int:
    """The address of the caller's contiguous int64 array ``a`` (never a converted
    temporary, which would be freed before the native call reads it)."""
    if a.dtype != np.int64 or not a.flags.c_contiguous:
        raise TypeError("expected a contiguous int64 array")
    return a.ctypes.data


SCAN_FIELDS = 10  # kernels/frame.c (FRAME_FIELDS); their names: records.SCAN_FIELDS


def frame_scan(frame: torch.Tensor, count: int) -> FrameScan | None:
    """The scan of a frame of ``count`` payloads (``FrameScan``: SCAN_FIELDS int64 fields
    and the shape of each, the parameters of each accepted one), or None when its length
    table does not describe it."""
    fields = np.empty((count, SCAN_FIELDS), dtype=np.int64)
    shapes = np.zeros((count, 8), dtype=np.uint64)
    rc = LIB.hvdc_frame_scan(
        _ptr(frame), frame.numel(), count, fields.ctypes.data, shapes.ctypes.data
    )
    if rc < 0:
        return None
    view, col = frame.numpy(), SCAN
    at = fields[:, col["start"]] + FIXED_HEADER_BYTES + 8 * fields[:, col["ndim"]]
    params = [
        view[a:][:n].tobytes() if ok else b""
        for ok, a, n in zip(
            fields[:, col["ok"]].tolist(),
            at.tolist(),
            fields[:, col["params_len"]].tolist(),
            strict=True,
        )
    ]
    return FrameScan(fields, shapes, params)


def frame_write(
    heads: np.ndarray,
    head_starts: np.ndarray,
    head_lens: np.ndarray,
    flags: np.ndarray,
    params: bytes,
    params_lens: np.ndarray,
    bodies: list[torch.Tensor],
) -> torch.Tensor:
    """One rank's frame (kernels/frame.c, hvdc_frame_write): per payload its header
    template (``heads[head_starts[p]:][:head_lens[p]]``), flags, params and body, each
    payload's checksum in place."""
    count = len(bodies)
    body_lens = np.fromiter((b.numel() for b in bodies), dtype=np.int64, count=count)
    param_starts = np.zeros(count, dtype=np.int64)
    np.cumsum(params_lens[:-1], out=param_starts[1:])
    total = 8 * (count + 1) + int(head_lens.sum() + params_lens.sum() + body_lens.sum())
    frame = torch.empty(total, dtype=torch.uint8)
    # locals, so that every array lives across the call
    params_buf = np.frombuffer(params, dtype=np.uint8) if params else np.zeros(1, np.uint8)
    flags8, body_at = np.ascontiguousarray(flags, dtype=np.uint8), _addresses(bodies)
    LIB.hvdc_frame_write(
        count,
        heads.ctypes.data,
        _i64_array(head_starts),
        _i64_array(head_lens),
        flags8.ctypes.data,
        params_buf.ctypes.data,
        _i64_array(param_starts),
        _i64_array(params_lens),
        body_at.ctypes.data,
        _i64_array(body_lens),
        _ptr(frame),
    )
    return frame


def efsign_sums_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor]
) -> tuple[list[list[float]], list[bool]]:
    """``efsign_sums`` of each (g, e) of a bucket in one native call: (each tensor's chunk
    sums, each tensor's non-finite flag)."""
    count = len(gs)
    ns = _numels(gs)
    chunks = (ns + EF_CHUNK - 1) // EF_CHUNK
    starts = np.zeros(count, dtype=np.int64)
    np.cumsum(chunks[:-1], out=starts[1:])
    sums = np.zeros(max(int(chunks.sum()), 1), dtype=np.float64)
    bad = np.zeros(count, dtype=np.int32)
    g_at, e_at = _addresses(gs), _addresses(es)  # locals: alive across the call
    LIB.hvdc_efsign_sums_segments(
        count,
        g_at.ctypes.data,
        e_at.ctypes.data,
        ns.ctypes.data,
        EF_CHUNK,
        sums.ctypes.data,
        starts.ctypes.data,
        bad.ctypes.data,
    )
    bounds = zip(starts.tolist(), (starts + chunks).tolist(), strict=True)
    return [sums[a:b].tolist() for a, b in bounds], [bool(b) for b in bad.tolist()]


def efsign_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor], scales: list[float], skip: list[bool]
) -> list[torch.Tensor]:
    """``efsign_encode`` of each (g, e, scale) of a bucket whose ``skip`` is False, in one
    native call: the bodies (views of one new buffer; empty where skipped)."""
    count = len(gs)
    ns = _numels(gs)
    nbytes = np.where(np.asarray(skip, dtype=bool), 0, (ns + 7) // 8)
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8)
    bodies = list(torch.split(buf, nbytes.tolist())) if count else []
    g_at, e_at, out_at = _addresses(gs), _addresses(es), _addresses(bodies)
    scales32 = np.asarray(scales, dtype=np.float32)
    skip32 = np.asarray(skip, dtype=np.int32)
    LIB.hvdc_efsign_encode_segments(
        count,
        g_at.ctypes.data,
        e_at.ctypes.data,
        ns.ctypes.data,
        scales32.ctypes.data,
        skip32.ctypes.data,
        out_at.ctypes.data,
    )
    return bodies


_TOPK_ERRORS = {  # kernels/sparse.c (TOPK_ERR_*): the messages of codecs/sparse.py
    -1: "an index is outside [0, {n})",
    -2: "indices are not strictly increasing",
    -3: "a top-k value is not finite",
}


def topk_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ks: np.ndarray,
    ns: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """The top-k decode (accumulating) of each body at ``frame[starts[p]:]`` (the caller
    checked its length) of ``ks[p]`` kept values of ``ns[p]``, into ``outs[p]``, one native
    call: None, or (p, message) of the first body that does not decode (the ones before it
    added, its output untouched)."""
    failed = _kept_decode_segments(LIB.hvdc_topk_decode_segments, frame, starts, ks, ns, outs)
    if failed is None:
        return None
    p, code = failed
    return p, _TOPK_ERRORS[code].format(n=int(ns[p]))


def _kept_decode_segments(fn, frame, starts, ks, ns, outs) -> tuple[int, int] | None:
    """Call a kept-set decoder of kernels/sparse.c (top-k, top-k + sign) over a bucket's
    bodies: None, or (p, its error code) for the first body p that does not decode."""
    code = ctypes.c_int64(0)
    wide = (ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT
    out_at = _addresses(outs)  # a local: alive across the call
    rc = fn(
        len(outs),
        _ptr(frame),
        _i64_array(starts),
        _i64_array(ks),
        _i64_array(ns),
        wide.ctypes.data,
        out_at.ctypes.data,
        ctypes.byref(code),
    )
    return None if rc == 0 else (-1 - rc, int(code.value))


def qsgd_encode_segments(
    xs: list[torch.Tensor], levels: int, bits: int, bucket: int, keys: list[int]
) -> list[torch.Tensor | None]:
    """``qsgd_encode`` of each (x, key) of a bucket. A call each: QSGD's encode is bound by
    its codec (norms, uniforms, codes) rather than by the call, so no native bucket
    encoder; the CUDA backend's saves a launch sequence and a read per tensor."""
    return [qsgd_encode(x, levels, bits, bucket, k) for x, k in zip(xs, keys, strict=True)]


def qsgd_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ns: np.ndarray,
    levels: int,
    bits: int,
    bucket: int,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """``qsgd_decode`` (accumulating) of each body at ``frame[starts[p]:]`` (the caller
    checked its length) of ``ns[p]`` values into ``outs[p]``, one native call: None, or
    (p, message) of the first body that does not decode (the ones before it added)."""
    code = ctypes.c_int64(0)
    out_at = _addresses(outs)  # a local: alive across the call
    rc = LIB.hvdc_qsgd_decode_segments(
        len(outs),
        _ptr(frame),
        _i64_array(starts),
        _i64_array(ns),
        levels,
        bits,
        bucket,
        out_at.ctypes.data,
        ctypes.byref(code),
    )
    if rc == 0:
        return None
    return -1 - rc, _PRIM_ERRORS.get(code.value, f"error code {code.value}")


def topk_encode_segments(
    gs: list[torch.Tensor],
    es: list[torch.Tensor],
    ks: list[int],
    us: list[torch.Tensor] | None = None,
    momentum: float = 0.0,
) -> tuple[list[torch.Tensor], list[bool]]:
    """Top-k with error feedback of each (g, e, k) of a bucket in one native call
    (kernels/sparse.c, hvdc_topk_encode_segments): (bodies: k values then k ascending
    indices, int32 below 2**31 elements; views of one new buffer; non-finite flags, e
    untouched there). e becomes g + e with the kept values zeroed, as TopK.encode does.
    DGC (us: the velocities): u <- momentum * u + g, e <- e + u, then the top-k of e, and
    u and e zeroed at the kept entries, as DGC.encode does."""
    count = len(gs)
    ns = _numels(gs)
    k = np.asarray(ks, dtype=np.int64).reshape(count)
    wide = (ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT
    room = k * np.where(wide == 1, 12, 8)
    buf, starts = _bodies_buffer(room)
    most = int(k.max()) if count else 0
    sel = np.empty(max(most, 1), dtype=np.int64)
    cand_idx = np.empty(4 * most + 4097, dtype=np.int64)
    cand_bits = np.empty(4 * most + 4097, dtype=np.uint32)
    hist = np.empty(2048, dtype=np.uint32)
    bad = np.zeros(count, dtype=np.int32)
    g_at, e_at = _addresses(gs), _addresses(es)  # locals: alive across the call
    u_at = None if us is None else _addresses(us)
    LIB.hvdc_topk_encode_segments(
        count,
        g_at.ctypes.data,
        e_at.ctypes.data,
        None if u_at is None else u_at.ctypes.data,
        momentum,
        ns.ctypes.data,
        k.ctypes.data,
        wide.ctypes.data,
        _ptr(buf),
        starts.ctypes.data,
        bad.ctypes.data,
        hist.ctypes.data,
        sel.ctypes.data,
        cand_idx.ctypes.data,
        cand_bits.ctypes.data,
    )
    flags = [bool(b) for b in bad.tolist()]
    bodies = [
        buf[:0] if nonfinite else buf[a : a + r]
        for a, r, nonfinite in zip(starts.tolist(), room.tolist(), flags, strict=True)
    ]
    return bodies, flags


def terngrad_encode_segments(
    xs: list[torch.Tensor], keys: list[int]
) -> list[tuple[torch.Tensor, float] | None]:
    """``terngrad_encode`` of each (x, key) of a bucket in one native call: (body, a view of
    one new buffer; M) or None for a non-finite x."""
    count = len(xs)
    ns = _numels(xs)
    room = (ns + 4) // 5 + 2
    buf, starts = _bodies_buffer(room)
    quartic = _scratch(int(room.max()) if count else 1)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    scales = np.empty(count, dtype=np.float32)
    lens = np.empty(count, dtype=np.int64)
    x_at = _addresses(xs)  # a local: alive across the call
    LIB.hvdc_terngrad_encode_segments(
        count,
        x_at.ctypes.data,
        ns.ctypes.data,
        key_array.ctypes.data,
        _ptr(buf),
        starts.ctypes.data,
        _ptr(quartic),
        scales.ctypes.data,
        lens.ctypes.data,
    )
    return [
        None if n < 0 else (buf[a : a + n], m)
        for a, n, m in zip(starts.tolist(), lens.tolist(), scales.tolist(), strict=True)
    ]


class TopKSignSelection:
    """What the first pass of a bucket's top-k + sign leaves for the second
    (``topkq_select_segments`` -> the caller's magnitudes -> ``topkq_write_segments``)."""

    def __init__(self, gs, es, ks) -> None:
        count = len(gs)
        self.es, self.ns = es, _numels(gs)
        self.ks = np.asarray(ks, dtype=np.int64).reshape(count)
        self.starts = np.zeros(count, dtype=np.int64)
        np.cumsum(self.ks[:-1], out=self.starts[1:])
        chunks = (self.ks + 1023) // 1024  # primitives.abs_sum's chunks
        self.sum_starts = np.zeros(count, dtype=np.int64)
        np.cumsum(chunks[:-1], out=self.sum_starts[1:])
        self.sum_ends = self.sum_starts + chunks
        total = max(int(self.ks.sum()), 1)
        self.sel = np.empty(total, dtype=np.int64)
        self.kept = np.empty(total, dtype=np.float32)
        self.sums = np.zeros(max(int(chunks.sum()), 1), dtype=np.float64)
        self.nonfinite = np.zeros(count, dtype=np.int32)
        self.wide = (self.ns >= 2**31).astype(np.int32)  # codecs/sparse.py INDEX32_LIMIT

    def chunk_sums(self) -> list[list[float]]:
        """Each tensor's order-fixed chunk sums of |kept| (empty when none are kept)."""
        bounds = zip(self.sum_starts.tolist(), self.sum_ends.tolist(), strict=True)
        return [self.sums[a:b].tolist() for a, b in bounds]


def topkq_select_segments(gs, es, ks) -> TopKSignSelection:
    """The first pass of top-k + sign for a bucket, one native call (kernels/sparse.c,
    hvdc_topkq_select_segments): non-finite flags, e = g + e, the kept sets and values and
    the chunk sums of their magnitudes."""
    sel = TopKSignSelection(gs, es, ks)
    most = int(sel.ks.max()) if len(gs) else 0
    cand_idx = np.empty(4 * most + 4097, dtype=np.int64)
    cand_bits = np.empty(4 * most + 4097, dtype=np.uint32)
    hist = np.empty(2048, dtype=np.uint32)
    g_at, e_at = _addresses(gs), _addresses(es)  # locals: alive across the call
    LIB.hvdc_topkq_select_segments(
        len(gs),
        g_at.ctypes.data,
        e_at.ctypes.data,
        sel.ns.ctypes.data,
        sel.ks.ctypes.data,
        sel.nonfinite.ctypes.data,
        sel.sel.ctypes.data,
        sel.kept.ctypes.data,
        sel.starts.ctypes.data,
        sel.sums.ctypes.data,
        sel.sum_starts.ctypes.data,
        hist.ctypes.data,
        cand_idx.ctypes.data,
        cand_bits.ctypes.data,
    )
    return sel


def topkq_write_segments(sel: TopKSignSelection, magnitudes: list[float]) -> list[torch.Tensor]:
    """The second pass, one native call: each finite tensor's body (m, indices, sign bits)
    and its residual less what the body decodes to; the bodies are views of one new
    buffer (empty where non-finite)."""
    skip = sel.nonfinite
    room = np.where(skip == 1, 0, 4 + sel.ks * np.where(sel.wide == 1, 8, 4) + (sel.ks + 7) // 8)
    buf, out_starts = _bodies_buffer(room)
    ms = np.asarray(magnitudes, dtype=np.float32).reshape(len(room))
    e_at = _addresses(sel.es)  # a local: alive across the call
    LIB.hvdc_topkq_write_segments(
        len(room),
        e_at.ctypes.data,
        sel.ks.ctypes.data,
        skip.ctypes.data,
        ms.ctypes.data,
        sel.sel.ctypes.data,
        sel.kept.ctypes.data,
        sel.starts.ctypes.data,
        sel.wide.ctypes.data,
        _ptr(buf),
        out_starts.ctypes.data,
    )
    return [buf[a : a + r] for a, r in zip(out_starts.tolist(), room.tolist(), strict=True)]


_TOPKQ_ERRORS = {**_TOPK_ERRORS, -5: _PRIM_ERRORS[-4]}  # -4: the magnitude (the caller's text)


def topkq_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ks: np.ndarray,
    ns: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, int] | None:
    """The top-k + sign decode (accumulating) of each body at ``frame[starts[p]:]`` (the
    caller checked its length) into ``outs[p]``, one native call: None, or (p, error
    code) of the first body that does not decode (the ones before it added, its output
    untouched): -1 / -2 the indices (``_TOPK_ERRORS``), -4 the magnitude, -5 a sign
    padding bit."""
    return _kept_decode_segments(LIB.hvdc_topkq_decode_segments, frame, starts, ks, ns, outs)


def dqsg_encode_segments(
    xs: list[torch.Tensor], keys: list[int], levels: int, bits: int, bucket: int
) -> list[torch.Tensor | None]:
    """DQSG's body (s = levels > 1: deltas, then the bit-packed codes) of each (x, key) of
    a bucket in one native call: views of one new buffer, or None for a non-finite x."""
    count = len(xs)
    ns = _numels(xs)
    nb = (ns + bucket - 1) // bucket
    room = 4 * nb + (ns * bits + 7) // 8
    buf, starts = _bodies_buffer(room)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    bad = np.zeros(count, dtype=np.int32)
    deltas = np.empty(max(int(nb.max()) if count else 0, 1), dtype=np.float32)
    codes = np.empty(max(int(ns.max()) if count else 0, 1), dtype=np.uint8)
    x_at = _addresses(xs)  # a local: alive across the call
    LIB.hvdc_dqsg_encode_segments(
        count,
        x_at.ctypes.data,
        ns.ctypes.data,
        key_array.ctypes.data,
        levels,
        bits,
        bucket,
        _ptr(buf),
        starts.ctypes.data,
        bad.ctypes.data,
        deltas.ctypes.data,
        codes.ctypes.data,
    )
    return [
        None if b else buf[a : a + r]
        for a, r, b in zip(starts.tolist(), room.tolist(), bad.tolist(), strict=True)
    ]


def dqsg_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    keys: list[int],
    levels: int,
    bits: int,
    bucket: int,
    outs: list[torch.Tensor],
) -> tuple[int, int] | None:
    """DQSG's decode (s = levels > 1, accumulating) of each body ``frame[starts[p]:][:lens[p]]``
    into ``outs[p]``, one native call: None, or (p, error code, kernels/quant.c DQSG_ERR_*)
    of the first body that does not decode (the ones before it added, its output
    untouched)."""
    code = ctypes.c_int64(0)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(len(outs))
    codes = np.empty(max(int(ns.max()) if len(outs) else 0, 1), dtype=np.uint8)
    out_at = _addresses(outs)  # a local: alive across the call
    rc = LIB.hvdc_dqsg_decode_segments(
        len(outs),
        _ptr(frame),
        _i64_array(starts),
        _i64_array(lens),
        _i64_array(ns),
        key_array.ctypes.data,
        levels,
        bits,
        bucket,
        out_at.ctypes.data,
        codes.ctypes.data,
        ctypes.byref(code),
    )
    return None if rc == 0 else (-1 - rc, int(code.value))


def digits_encode_segments(
    xs: list[torch.Tensor], keys: list[int], levels: int, rho: int, bits: int, bucket: int
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """DQSG's quantiser (s = levels) of each (x, key) of a bucket, then its digits packed,
    in one native call (kernels/quant.c ``hvdc_digits_encode_segments``): the digits are
    the fine indices k (rho 0: DQSG with s = 1) or their cosets (NDQSG's nested code, rho
    >= 2). Returns (the bodies, views of one new buffer, None for a non-finite x; the int8
    k of every tensor, concatenated in order)."""
    count = len(xs)
    ns = _numels(xs)
    nb = (ns + bucket - 1) // bucket
    ternary = rho <= 3
    room = 4 * nb + ((ns + 4) // 5 + 2 if ternary else (ns * bits + 7) // 8)
    buf, starts = _bodies_buffer(room)
    k_starts = np.zeros(count, dtype=np.int64)
    np.cumsum(ns[:-1], out=k_starts[1:])
    ks = torch.empty(int(ns.sum()), dtype=torch.int8)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    lens = np.zeros(count, dtype=np.int64)
    most = max(int(ns.max()) if count else 0, 1)
    deltas = np.empty(max(int(nb.max()) if count else 0, 1), dtype=np.float32)
    codes = np.empty(most, dtype=np.uint8)
    quartic = np.empty((most + 4) // 5, dtype=np.uint8)
    x_at = _addresses(xs)  # a local: alive across the call
    LIB.hvdc_digits_encode_segments(
        count, x_at.ctypes.data, ns.ctypes.data, key_array.ctypes.data, levels, rho, bits,
        bucket, _ptr(ks), k_starts.ctypes.data, _ptr(buf), starts.ctypes.data,
        lens.ctypes.data, deltas.ctypes.data, codes.ctypes.data, quartic.ctypes.data,
    )  # fmt: skip
    bodies = [
        None if n < 0 else buf[a : a + n]
        for a, n in zip(starts.tolist(), lens.tolist(), strict=True)
    ]
    return bodies, ks


def digits_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    keys: list[int],
    bucket: int,
    outs: list[torch.Tensor],
    rho: int = 0,
    bits: int = 0,
    divisor: int = 1,
    k_trues: list[torch.Tensor | None] | None = None,
) -> tuple[np.ndarray, tuple[int, int] | None]:
    """The decode, accumulating, of each body ``frame[starts[p]:][:lens[p]]`` of
    ``digits_encode_segments`` into ``outs[p]``, one native call: DQSG with s = 1 (rho 0),
    or NDQSG's nested code (rho >= 2) with the side information ``outs[p] / divisor``
    formed in the same pass. Returns (the aliasing count of each body against
    ``k_trues[p]``, 0 where None or not given; None, or (p, error code) of the first body
    that does not decode, the ones before it added, its output untouched)."""
    count = len(outs)
    code = ctypes.c_int64(0)
    key_array = np.asarray(keys, dtype=np.uint64).reshape(count)
    most = max(int(ns.max()) if count else 0, 1)
    digits = np.empty(most, dtype=np.int8)
    quartic = np.empty((most + 4) // 5, dtype=np.uint8)
    aliased = np.zeros(count, dtype=np.int64)
    out_at = _addresses(outs)  # locals: alive across the call
    k_at = np.fromiter(
        (0 if k is None else k.data_ptr() for k in k_trues or [None] * count),
        dtype=np.uint64,
        count=count,
    )
    rc = LIB.hvdc_digits_decode_segments(
        count, _ptr(frame), _i64_array(starts), _i64_array(lens), _i64_array(ns),
        key_array.ctypes.data, rho, bits, bucket, float(divisor), out_at.ctypes.data,
        k_at.ctypes.data, aliased.ctypes.data, digits.ctypes.data, quartic.ctypes.data,
        ctypes.byref(code),
    )  # fmt: skip
    return aliased, None if rc == 0 else (-1 - rc, int(code.value))
