"""CPU backend: the C library of ``kernels/*.c`` (``threelc.c``, ``primitives.c``) called
through ctypes.

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
import hashlib
import importlib.machinery
import math
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from hvdcompress import _native
from hvdcompress.backends import ThreeLCEncoded
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
    "hvdc_tlc_zre_decoded_len": (_i64, [_p, _i64]),
    "hvdc_tlc_zre_decode": (_i64, [_p, _i64, _p, _i64]),
    "hvdc_tlc_quartic_decode": (_i64, [_p, _i64, _p]),
    "hvdc_tlc_dequantize": (_i64, [_p, _i64, _f32, _p, _int]),
    "hvdc_tlc_decode": (_i64, [_p, _i64, _i64, _f32, _p, _int]),
    "hvdc_checksum": (_u32, [_p, _i64, _i64]),
    # shared primitives (kernels/primitives.c)
    "hvdc_prim_uniform": (None, [ctypes.c_uint64, _i64, _i64, _p]),
    "hvdc_prim_bitpack": (None, [_p, _i64, _int, _p]),
    "hvdc_prim_bitunpack": (_i64, [_p, _i64, _i64, _int, _p]),
    "hvdc_prim_chunk_sums": (None, [_p, _i64, _i64, _int, _p]),
}
# Negative return codes of the decoders, per source file.
_ERRORS = {  # kernels/threelc.c (TLC_ERR_*)
    -1: "zero-run decoding does not give exactly ceil(numel / 5) quartic bytes",
    -2: "a quartic byte is above 242",
    -3: "a padding digit of the last group is not zero",
}
_PRIM_ERRORS = {  # kernels/primitives.c (PRIM_ERR_*)
    -1: "the packed body does not have ceil(numel * bits / 8) bytes",
    -4: "a padding bit after the last packed value is set",
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
