"""The CPU backend's C library (``kernels/*.c``) and what every codec module shares:
loading (or compiling) the library and its ctypes signatures, the error texts of its
return codes, pointers, scratch buffers, segment tables and the codec threads. The
module-level state (``LIB``, the per-thread scratch, the thread pool) lives here only."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.machinery
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from hvdcompress import _native
from hvdcompress.errors import PayloadError

_SOURCES = [_native.kernel_dir() / name for name in _native.C_SOURCES]

_i64, _u32, _u64, _f32 = ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_float
_int, _p = ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "hvdc_threelc_absmax_bits": (_u32, [_p, _p, _i64]),
    "hvdc_threelc_quantize": (None, [_p, _p, _p, _f32, _i64, _p, _p]),
    "hvdc_threelc_quartic_encode": (None, [_p, _i64, _p]),
    "hvdc_threelc_scale": (_f32, [_u32, _f32]),
    "hvdc_threelc_zre_encode": (_i64, [_p, _i64, _p]),
    "hvdc_threelc_zre_encode_portable": (_i64, [_p, _i64, _p]),
    "hvdc_threelc_zre_decoded_len": (_i64, [_p, _i64]),
    "hvdc_threelc_zre_decode": (_i64, [_p, _i64, _p, _i64]),
    "hvdc_threelc_quartic_decode": (_i64, [_p, _i64, _p]),
    "hvdc_threelc_decode": (_i64, [_p, _i64, _i64, _f32, _p, _int]),
    "hvdc_threelc_encode_segments": (None, [_i64, _p, _p, _p, _p, _p, _p, _p, _p]),
    "hvdc_threelc_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p, _p, _p]),
    # kernels/frame.c
    "hvdc_checksum": (_u32, [_p, _i64, _i64]),  # the checksum at a payload position
    "hvdc_checksum_segments": (None, [_p, _i64, _p, _p, _p]),
    "hvdc_frame_scan": (_i64, [_p, _i64, _i64, _p, _p]),
    "hvdc_frame_write": (None, [_i64, _p, _p, _p, _p, _p, _p, _p, _p, _p, _p]),
    # shared primitives (kernels/primitives.c)
    "hvdc_prim_uniform": (None, [_u64, _i64, _i64, _p]),
    "hvdc_prim_bitpack": (None, [_p, _i64, _int, _p]),
    "hvdc_prim_bitunpack": (_i64, [_p, _i64, _i64, _int, _p]),
    "hvdc_prim_chunk_sums": (None, [_p, _i64, _i64, _int, _p]),
    "hvdc_prim_nonfinite": (_i64, [_p, _i64, _int, _u32]),
    # sign codecs (kernels/sign.c)
    "hvdc_sign_encode_segments": (None, [_i64, _p, _p, _p, _p]),
    "hvdc_sign_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p]),
    "hvdc_efsign_sums_segments": (None, [_i64, _p, _p, _p, _i64, _p, _p, _p]),
    "hvdc_efsign_encode_segments": (None, [_i64, _p, _p, _p, _p, _p, _p]),
    # stochastic quantisers (kernels/quant.c)
    "hvdc_qsgd_encode": (_int, [_p, _i64, _int, _int, _i64, _u64, _i64, _p, _p]),
    "hvdc_prim_unpack_groups": (None, [_p, _i64, _int, _p, _int]),
    "hvdc_prim_pack_groups": (None, [_p, _i64, _int, _p, _int]),
    "hvdc_terngrad_quartic": (None, [_p, _i64, _f32, _u64, _i64, _p]),
    "hvdc_dqsg_quantize": (_int, [_p, _i64, _int, _i64, _u64, _i64, _int, _p, _p]),
    "hvdc_dqsg_dequantize": (None, [_p, _i64, _p, _i64, _u64, _i64, _p, _int]),
    # top-k selection (kernels/sparse.c)
    "hvdc_ndqsg_coset": (None, [_p, _i64, _int, _int, _p]),
    "hvdc_ndqsg_side_decode": (_i64, [_p, _i64, _p, _p, _int, _i64, _u64, _p, _int, _p]),
    "hvdc_dgc_update": (_int, [_p, _p, _p, _i64, _f32, _int]),
    "hvdc_randomk_encode_segments": (None, [_i64, _p, _p, _p, _u32, _p, _p, _p, _p, _p]),
    "hvdc_randomk_ef_encode_segments": (None, [_i64, _p, _p, _p, _p, _u32] + [_p] * 6),
    "hvdc_randomk_decode_segments": (_i64, [_i64, _p, _p, _p, _p, _p, _u32, _f32, _p, _p, _p]),
    "hvdc_gspar_encode_segments": (None, [_i64, _p, _p, _int, _p, _p, _p, _i64] + [_p] * 9),
    "hvdc_gspar_round": (_i64, [_p, _i64, _f32, _i64, _p]),
    "hvdc_gspar_draw": (_i64, [_p, _i64, _f32, _int, _u64, _int, _p, _p, _i64]),
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
    "hvdc_digits_decode_segments": (_i64, [_i64] + [_p] * 5 + [_int, _int, _i64, _f32] + [_p] * 6),
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
    flags = [*_native.C_FLAGS, *_sanitizer_flags()]
    digest.update(" ".join(flags).encode())
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
            [cc, *flags, "-shared", "-fPIC", "-o", str(out), *map(str, _SOURCES)],
            check=True,
        )
        os.replace(out, target)  # atomic: concurrent ranks may compile at once
    return target


def _sanitizer_flags() -> list[str]:
    """``$HVDC_SANITIZE`` (e.g. ``address,undefined``: the CI's sanitizer stage,
    scripts/run_tests.sh) builds the library with those sanitizers, aborting at the first
    report; the process must preload their runtimes (LD_PRELOAD)."""
    kinds = os.environ.get("HVDC_SANITIZE", "").strip()
    return [f"-fsanitize={kinds}", "-fno-sanitize-recover=all", "-g"] if kinds else []


def _load() -> ctypes.CDLL:
    path = _built_library()
    if path is None or os.environ.get("HVDC_REBUILD_CPU") == "1" or _sanitizer_flags():
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
        raise PayloadError("body", _message(code, errors))


def _message(code: int, errors: dict[int, str]) -> str:
    return errors.get(code, f"error code {code}")


# ---- threads --------------------------------------------------------------------------------

_MIN_PART = 1 << 18  # elements: below this a part costs more to hand out than to encode


def num_threads() -> int:
    """Threads for the CPU codecs: ``$HVDC_NUM_THREADS`` when set (an int >= 1), else the
    CPUs this process may run on divided by the ranks on this node (Open MPI's, MPICH's,
    Slurm's or Horovod's local size), at least 1. The bytes never depend on it."""
    return _threads_for(os.environ.get("HVDC_NUM_THREADS", "").strip())


def splits(n):
    """Two parts' worth of elements or more, and more than one codec thread."""
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


