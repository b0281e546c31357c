"""The CUDA backend's runtime: CuPy, the kernel families of ``kernels/*.cu`` compiled by
NVRTC (``_compile``) and loaded once per process and device (``_module``), launches on
torch's current stream (``_Launcher``), segment tables and the shared constants of the
kernels (state words, error bits, table columns). Importing it needs no CuPy and no GPU:
CuPy is imported on a call's first launch (``_import_cupy``) and ``gpu_unavailable_reason``
says why the kernels cannot run. See the package's docstring."""

from __future__ import annotations

import threading
import warnings
from typing import NamedTuple

import numpy as np
import torch

from hvdcompress._native import NVRTC_OPTIONS, kernel_dir


class KernelFamily(NamedTuple):
    """One .cu file of ``kernel_dir()`` and the ``extern "C"`` kernels launched from it."""

    file: str
    names: tuple[str, ...]


THREELC = KernelFamily(
    "threelc.cu",
    (
        "threelc_absmax",
        "threelc_quantize_quartic",
        "threelc_quartic_encode",
        "threelc_zre_run_starts",
        "threelc_zre_flags",
        "threelc_zre_scatter",
        "threelc_zre_lengths",
        "threelc_zre_decode_check",
        "threelc_zre_expand",
        "threelc_quartic_decode",
        "threelc_absmax_segments",
        "threelc_quantize_quartic_segments",
        "threelc_zre_run_starts_segments",
        "threelc_zre_scatter_segments",
        "threelc_zre_decode_check_segments",
        "threelc_quartic_decode_add_segments",
    ),
)
# Payload checksums and frames on the device (C twin: kernels/frame.c).
FRAME = KernelFamily(
    "frame.cu",
    (
        "hvd_checksum_segments",
        "hvd_checksum_store",
        "hvd_frame_table",
        "hvd_frame_headers",
        "hvd_length_prefixes",
    ),
)
# The shared primitives of hvdcompress.codecs.primitives (C twin: kernels/primitives.c).
PRIMITIVES = KernelFamily(
    "primitives.cu",
    ("primitives_uniform", "primitives_bitpack", "primitives_bitunpack", "primitives_chunk_sums"),
)
# Single-pass sign and stochastic-quantiser codecs (C twins: kernels/sign.c, kernels/quant.c).
SIGN = KernelFamily(
    "sign.cu",
    (
        "sign_encode",
        "sign_ef_sums",
        "sign_ef_encode",
        "sign_decode",
        "sign_encode_segments",
        "sign_ef_sums_segments",
        "sign_ef_encode_segments",
        "sign_decode_check_segments",
        "sign_decode_add_segments",
    ),
)
QUANT = KernelFamily(
    "quant.cu",
    (
        "quant_qsgd_norms",
        "quant_qsgd_encode",
        "quant_qsgd_check",
        "quant_qsgd_decode",
        "quant_terngrad_quartic",
        "quant_dqsg_deltas",
        "quant_dqsg_quantize",
        "quant_dqsg_dequantize",
        "quant_terngrad_quartic_segments",
        "quant_bucket_floats_segments",
        "quant_packed_encode_segments",
        "quant_packed_check_segments",
        "quant_packed_decode_add_segments",
        "quant_dqsg_quartic_segments",
        "quant_dqsg_deltas_check_segments",
        "quant_dqsg_quartic_decode_add_segments",
    ),
)
# The sparse codecs' bucket encode and decode: top-k, top-k + sign, DGC, random-k and GSpar
# (C twin: kernels/sparse.c).
SPARSE = KernelFamily(
    "sparse.cu",
    (
        "sparse_topk_check_segments",
        "sparse_topk_add_segments",
        "sparse_topk_finite_segments",
        "sparse_topk_update_segments",
        "sparse_topk_pick_segments",
        "sparse_topk_histogram_segments",
        "sparse_topk_ties_segments",
        "sparse_topk_keep_segments",
        "sparse_topk_gather_segments",
        "sparse_topkq_write_segments",
        "quant_randomk_flags_segments",
        "quant_randomk_check_segments",
        "quant_randomk_add_segments",
        "quant_randomk_count_segments",
        "quant_randomk_gather_segments",
        "quant_gspar_prepare_segments",
        "quant_gspar_form_segments",
        "quant_gspar_round_segments",
        "quant_gspar_flags_segments",
        "quant_gspar_count_segments",
        "quant_gspar_gather_segments",
    ),
)
FAMILIES = (THREELC, FRAME, PRIMITIVES, SIGN, QUANT, SPARSE)
_FAMILY_OF = {name: family for family in FAMILIES for name in family.names}