def _run_parts(fn, parts: list[tuple[int, int]], threads: int | None = None) -> list:
    """fn(*part) for every part, on the pool (``threads`` workers, default one a part) when
    there is more than one (ctypes releases the GIL during each C call)."""
    if len(parts) == 1:
        return [fn(*parts[0])]
    return list(_executor(threads or len(parts)).map(lambda part: fn(*part), parts))


_F32 = 4  # bytes per float32: the parts' pointer offsets


class _Rows:
    """A bucket's segment table cut for the codec threads: one row per tensor, except that a
    tensor of n elements becomes the rows of its ``_parts(n, align)`` when there are
    several. The whole tensors come first and take one native call; each part takes a call
    of its own, on the pool (ctypes releases the GIL during each call). Every codec that
    uses this writes bytes that depend only on the part's own elements, so the bytes do not
    depend on the cut."""

    def __init__(self, ns: list[int], align: int) -> None:
        whole, cut = [], []  # rows (tensor, lo, hi)
        for p, n in enumerate(ns):
            parts = _parts(n, align)
            (whole if len(parts) == 1 else cut).extend((p, a, b) for a, b in parts)
        table = np.array(whole + cut, dtype=np.int64).reshape(-1, 3)
        self.owner, self.lo = table[:, 0].copy(), table[:, 1].copy()  # contiguous columns
        self.n = table[:, 2] - self.lo
        self.calls = [(0, len(whole))] if whole or not cut else []
        self.calls += [(row, 1) for row in range(len(whole), len(table))]

    def at(self, addresses: list[int] | np.ndarray, bytes_per_element: int, per: int = 1):
        """Each row's address: its tensor's address plus ``lo // per * bytes_per_element``
        (``per`` elements to a unit of that many bytes)."""
        base = np.asarray(addresses, dtype=np.uint64).reshape(-1)[self.owner]
        return base + (self.lo // per * bytes_per_element).astype(np.uint64)

    def run(self, fn) -> list:
        """fn(first, count) for each native call's rows, on the pool when there are
        several."""
        return _run_parts(fn, self.calls, min(len(self.calls), num_threads()))

    def call(self, fn, *columns: np.ndarray) -> None:
        """``run`` of the C function fn(count, each of ``columns`` (one entry a row) from the
        call's first row)."""
        self.run(lambda first, count: fn(count, *(_row(c, first) for c in columns)))

    def any_per_tensor(self, flags: np.ndarray, count: int) -> list[bool]:
        """Each tensor's flag: whether any of its rows' ``flags`` is set."""
        out = np.zeros(count, dtype=bool)
        np.logical_or.at(out, self.owner, np.asarray(flags) != 0)
        return out.tolist()


def _row(a: np.ndarray, first: int) -> int:
    """The address of ``a[first]`` (a contiguous array of the caller's, alive across the
    native call)."""
    return a.ctypes.data + first * a.itemsize


# ---- segment tables of the bucket encoders and decoders -----------------------------------


def _addresses(tensors) -> np.ndarray:
    """Each tensor's address (0 for None: no tensor, a NULL pointer to the C library)."""
    return np.fromiter(
        (0 if t is None else t.data_ptr() for t in tensors), dtype=np.uint64, count=len(tensors)
    )


def _numels(tensors) -> np.ndarray:
    return np.fromiter((t.numel() for t in tensors), dtype=np.int64, count=len(tensors))


def _bodies_buffer(room: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """One new byte buffer for a bucket's bodies, ``room[p]`` bytes for body p (so that the
    bodies stay valid after the next call), and where each starts in it."""
    return torch.empty(int(room.sum()), dtype=torch.uint8), np.cumsum(room) - room


def _native(fn, *args):
    """``fn(*args)``, each tensor and numpy array in ``args`` passed as its data pointer (and
    alive, in ``args``, until the C function returns)."""
    return fn(*(_address(a) for a in args))


def _decode(fn, count: int, frame: torch.Tensor, tables: tuple, *args) -> tuple[int, int] | None:
    """A bucket decoder of the C library, fn(count, frame, each of ``tables`` (the caller's
    int64 arrays, ``_i64_array``), *args, &code): None, or (p, code) of the first body p
    it refuses."""
    code = ctypes.c_int64(0)
    at = [_i64_array(t) for t in tables]
    rc = _native(fn, count, frame, *at, *args, ctypes.byref(code))
    return None if rc == 0 else (-1 - rc, int(code.value))


def _address(a):
    if isinstance(a, torch.Tensor):
        return a.data_ptr()
    if isinstance(a, np.ndarray):
        return a.ctypes.data
    return a


def _i64_array(a: np.ndarray) -> int:
    """The address of the caller's contiguous int64 array ``a`` (never a converted
    temporary, which would be freed before the native call reads it)."""
    if a.dtype != np.int64 or not a.flags.c_contiguous:
        raise TypeError("expected a contiguous int64 array")
    return a.ctypes.data