BLOCK = 256  # threads per block; a multiple of 32 (the kernels' warp reductions need it)
BLOCKS_PER_SM = 8  # grid-stride loops: at most this many blocks per multiprocessor

# Words of the kernels' state array (HVD_ST_* in kernels/threelc.cu; primitives.cu uses
# only the error word).
_ST_ABSMAX, _ST_SCALE, _ST_NONFINITE, _ST_ERROR, _ST_COUNT, _ST_LAST, _ST_SUM = 0, 1, 2, 3, 4, 6, 7
_STATE_WORDS = 8
# Error bits (HVD_ERR_*; HVD_PRIM_ERR_PADDING of primitives.cu).
ERR_LENGTH, ERR_BYTE, ERR_PADDING, ERR_OVERFLOW, ERR_INPUT = 1, 2, 4, 8, 16
_PRIM_ERR_PADDING = 4
_QUANT_ERR_NORM, _QUANT_ERR_CODE = 32, 64  # HVD_QUANT_ERR_* of quant.cu
_ZERO_GROUP, _RUN_GROUP = 121, 243  # quartic byte of five zeros; decode-internal run marker
_MAX_RUN = 14
_NULL = np.uint64(0)

# Segment tables of a bucket's launch sequence (HVD_SEG_* of kernels/threelc.cu section 7).
_SEG_COLS = 8
_SEG_IN, _SEG_AUX, _SEG_N, _SEG_QOFF, _SEG_BOFF, _SEG_BLEN, _SEG_TILE, _SEG_F32 = range(8)
_SIGN_SEG_OUT = 3  # HVD_SIGN_SEG_OUT of kernels/sign.cu: an output pointer
_QUANT_SEG_KEY = 5  # HVD_QUANT_SEG_KEY of kernels/quant.cu: the uniforms' key
# HVD_QUANT_SEG_* of quant.cu's DQSG s = 1 kernels: the digit kernel's quartic offset and
# deltas, the decode-add's key.
_QUANT_SEG_QUARTIC, _QUANT_SEG_DELTAS, _QUANT_SEG_DECODE_KEY = 1, 3, 7
_QUANT_SEG_KS = 7  # HVD_QUANT_SEG_KS: where the digit kernel writes the fine indices
# HVD_RANDOMK_SEG_* of kernels/sparse.cu (random-k's and GSpar's tables; the uniforms' key
# is column 5 as in _QUANT_SEG_KEY): the flags' offset, the value tiles, the body
_QUANT_SEG_FLAGS, _QUANT_SEG_VALUE_TILE, _QUANT_SEG_BODY_LEN = 3, 4, 7
TOPK_INDEX32_LIMIT = 2**31  # codecs/sparse.py INDEX32_LIMIT: int64 indices from n on
# HVD_SPARSE_SEG_* of kernels/sparse.cu.
_SPARSE_SEG_VALUES, _SPARSE_SEG_OUT, _SPARSE_SEG_N, _SPARSE_SEG_INDICES = 0, 1, 2, 3
_SPARSE_SEG_SIGNS, _SPARSE_SEG_K, _SPARSE_SEG_WIDE = 4, 5, 7
SEGMENT_TILE = 2048  # work units (5-value groups, or bytes) a tile; tests use smaller ones


class _Segments(NamedTuple):
    """A segment table on the device and its tiling (kernels/threelc.cu section 7)."""

    rows: torch.Tensor  # int64 (count, _SEG_COLS), on the device
    count: int
    tiles: int  # tiles of all rows together
    tile: int  # units a tile


def _segments(table: np.ndarray, units: np.ndarray, device: torch.device) -> _Segments:
    """Fill ``table``'s tile column from each row's work ``units`` and copy the table to
    the device (one host-to-device copy)."""
    return _tilings(table, device, {_SEG_TILE: units})[0]


def _tilings(table: np.ndarray, device: torch.device, units: dict) -> list[_Segments]:
    """``_segments`` for kernels that loop over different units of the same rows: each
    column of ``units`` (column -> each row's units) gets its tile numbers, then one copy
    of the table; one ``_Segments`` per column, in order."""
    return _stacked_tilings([(table, units)], device)[0]


def _stacked_tilings(parts: list[tuple[np.ndarray, dict]], device) -> list[list[_Segments]]:
    """``_tilings`` of several tables (each with its own rows' columns and tile numbers:
    kernels that read one column differently) in one host-to-device copy."""
    tile = SEGMENT_TILE
    counts = []
    for table, units in parts:
        counts.append([])
        for col, per in units.items():
            per_row = -(-np.asarray(per, dtype=np.int64) // tile)
            table[:, col] = np.cumsum(per_row) - per_row
            counts[-1].append(int(per_row.sum()))
    rows = torch.from_numpy(np.concatenate([table for table, _ in parts])).to(device)
    out, at = [], 0
    for (table, _), tiles in zip(parts, counts, strict=True):
        view = rows[at : at + len(table)]
        out.append([_Segments(view, len(table), count, tile) for count in tiles])
        at += len(table)
    return out


def _f32_bits(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.int64)


# Seams for tests/host_kernels/, which run this module's code on CPU tensors with the
# kernels compiled for the host behind a stand-in for CuPy (checking every kernel
# argument's type against the .cu sources). Nothing else changes them.
DEVICE_TYPE = "cuda"


def _import_cupy():
    import cupy
    import cupy.cuda.compiler  # noqa: F401  (the attributes _compile and _Module use)
    import cupy.cuda.function  # noqa: F401

    return cupy


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _torch_stream(device_index: int):
    return torch.cuda.current_stream(device_index)


# ---- availability -------------------------------------------------------------------------

_reason_lock = threading.Lock()
_reason: list[str | None] = []  # cached answer of gpu_unavailable_reason


def gpu_unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run here (for tests to skip with), or None if they can.

    Checks, in order: CuPy imports; torch sees a CUDA device; CuPy sees the driver and a
    device; every kernel family compiles and loads on the current device. Cached per
    process.
    """
    with _reason_lock:
        if not _reason:
            _reason.append(_find_reason())
        return _reason[0]


def _find_reason() -> str | None:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken install raising anything
        return f"CuPy is not usable ({type(exc).__name__}: {exc}); pip install cupy-cuda13x"
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} sees no CUDA device "
            f"(CUDA build: {torch.version.cuda or 'none, a CPU-only build'})"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cudaErrorInsufficientDriver, cudaErrorNoDevice, ...
        return f"CuPy {cupy.__version__} cannot use the CUDA driver: {exc}"
    if count == 0:
        return f"CuPy {cupy.__version__} sees no CUDA device"
    for family in FAMILIES:
        source = kernel_dir() / family.file
        if not source.is_file():
            return f"kernel source {source} is missing"
        try:
            _module(torch.cuda.current_device(), family)
        except Exception as exc:  # NVRTC not found, compile error, module load error
            return f"cannot compile or load {source} with CuPy {cupy.__version__}: {exc}"
    return None


# ---- kernels and launches ------------------------------------------------------------------


def _compile(cupy, source: str, file: str) -> bytes:
    """NVRTC output (cubin, or PTX where this NVRTC cannot target the device) of one .cu
    source for the current device, compiled with exactly ``NVRTC_OPTIONS``.

    Not ``cupy.RawModule(code=...)``: CuPy's cached compile path appends ``-ftz=true``
    after the caller's options, and NVRTC honours the last occurrence, so subnormal inputs
    and scales would be flushed to zero on the GPU and differ from the CPU backend (seen on
    an H200: a subnormal 3LC scale came back 0.0). ``compile_using_nvrtc`` passes the
    options through unchanged (adding only the target architecture)."""
    result = cupy.cuda.compiler.compile_using_nvrtc(source, NVRTC_OPTIONS, None, file)
    binary = result[0] if isinstance(result, tuple) else result  # (obj, mapping) in CuPy >= 9
    if isinstance(binary, str):
        binary = binary.encode()
    if binary.lstrip().startswith(b"//"):  # PTX text: check, and NUL-terminate for the driver
        if b".ftz" in binary:
            raise RuntimeError(f"NVRTC emitted flush-to-zero instructions for {file}")
        binary += b"\0"
    return binary


class _Module:
    """The kernels of one family, compiled and loaded on one device."""

    def __init__(self, device_index: int, family: KernelFamily):
        cupy = _import_cupy()
        source = (kernel_dir() / family.file).read_text()
        with cupy.cuda.Device(device_index) as dev:
            module = cupy.cuda.function.Module()
            module.load(_compile(cupy, source, family.file))
            self.functions = {name: module.get_function(name) for name in family.names}
            sms = dev.attributes["MultiProcessorCount"]
        self.max_blocks = max(1, BLOCKS_PER_SM * sms)
        self.module = module


_modules: dict[tuple[str, int], _Module] = {}  # by (family file, device index)
_modules_lock = threading.Lock()


def _module(device_index: int, family: KernelFamily) -> _Module:
    key = (family.file, device_index)
    with _modules_lock:
        mod = _modules.get(key)
        if mod is None:
            mod = _modules[key] = _Module(device_index, family)
        return mod


def _cupy_stream(cupy, tstream, device_index: int):
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(tstream, "__cuda_stream__"):
        return from_external(tstream)
    with warnings.catch_warnings():  # deprecated in CuPy 14, the only way before it
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(tstream.cuda_stream, device_index)


class _Launcher:
    """Context for one call: the device, torch's current stream (made CuPy's), and any
    kernel of any family (its module loaded on the first launch)."""

    def __init__(self, device: torch.device):
        cupy = _import_cupy()
        if device.type != DEVICE_TYPE:
            raise TypeError(f"the CUDA backend got a tensor on {device}")
        self.index = _device_index(device)
        self.device = device
        self._mods: dict[KernelFamily, _Module] = {}
        self._dev = cupy.cuda.Device(self.index)
        self._stream = _cupy_stream(cupy, _torch_stream(self.index), self.index)

    def __enter__(self) -> _Launcher:
        self._dev.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._stream.__exit__(*exc)
        self._dev.__exit__(*exc)

    def __call__(self, name: str, work: int, *args) -> None:
        """Launch ``name`` with enough blocks of BLOCK threads for ``work`` items (capped:
        the kernels are grid-stride loops); a tensor in ``args`` is passed as its device
        pointer (``_ptr``; None: a NULL pointer), every other argument as it is."""
        if work <= 0:
            return
        family = _FAMILY_OF[name]
        mod = self._mods.get(family)
        if mod is None:
            mod = self._mods[family] = _module(self.index, family)
        blocks = min(-(-work // BLOCK), mod.max_blocks)
        args = tuple(_ptr(a) if a is None or isinstance(a, torch.Tensor) else a for a in args)
        mod.functions[name]((blocks,), (BLOCK,), args)

    def tiles(self, name: str, table: _Segments, *args) -> None:
        """Launch a segment kernel of kernels/threelc.cu section 7 over ``table``'s tiles
        (one block a tile, capped: blocks loop over tiles): arguments (table, rows, tiles,
        tile size, *args)."""
        sizes = np.int64(table.count), np.int64(table.tiles), np.int64(table.tile)
        self(name, table.tiles * BLOCK, table.rows, *sizes, *args)

    def rows(self, name: str, table: _Segments, *args) -> None:
        """Launch a kernel of one thread a row of ``table``: arguments (table, rows, *args)."""
        self(name, table.count, table.rows, np.int64(table.count), *args)

    def state(self) -> torch.Tensor:
        return torch.zeros(_STATE_WORDS, dtype=torch.int32, device=self.device)

    def states(self, count: int) -> torch.Tensor:
        """Zeroed per-segment state rows (HVD_STATE_WORDS words each)."""
        return torch.zeros((count, _STATE_WORDS), dtype=torch.int32, device=self.device)

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return _NULL if t is None else np.uint64(t.data_ptr())


def _read_state(state: torch.Tensor) -> np.ndarray:
    """The one device-to-host copy of a call (synchronises with the stream), as uint32
    words: the rows of ``_Launcher.states`` stay rows."""
    return state.cpu().numpy().view(np.uint32).copy()


def _count(host: np.ndarray) -> int:
    return int(host[_ST_COUNT : _ST_COUNT + 2].view(np.int64)[0])


def _f32(word) -> float:
    return float(np.array([word], np.uint32).view(np.float32)[0])


def _check_tensor(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != DEVICE_TYPE:
        raise TypeError(f"{name} is on {t.device}; the CUDA backend takes CUDA tensors")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
