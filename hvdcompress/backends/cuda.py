"""CUDA backend: the kernels of ``kernels/*.cu`` compiled by NVRTC through CuPy.

Same protocol and the same bytes as the CPU backend (``hvdcompress.backends``). Each .cu
file is one kernel family (``KernelFamily``: ``THREELC``, ``PRIMITIVES``, ``SIGN``,
``QUANT``, ``SPARSE``), compiled into its
own module once per process and device, on the first launch of one of its kernels, with
exactly ``NVRTC_OPTIONS`` (``hvdcompress._native``: FMA contraction, flush to zero and
approximate division turned off; ``_compile`` says why not through ``RawModule``). The
sources are found by ``kernel_dir()``: in ``hvdcompress/kernels/`` when the package was
installed with them, else in the source tree's ``kernels/`` (a checkout on PYTHONPATH).

Tensors stay torch tensors: kernels get their raw device pointers (zero-copy; the
tensors are alive for the whole call and every kernel and torch op of a call runs, in
order, on torch's current stream of the tensor's device, so the caching allocator's
stream-ordered reuse is safe). The scans of the zero-run coder are ``torch.cummax`` (in
two levels: ``_running_max``) and ``torch.cumsum`` on that stream. Each call makes one
small device-to-host copy (the handful of integers a call needs: output length, error
bits, scale, non-finite flag or checksum); the fused decode makes it before writing
anything, so a corrupt body raises ``PayloadError`` with ``out`` untouched. A bucket's
calls (the ``*_segments`` functions: 3LC, TernGrad, signSGD, EF-signSGD, QSGD, DQSG,
checksums) make at most that one copy for the whole bucket, after one launch
sequence over a segment table (kernels/threelc.cu section 7, sign.cu section 5, quant.cu
section 9); ``store_checksums`` and ``efsign_encode_segments`` make none. A frame
gathered on the device is scanned there (``frame_scan``, kernels/threelc.cu section 8:
one read of a row per payload, not a copy of the frame).
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import NamedTuple

import numpy as np
import torch

from hvdcompress._native import NVRTC_OPTIONS, kernel_dir
from hvdcompress.backends.records import CHECKSUM_FIELD, SCAN, FrameScan, ThreeLCEncoded, mix
from hvdcompress.errors import PayloadError


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
        "threelc_quartic_decode_scale",
        "threelc_quartic_decode",
        "hvd_checksum",
        "threelc_absmax_segments",
        "threelc_quantize_quartic_segments",
        "threelc_zre_run_starts_segments",
        "threelc_zre_scatter_segments",
        "threelc_zre_decode_check_segments",
        "threelc_quartic_decode_add_segments",
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
# The sparse codecs' bucket decode (C twin: kernels/sparse.c, hvdc_topk_decode_segments).
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
    ),
)
FAMILIES = (THREELC, PRIMITIVES, SIGN, QUANT, SPARSE)
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
# ... and of its random-k decode (section 10): the flags' offset, the value tiles, the body
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
        the kernels are grid-stride loops)."""
        if work <= 0:
            return
        family = _FAMILY_OF[name]
        mod = self._mods.get(family)
        if mod is None:
            mod = self._mods[family] = _module(self.index, family)
        blocks = min(-(-work // BLOCK), mod.max_blocks)
        mod.functions[name]((blocks,), (BLOCK,), args)

    def tiles(self, name: str, table: _Segments, *args) -> None:
        """Launch a segment kernel of kernels/threelc.cu section 7 over ``table``'s tiles
        (one block a tile, capped: blocks loop over tiles): arguments (table, rows, tiles,
        tile size, *args)."""
        self(
            name,
            table.tiles * BLOCK,
            _ptr(table.rows),
            np.int64(table.count),
            np.int64(table.tiles),
            np.int64(table.tile),
            *args,
        )

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
    """The one device-to-host copy of a call (synchronises with the stream)."""
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


def _sparsity(sparsity: float) -> np.float32:
    s = np.float32(sparsity)
    if not (1.0 <= s < 2.0):
        raise ValueError(f"3LC sparsity must be in [1, 2) as a float32, got {sparsity!r}")
    return s


def _body_error(err: int, total: int | None = None, m: int | None = None) -> PayloadError:
    if err & ERR_LENGTH:
        got = "" if total is None else f" ({total} bytes, expected {m})"
        return PayloadError(
            "body",
            f"zero-run decoding does not give exactly ceil(numel / 5) quartic bytes{got}",
        )
    if err & ERR_BYTE:
        return PayloadError("body", "a quartic byte is above 242")
    if err & ERR_PADDING:
        return PayloadError("body", "a padding digit of the last group is not zero")
    return PayloadError("body", f"decoding kernels reported error bits 0x{err:x}")


# ---- fused codec path ----------------------------------------------------------------------


def threelc_encode(g: torch.Tensor, e: torch.Tensor | None, sparsity: float) -> ThreeLCEncoded:
    _check_tensor(g, "g", torch.float32)
    if e is not None:
        _check_tensor(e, "e", torch.float32)
        if e.numel() != g.numel() or e.device != g.device:
            raise ValueError(
                f"residual has {e.numel()} elements on {e.device}, "
                f"gradient {g.numel()} on {g.device}"
            )
    s = _sparsity(sparsity)
    n = g.numel()
    if n == 0:
        return ThreeLCEncoded(torch.empty(0, dtype=torch.uint8, device=g.device), 0.0, False)
    with _Launcher(g.device) as k:
        state = k.state()
        quartic = _quantize_quartic(k, g, e, s, state, None)
        out = _zre_encode(k, quartic, state)
        host = _read_state(state)
    if host[_ST_NONFINITE]:
        # Like the CPU backend: no body, scale 0, the residual untouched (the kernel did
        # not write it).
        return ThreeLCEncoded(torch.empty(0, dtype=torch.uint8, device=g.device), 0.0, True)
    return ThreeLCEncoded(out[: _count(host)], _f32(host[_ST_SCALE]), False)


def _quantize_quartic(
    k: _Launcher,
    x: torch.Tensor,
    e: torch.Tensor | None,
    s: np.float32,
    state: torch.Tensor,
    q_out: torch.Tensor | None,
) -> torch.Tensor:
    """max|x + e| into state, then the fused quantize + quartic encode: returns the
    ceil(n / 5) quartic bytes; S and the non-finite flag go to state, e (when given) is
    updated and q_out (int8, when given) written. x must have n >= 1 elements."""
    n = x.numel()
    k("threelc_absmax", n, _ptr(x), _ptr(e), np.int64(n), _ptr(state))
    quartic = k.empty((n + 4) // 5, torch.uint8)
    k(
        "threelc_quantize_quartic",
        quartic.numel(),
        _ptr(x),
        _ptr(e),
        np.int64(n),
        s,
        _ptr(state),
        _ptr(quartic),
        _ptr(q_out),
    )
    return quartic


_SCAN_ROW = 1024  # elements per row of _running_max's two-level scan


def _running_max(x: torch.Tensor) -> torch.Tensor:
    """``torch.cummax(x, 0).values`` of a 1-D int64 tensor, computed in parallel.

    torch's CUDA cummax parallelises over rows only, so a 1-D tensor is scanned by a
    single thread block: on an H200 that held 3LC encode at about 6 GB/s of float32 input
    for any size from 1e7 to 1e8 elements. Here rows of ``_SCAN_ROW`` values are scanned
    side by side, then each row takes the running max of the rows before it (the same
    function on the rows' last values, so the serial part shrinks by ``_SCAN_ROW`` a level).
    Exact: a max of integers, so the result is the same whatever the grouping."""
    n = x.numel()
    if n <= _SCAN_ROW:
        return torch.cummax(x, 0).values
    rows = -(-n // _SCAN_ROW)
    grid = torch.full((rows * _SCAN_ROW,), torch.iinfo(x.dtype).min, dtype=x.dtype, device=x.device)
    grid[:n] = x
    scanned = torch.cummax(grid.view(rows, _SCAN_ROW), 1).values
    before = _running_max(scanned[:, -1].contiguous())  # running max over whole rows
    scanned[1:] = torch.maximum(scanned[1:], before[:-1, None])
    return scanned.view(-1)[:n]


def _zre_encode(k: _Launcher, qb: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Zero-run encode qb (m >= 1 bytes) into a new m-byte tensor; the length goes to
    state[_ST_COUNT], input bytes > 242 set ERR_INPUT. No host synchronisation."""
    m = qb.numel()
    start = k.empty(m, torch.int64)
    k("threelc_zre_run_starts", m, _ptr(qb), np.int64(m), _ptr(start))
    run_start = _running_max(start)
    del start  # stream-ordered: reused only by later work on this stream
    incl = _zre_emit_scan(k, qb, run_start, state)
    out = k.empty(m, torch.uint8)
    k(
        "threelc_zre_scatter",
        m,
        _ptr(qb),
        _ptr(run_start),
        _ptr(incl),
        np.int64(m),
        _ptr(out),
        np.int64(m),
        _ptr(state),
    )
    return out


def _zre_emit_scan(
    k: _Launcher, qb: torch.Tensor, run_start: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """The inclusive scan of the zero-run encoder's emit flags (which position writes an
    output byte): each emitting position's output index + 1."""
    m = qb.numel()
    emit = k.empty(m, torch.uint8)
    k(
        "threelc_zre_flags",
        m,
        _ptr(qb),
        _ptr(run_start),
        np.int64(m),
        _ptr(emit),
        _ptr(state),
    )
    return torch.cumsum(emit, 0, dtype=torch.int64)


def _zre_prepare(k: _Launcher, body: torch.Tensor, numel: int, state: torch.Tensor):
    """Expansion lengths, their inclusive scan and the check kernel (total length, and
    with numel >= 0 the length / padding checks) into state. Returns the scan."""
    length = body.numel()
    lens = k.empty(length, torch.uint8)
    k("threelc_zre_lengths", length, _ptr(body), np.int64(length), _ptr(lens))
    incl = torch.cumsum(lens, 0, dtype=torch.int64)
    k(
        "threelc_zre_decode_check",
        1,
        _ptr(body),
        _ptr(incl),
        np.int64(length),
        np.int64(numel),
        _ptr(state),
    )
    return incl


def _as_body(body: torch.Tensor, device: torch.device) -> torch.Tensor:
    if not isinstance(body, torch.Tensor) or body.dtype != torch.uint8:
        raise TypeError(f"body must be a uint8 tensor, got {getattr(body, 'dtype', type(body))}")
    return body.reshape(-1).to(device).contiguous()


def threelc_decode(
    body: torch.Tensor, numel: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    _check_tensor(out, "out", torch.float32)
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} elements, expected {numel}")
    body = _as_body(body, out.device)
    m = (numel + 4) // 5
    length = body.numel()
    # Cheap host-side bounds first: each body byte expands to 1..14 quartic bytes.
    if length > m or length * _MAX_RUN < m:
        raise _body_error(ERR_LENGTH)
    if length == 0:
        return  # numel == 0 (m == 0 >= length)
    with _Launcher(out.device) as k:
        state = k.state()
        incl = _zre_prepare(k, body, numel, state)
        host = _read_state(state)
        if host[_ST_ERROR]:
            raise _body_error(int(host[_ST_ERROR]), _count(host), m)
        qb = k.empty(m, torch.uint8)
        k(
            "threelc_zre_expand",
            length,
            _ptr(body),
            _ptr(incl),
            np.int64(length),
            np.uint8(_RUN_GROUP),
            _ptr(qb),
            np.int64(m),
            _ptr(state),
        )
        k(
            "threelc_quartic_decode_scale",
            m,
            _ptr(qb),
            np.int64(numel),
            np.float32(scale),
            _ptr(out),
            np.int32(bool(accumulate)),
            _ptr(state),
        )


def checksum(buf: torch.Tensor, offset: int) -> int:
    _check_tensor(buf, "buf", torch.uint8)
    length = buf.numel()
    if length == 0:
        return 0
    with _Launcher(buf.device) as k:
        state = k.state()
        k(
            "hvd_checksum",
            length,
            _ptr(buf),
            np.int64(length),
            np.uint64(offset % 2**64),
            _ptr(state),
        )
        return int(_read_state(state)[_ST_SUM])


def _checksum_table(buf: torch.Tensor, starts: list[int], lengths: list[int]) -> np.ndarray:
    table = np.zeros((len(starts), _SEG_COLS), dtype=np.int64)
    table[:, _SEG_IN] = buf.data_ptr() + np.asarray(starts, dtype=np.int64)
    table[:, _SEG_N] = lengths
    return table


def checksum_segments(buf: torch.Tensor, starts: list[int], lengths: list[int]) -> list[int]:
    """``checksum`` (offset 0) of each segment [start, start + length) of buf: one launch,
    one device-to-host copy for all."""
    _check_tensor(buf, "buf", torch.uint8)
    if not starts:
        return []
    table = _checksum_table(buf, starts, lengths)
    with _Launcher(buf.device) as k:
        seg = _segments(table, table[:, _SEG_N], buf.device)
        states = k.states(seg.count)
        k.tiles("hvd_checksum_segments", seg, _ptr(states))
        host = _read_state(states).reshape(seg.count, _STATE_WORDS)
    return [int(w) for w in host[:, _ST_SUM]]


def store_checksums(buf: torch.Tensor, starts: list[int], lengths: list[int], field: int) -> None:
    """Write each segment's ``checksum`` (offset 0, computed with its 4 bytes at ``start +
    field`` zero) little-endian into those 4 bytes: a frame's checksum fields, with no
    host round trip (two launches)."""
    _check_tensor(buf, "buf", torch.uint8)
    if not starts:
        return
    table = _checksum_table(buf, starts, lengths)
    with _Launcher(buf.device) as k:
        seg = _segments(table, table[:, _SEG_N], buf.device)
        states = k.states(seg.count)
        k.tiles("hvd_checksum_segments", seg, _ptr(states))
        k(
            "hvd_checksum_store",
            seg.count,
            _ptr(seg.rows),
            np.int64(seg.count),
            np.int64(field),
            _ptr(states),
        )


# A frame scan's rows (HVD_FRAME_* of kernels/threelc.cu section 8): the fields, the shape,
# the stored checksum, the codec parameters.
_FRAME_FIELDS, _FRAME_SHAPE, _FRAME_STORED, _FRAME_PARAMS = 10, 10, 18, 19
_FRAME_OK, _FRAME_PARAMS_LEN = SCAN["ok"], SCAN["params_len"]
_FRAME_ROW = _FRAME_PARAMS + 256 // 8


def frame_scan(frame: torch.Tensor, count: int) -> FrameScan | None:
    """The CPU backend's ``frame_scan`` (the same ``FrameScan``) of a frame on the device,
    without copying it to the host: three launches (the length table, every payload's
    checksum, every header) and one device-to-host read of 440 bytes a payload."""
    _check_tensor(frame, "frame", torch.uint8)
    length = frame.numel()
    words = 1 + count * _FRAME_ROW
    with _Launcher(frame.device) as k:
        # the scan's rows and the checksum states, one buffer: one read
        out = torch.zeros(words + count * _STATE_WORDS // 2, dtype=torch.int64, device=k.device)
        states = out[words:].view(torch.int32)
        rows = torch.zeros((max(count, 1), _SEG_COLS), dtype=torch.int64, device=k.device)
        k(
            "hvd_frame_table",
            1,
            _ptr(frame),
            np.int64(length),
            np.int64(count),
            np.int64(SEGMENT_TILE),
            _ptr(out),
            _ptr(rows),
        )
        if count:
            # the table's tiles are counted on the device: launch for the most a frame of
            # this length can have (a payload adds at most one partial tile); the surplus
            # tiles sum no bytes
            tiles = -(-length // SEGMENT_TILE) + count
            k.tiles(
                "hvd_checksum_segments", _Segments(rows, count, tiles, SEGMENT_TILE), _ptr(states)
            )
            k("hvd_frame_headers", count, _ptr(frame), np.int64(count), _ptr(out))
        host = _read_state(out)
    scan = host[: 2 * words].view(np.int64)
    if scan[0] != 1:
        return None
    table = scan[1:].reshape(count, _FRAME_ROW)
    fields = table[:, :_FRAME_FIELDS].copy()
    shapes = table[:, _FRAME_SHAPE : _FRAME_SHAPE + 8].view(np.uint64).copy()
    stored = table[:, _FRAME_STORED].astype(np.uint64)
    # The device summed the checksum field's own bytes; frame.c sums them as zeros.
    field = CHECKSUM_FIELD + np.arange(4, dtype=np.uint64)
    stored_bytes = (stored[:, None] >> (np.uint64(8) * np.arange(4, dtype=np.uint64))) & 0xFF
    extra = (stored_bytes * mix(field)[None, :]).sum(axis=1)
    sums = host[2 * words :].reshape(count, _STATE_WORDS)[:, _ST_SUM].astype(np.uint64)
    zeroed = (sums - extra) & np.uint64(0xFFFFFFFF)
    ok = (fields[:, _FRAME_OK] == 1) & (zeroed == stored)
    fields[:, _FRAME_OK] = ok
    block = table[:, _FRAME_PARAMS:].view(np.uint8)
    params = [
        block[i, :n].tobytes() if good else b""
        for i, (good, n) in enumerate(
            zip(ok.tolist(), fields[:, _FRAME_PARAMS_LEN].tolist(), strict=True)
        )
    ]
    return FrameScan(fields, shapes, params)


def length_prefixes(buf: torch.Tensor, size: int) -> np.ndarray:
    """The verdict on a device allgather's framing (``size`` x (8-byte length, bytes);
    kernels/threelc.cu, hvd_length_prefixes): int64 [verdict, where, each rank's count],
    one launch and one read of 8 (size + 2) bytes."""
    _check_tensor(buf, "buf", torch.uint8)
    with _Launcher(buf.device) as k:
        out = torch.zeros(size + 2, dtype=torch.int64, device=k.device)
        k("hvd_length_prefixes", 1, _ptr(buf), np.int64(buf.numel()), np.int64(size), _ptr(out))
        return _read_state(out).view(np.int64)


def threelc_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """``threelc_decode`` (accumulating) of each body ``frame[starts[p]:][:lens[p]]`` into
    ``outs[p]`` (float32, on one CUDA device; the frame on the host or that device), as one
    launch sequence: the bodies copied into one device buffer (one host-to-device copy for
    a host frame), their expansion lengths, one scan, the per-body checks (total and
    padding, kernels/threelc.cu section 7), one read of the states, then the expansion and
    the scaled add of every body that precedes the first refused one. None, or (p, message)
    of the first body that does not decode (the ones before it added, its output and those
    after it untouched), with ``threelc_decode``'s messages."""
    count = len(outs)
    if not count:
        return None
    device = _bucket_device(outs, "out")
    starts, lens, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, lens, ns))
    ms = (ns + 4) // 5
    # the host-side bounds of threelc_decode: each body byte expands to 1..14 quartic bytes
    bad = np.flatnonzero((lens > ms) | (lens * _MAX_RUN < ms))
    stop = int(bad[0]) if len(bad) else count
    failed = None if stop == count else (stop, _body_error(ERR_LENGTH).detail)
    live = np.flatnonzero(ms[:stop] > 0)
    if not len(live):
        return failed
    blens, lms = lens[live], ms[live]
    table = np.zeros((len(live), _SEG_COLS), dtype=np.int64)
    table[:, _SEG_AUX] = [outs[p].data_ptr() for p in live.tolist()]
    table[:, _SEG_N] = ns[live]
    table[:, _SEG_QOFF] = np.cumsum(lms) - lms
    table[:, _SEG_BOFF] = np.cumsum(blens) - blens
    table[:, _SEG_BLEN] = blens
    table[:, _SEG_F32] = _f32_bits(np.asarray(scales, dtype=np.float32)[live])
    body = _gather_bodies(frame, starts[live], blens, device)  # one host copy in, at most
    with _Launcher(device) as k:
        seg = _segments(table, lms, device)
        states = k.states(seg.count)
        incl = _zre_check_segments(k, seg, body, states)
        host = _read_state(states).reshape(seg.count, _STATE_WORDS)
        refused = np.flatnonzero(host[:, _ST_ERROR])
        good = seg.count
        if len(refused):
            row = int(refused[0])
            good, p = row, int(live[row])
            total = int(host[row, _ST_COUNT : _ST_COUNT + 2].copy().view(np.int64)[0])
            failed = (p, _body_error(int(host[row, _ST_ERROR]), total, int(ms[p])).detail)
        if good == 0:
            return failed
        quartic = _zre_expand_rows(k, table, lms, good, body, incl, _RUN_GROUP, states)
        part = _first_rows(seg, lms, good)
        k.tiles("threelc_quartic_decode_add_segments", part, _ptr(quartic), _ptr(states))
    return failed


def _zre_check_segments(
    k: _Launcher, seg: _Segments, body: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """The zero-run bodies of a bucket (side by side in ``body``; the table's BOFF / BLEN
    columns): their expansion lengths, one scan, each body's total and padding checked
    into its state row (kernels/threelc.cu section 7). Returns the inclusive scan."""
    length = body.numel()
    lengths = k.empty(length, torch.uint8)
    k("threelc_zre_lengths", length, _ptr(body), np.int64(length), _ptr(lengths))
    incl = torch.cumsum(lengths, 0, dtype=torch.int64)
    del lengths
    k(
        "threelc_zre_decode_check_segments",
        seg.count,
        _ptr(seg.rows),
        np.int64(seg.count),
        _ptr(body),
        _ptr(incl),
        _ptr(states),
    )
    return incl


def _zre_expand_rows(k, table, ms, rows: int, body, incl, run_byte: int, states) -> torch.Tensor:
    """The quartic bytes of the first ``rows`` checked bodies (their bodies and quartic
    bytes are prefixes of the bucket's, and their tiles the first ones), a zero group from
    a run code written as ``run_byte``."""
    used_len = int(table[rows - 1, _SEG_BOFF] + table[rows - 1, _SEG_BLEN])
    used_m = int(table[rows - 1, _SEG_QOFF] + ms[rows - 1])
    quartic = k.empty(used_m, torch.uint8)
    k(
        "threelc_zre_expand",
        used_len,
        _ptr(body),
        _ptr(incl),
        np.int64(used_len),
        np.uint8(run_byte),
        _ptr(quartic),
        np.int64(used_m),
        _ptr(states),
    )
    return quartic


# ---- building blocks -----------------------------------------------------------------------


def quantize(x: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_tensor(x, "x", torch.float32)
    s = _sparsity(sparsity)
    n = x.numel()
    q = torch.empty(n, dtype=torch.int8, device=x.device)
    if n == 0:
        return q, torch.zeros((), dtype=torch.float32, device=x.device)
    with _Launcher(x.device) as k:
        state = k.state()
        _quantize_quartic(k, x, None, s, state, q)
        host = _read_state(state)
    if host[_ST_NONFINITE]:
        raise ValueError("quantize: input holds NaN or Inf (or max|x| * sparsity overflows)")
    return q, state[_ST_SCALE : _ST_SCALE + 1].view(torch.float32)[0].clone()


def quartic_encode(q: torch.Tensor) -> torch.Tensor:
    _check_tensor(q, "q", torch.int8)
    n = q.numel()
    out = torch.empty((n + 4) // 5, dtype=torch.uint8, device=q.device)
    if n == 0:
        return out
    with _Launcher(q.device) as k:
        state = k.state()
        k("threelc_quartic_encode", out.numel(), _ptr(q), np.int64(n), _ptr(out), _ptr(state))
        if _read_state(state)[_ST_ERROR]:
            raise ValueError("quartic_encode: digits must be -1, 0 or 1")
    return out


def quartic_decode(buf: torch.Tensor, numel: int) -> torch.Tensor:
    _check_tensor(buf, "buf", torch.uint8)
    m = (numel + 4) // 5
    if buf.numel() != m:
        raise PayloadError(
            "body", f"{buf.numel()} quartic bytes cannot hold {numel} values (expected {m})"
        )
    q = torch.empty(numel, dtype=torch.int8, device=buf.device)
    if numel == 0:
        return q
    with _Launcher(buf.device) as k:
        state = k.state()
        k("threelc_quartic_decode", m, _ptr(buf), np.int64(numel), _ptr(q), _ptr(state))
        err = int(_read_state(state)[_ST_ERROR])
    if err:
        raise _body_error(err)
    return q


def zero_run_encode(buf: torch.Tensor) -> torch.Tensor:
    _check_tensor(buf, "buf", torch.uint8)
    m = buf.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.uint8, device=buf.device)
    with _Launcher(buf.device) as k:
        state = k.state()
        out = _zre_encode(k, buf, state)
        host = _read_state(state)
    if host[_ST_ERROR] & ERR_INPUT:
        raise ValueError("zero_run_encode: input bytes must be quartic bytes (<= 242)")
    return out[: _count(host)].clone()


def zero_run_decode(buf: torch.Tensor, expected_len: int | None = None) -> torch.Tensor:
    _check_tensor(buf, "buf", torch.uint8)
    length = buf.numel()
    if length == 0:
        total = 0
    else:
        with _Launcher(buf.device) as k:
            state = k.state()
            incl = _zre_prepare(k, buf, -1, state)
            total = _count(_read_state(state))
    if expected_len is not None and total != expected_len:
        raise PayloadError(
            "body", f"zero-run decoding gives {total} bytes, expected {expected_len}"
        )
    out = torch.empty(total, dtype=torch.uint8, device=buf.device)
    if length:
        with _Launcher(buf.device) as k:
            state = k.state()
            k(
                "threelc_zre_expand",
                length,
                _ptr(buf),
                _ptr(incl),
                np.int64(length),
                np.uint8(_ZERO_GROUP),
                _ptr(out),
                np.int64(total),
                _ptr(state),
            )
    return out


# ---- shared primitives (kernels/primitives.cu; see hvdcompress.codecs.primitives) ---------


def uniform(key: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """n float32 uniforms in [0, 1) on ``device``: counter-based, element i from (key, i)."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        with _Launcher(out.device) as k:
            k("primitives_uniform", n, np.uint64(key), np.int64(0), np.int64(n), _ptr(out))
    return out


def bitpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    _check_tensor(codes, "codes", torch.uint8)
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if n:
        with _Launcher(codes.device) as k:
            k(
                "primitives_bitpack",
                nbytes,
                _ptr(codes),
                np.int64(n),
                np.int32(bits),
                _ptr(out),
                np.int64(nbytes),
            )
    return out


def bitunpack(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    _check_tensor(buf, "buf", torch.uint8)
    if buf.numel() != (n * bits + 7) // 8:
        raise PayloadError("body", "the packed body does not have ceil(numel * bits / 8) bytes")
    codes = torch.empty(n, dtype=torch.uint8, device=buf.device)
    if n:
        with _Launcher(buf.device) as k:
            state = k.state()
            k(
                "primitives_bitunpack",
                n,
                _ptr(buf),
                np.int64(buf.numel()),
                np.int64(n),
                np.int32(bits),
                _ptr(codes),
                _ptr(state),
            )
            err = int(_read_state(state)[_ST_ERROR])
        if err & _PRIM_ERR_PADDING:
            raise PayloadError("body", "a padding bit after the last packed value is set")
    return codes


def chunk_sums(x: torch.Tensor, chunk: int, square: bool) -> torch.Tensor:
    _check_tensor(x, "x", torch.float32)
    n = x.numel()
    chunks = (n + chunk - 1) // chunk
    out = torch.empty(chunks, dtype=torch.float64, device=x.device)
    if n:
        with _Launcher(x.device) as k:
            k(
                "primitives_chunk_sums",
                chunks,
                _ptr(x),
                np.int64(n),
                np.int64(chunk),
                np.int32(bool(square)),
                _ptr(out),
            )
    return out


# ---- sign codecs (kernels/sign.cu; see hvdcompress.codecs.sign) ----------------------------

EF_CHUNK = 1024  # elements per order-fixed partial sum of EF-signSGD's mean |a| (cpu.EF_CHUNK)


def sign_encode(x: torch.Tensor) -> torch.Tensor | None:
    """The packed sign bits of x, or None when x holds a NaN or an Inf. One launch and one
    device-to-host copy (the non-finite flag)."""
    _check_tensor(x, "x", torch.float32)
    n = x.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    with _Launcher(x.device) as k:
        state = k.state()
        k("sign_encode", out.numel(), _ptr(x), np.int64(n), _ptr(out), _ptr(state))
        return None if _read_state(state)[_ST_NONFINITE] else out


def sign_encode_segments(xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """``sign_encode`` of each tensor of a bucket: one launch over a segment table
    (kernels/sign.cu section 5), one read of the per-tensor non-finite flags; the bodies
    are views of one buffer."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    nbytes = (ns + 7) // 8
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
    bodies: list[torch.Tensor | None] = list(torch.split(buf, nbytes.tolist()))
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return bodies
    table = _rows(xs, live)
    table[:, _SIGN_SEG_OUT] = [bodies[i].data_ptr() for i in live.tolist()]
    with _Launcher(device) as k:
        seg = _segments(table, nbytes[live], device)
        states = k.states(seg.count)
        k.tiles("sign_encode_segments", seg, _ptr(states))
        bad = _read_state(states).reshape(seg.count, _STATE_WORDS)[:, _ST_NONFINITE]
    for row, i in enumerate(live.tolist()):
        if bad[row]:
            bodies[i] = None
    return bodies


def _check_residuals(gs: list[torch.Tensor], es: list[torch.Tensor]) -> None:
    for g, e in zip(gs, es, strict=True):
        _check_tensor(e, "e", torch.float32)
        if e.numel() != g.numel() or e.device != g.device:
            raise ValueError(
                f"residual has {e.numel()} elements on {e.device}, "
                f"gradient {g.numel()} on {g.device}"
            )


def _bucket_device(ts: list[torch.Tensor], name: str) -> torch.device:
    """The one device of a bucket's float32 tensors (checked)."""
    device = ts[0].device
    for t in ts:
        _check_tensor(t, name, torch.float32)
        if t.device != device:
            raise ValueError(f"a bucket's tensors are on {device} and {t.device}")
    return device


# ---- a bucket's segment calls: the CPU backend's one-call signatures, one launch sequence
# for the bucket here (docs/design.md section 1.6, "The CUDA path") -----------------------


def splits(n: int) -> bool:
    """No host threads here: no tensor leaves a bucket's segment calls."""
    return False


def threelc_encode_segments(
    gs: list[torch.Tensor], es: list[torch.Tensor | None], sparsities: list[float]
) -> tuple[list[torch.Tensor], list[float], list[bool]]:
    """``threelc_encode`` of each (g, e, sparsity) of a bucket as one launch sequence
    (kernels/threelc.cu section 7): a segment table (one host copy in), max|g + e| and the
    quantise + quartic pass of every tensor, one zero-run encode of the bucket's quartic
    bytes (runs stop at tensor ends), and one read of the per-tensor states (S, non-finite
    flag, body length). Bodies are views of one device buffer, in order."""
    if not gs:
        return [], [], []
    device = _bucket_device(gs, "g")
    _check_residuals(gs, [g if e is None else e for g, e in zip(gs, es, strict=True)])
    ss = [_sparsity(s) for s in sparsities]
    ns, live, table = _quartic_table(gs)
    table[:, _SEG_AUX] = [0 if es[i] is None else es[i].data_ptr() for i in live.tolist()]
    table[:, _SEG_F32] = _f32_bits([ss[i] for i in live.tolist()])
    bodies = [torch.empty(0, dtype=torch.uint8, device=device)] * len(gs)
    scales, nonfinite = [0.0] * len(gs), [False] * len(gs)
    if not len(live):
        return bodies, scales, nonfinite
    host, encoded = _quartic_bucket(device, table, ns, "threelc_quantize_quartic_segments")
    words = host[:, _ST_SCALE].copy().view(np.float32)
    for row, (i, body) in enumerate(zip(live.tolist(), encoded, strict=True)):
        if host[row, _ST_NONFINITE]:  # no body, scale 0, the residual untouched
            nonfinite[i] = True
        else:
            bodies[i], scales[i] = body, float(words[row])
    return bodies, scales, nonfinite


def _encode_bucket(gs: list[torch.Tensor], es) -> tuple:
    """What a bucket encoder starts from (gs not empty; the residuals ``es`` checked when
    given): (the device, the numels, the non-empty tensors' indices, empty bodies, no
    non-finite flags), the last two for the caller to fill in."""
    device = _bucket_device(gs, "g")
    if es is not None:
        _check_residuals(gs, es)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=len(gs))
    bodies: list[torch.Tensor | None] = [torch.empty(0, dtype=torch.uint8, device=device)]
    return device, ns, np.flatnonzero(ns > 0), bodies * len(gs), [False] * len(gs)


def _rows(xs: list[torch.Tensor], live: np.ndarray, es=None) -> np.ndarray:
    """A segment table of the tensors ``xs[i]`` for i in ``live``: each row's input,
    residual (``es``; none: column 1 stays 0) and size filled in."""
    table = np.zeros((len(live), _SEG_COLS), dtype=np.int64)
    table[:, _SEG_IN] = [xs[i].data_ptr() for i in live.tolist()]
    if es is not None:
        table[:, _SEG_AUX] = [es[i].data_ptr() for i in live.tolist()]
    table[:, _SEG_N] = [xs[i].numel() for i in live.tolist()]
    return table


def _quartic_table(xs: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(numels, the non-empty tensors' indices, their segment table with the input, size
    and first quartic byte filled in)."""
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    live = np.flatnonzero(ns > 0)
    ms = (ns[live] + 4) // 5
    table = _rows(xs, live)
    table[:, _SEG_QOFF] = np.cumsum(ms) - ms
    return ns, live, table


def _quartic_bucket(
    device: torch.device, table: np.ndarray, ns: np.ndarray, digits: str
) -> tuple[np.ndarray, list[torch.Tensor]]:
    """The launch sequence of a bucket of quartic + zero-run coded tensors (3LC, TernGrad):
    every tensor's max|g + e| into its state row, the ``digits`` kernel (which reads it)
    writing the bucket's quartic bytes, the bucket's zero-run encode, one read. Returns
    the state rows and each table row's body."""
    live_ms = (table[:, _SEG_N] + 4) // 5
    with _Launcher(device) as k:
        seg = _segments(table, live_ms, device)
        states = k.states(seg.count)
        k.tiles("threelc_absmax_segments", seg, _ptr(states))
        quartic = k.empty(int(((ns + 4) // 5).sum()), torch.uint8)
        k.tiles(digits, seg, _ptr(states), _ptr(quartic))
        out = _zre_encode_segments(k, seg, quartic, states)
        host = _read_state(states).reshape(seg.count, _STATE_WORDS)
    return host, _segment_bodies(out, host)


def _zre_encode_segments(
    k: _Launcher, seg: _Segments, quartic: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """Zero-run encode a bucket's quartic bytes, each tensor's on its own (runs stop at
    its end), into one new buffer; each tensor's body length goes to its state row."""
    total = quartic.numel()
    start = k.empty(total, torch.int64)
    k.tiles("threelc_zre_run_starts_segments", seg, _ptr(quartic), _ptr(start))
    run_start = _running_max(start)
    del start
    # input errors cannot happen here (quartic bytes are <= 242): a scratch state
    incl = _zre_emit_scan(k, quartic, run_start, k.state())
    out = k.empty(total, torch.uint8)
    k.tiles(
        "threelc_zre_scatter_segments",
        seg,
        _ptr(quartic),
        _ptr(run_start),
        _ptr(incl),
        _ptr(out),
        np.int64(total),
        _ptr(states),
    )
    return out


def _segment_bodies(out: torch.Tensor, host: np.ndarray) -> list[torch.Tensor]:
    """Each tensor's body, in order, from the state rows' lengths (a view of ``out``)."""
    if host[:, _ST_ERROR].any():
        raise RuntimeError("bucket zero-run encode: a write past the buffer was refused")
    lengths = host[:, _ST_COUNT : _ST_COUNT + 2].copy().view(np.int64).reshape(-1)
    firsts = np.cumsum(lengths) - lengths
    return [out[a : a + n] for a, n in zip(firsts.tolist(), lengths.tolist(), strict=True)]


def efsign_sums_segments(gs, es) -> tuple[list[np.ndarray], list[bool]]:
    """``efsign_sums`` of each (g, e) of a bucket: one launch over a segment table, one read
    of every tensor's chunk sums and non-finite flag (sums as host arrays)."""
    if not gs:
        return [], []
    device = _bucket_device(gs, "g")
    _check_residuals(gs, es)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=len(gs))
    chunks = (ns + EF_CHUNK - 1) // EF_CHUNK
    first = np.cumsum(chunks) - chunks
    live = np.flatnonzero(ns > 0)
    total = int(chunks.sum())
    # the chunk sums, then the state rows (4 doubles = 8 words each): one read for both
    scratch = torch.zeros(total + 4 * len(live), dtype=torch.float64, device=device)
    if len(live):
        states = scratch[total:].view(torch.int32)
        table = _rows(gs, live, es)
        table[:, _SIGN_SEG_OUT] = scratch.data_ptr() + 8 * first[live]
        with _Launcher(device) as k:
            seg = _segments(table, chunks[live], device)
            k.tiles("sign_ef_sums_segments", seg, np.int64(EF_CHUNK), _ptr(states))
    host = _read_state(scratch)
    sums = host[: 2 * total].view(np.float64)
    words = host[2 * total :].reshape(-1, _STATE_WORDS)
    bad = [False] * len(gs)
    for row, i in enumerate(live.tolist()):
        bad[i] = bool(words[row, _ST_NONFINITE])
    return [sums[a : a + c] for a, c in zip(first.tolist(), chunks.tolist(), strict=True)], bad


def efsign_encode_segments(gs, es, scales, skip) -> list[torch.Tensor]:
    """``efsign_encode`` of each (g, e, scale) of a bucket whose ``skip`` is False: one
    launch over a segment table, no host copy; the bodies (empty where skipped) are views
    of one buffer."""
    if not gs:
        return []
    device = _bucket_device(gs, "g")
    _check_residuals(gs, es)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=len(gs))
    nbytes = np.where(np.asarray(skip, dtype=bool), 0, (ns + 7) // 8)
    buf = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=device)
    bodies = list(torch.split(buf, nbytes.tolist()))
    live = np.flatnonzero(nbytes > 0)
    if len(live):
        table = _rows(gs, live, es)
        table[:, _SIGN_SEG_OUT] = [bodies[i].data_ptr() for i in live.tolist()]
        table[:, _SEG_F32] = _f32_bits(np.asarray(scales, dtype=np.float32)[live])
        with _Launcher(device) as k:
            k.tiles("sign_ef_encode_segments", _segments(table, nbytes[live], device))
    return bodies


def efsign_sums(g: torch.Tensor, e: torch.Tensor) -> torch.Tensor | None:
    """float64 sums of |g + e| over EF_CHUNK-element chunks (each left to right), or None
    when g + e holds a NaN or an Inf."""
    _check_tensor(g, "g", torch.float32)
    _check_tensor(e, "e", torch.float32)
    n = g.numel()
    chunks = (n + EF_CHUNK - 1) // EF_CHUNK
    sums = torch.empty(chunks, dtype=torch.float64, device=g.device)
    if n == 0:
        return sums
    with _Launcher(g.device) as k:
        state = k.state()
        k(
            "sign_ef_sums",
            chunks,
            _ptr(g),
            _ptr(e),
            np.int64(n),
            np.int64(EF_CHUNK),
            _ptr(sums),
            _ptr(state),
        )
        return None if _read_state(state)[_ST_NONFINITE] else sums


def efsign_encode(g: torch.Tensor, e: torch.Tensor, scale: float) -> torch.Tensor:
    """The sign bits of a = g + e; e <- a - (a < 0 ? -scale : scale). No host copy."""
    n = g.numel()
    out = torch.empty((n + 7) // 8, dtype=torch.uint8, device=g.device)
    if n:
        with _Launcher(g.device) as k:
            k(
                "sign_ef_encode",
                out.numel(),
                _ptr(g),
                _ptr(e),
                np.float32(scale),
                np.int64(n),
                _ptr(out),
            )
    return out


def sign_decode(
    body: torch.Tensor, n: int, scale: float, out: torch.Tensor, accumulate: bool
) -> None:
    """out = (bit ? -scale : scale), or out += that; body has ceil(n / 8) bytes. A set
    padding bit raises PayloadError with out untouched (the kernel checks before writing)."""
    _check_tensor(out, "out", torch.float32)
    with _Launcher(out.device) as k:
        state = k.state()
        k(
            "sign_decode",
            body.numel(),
            _ptr(body),
            np.int64(n),
            np.float32(scale),
            _ptr(out),
            np.int32(bool(accumulate)),
            _ptr(state),
        )
        if int(_read_state(state)[_ST_ERROR]) & _PRIM_ERR_PADDING:
            raise PayloadError("body", "a padding bit after the last packed value is set")


def sign_decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    ns: np.ndarray,
    scales: np.ndarray,
    outs: list[torch.Tensor],
) -> tuple[int, str] | None:
    """``sign_decode`` (accumulating) of each body at ``frame[starts[p]:]`` (the caller
    checked the lengths) into ``outs[p]`` (on one CUDA device; the frame on the host or
    that device): the padding check of every body, one read, then one launch that adds
    the bodies before the first refused one. None, or (p, message) of that body."""
    if not outs:
        return None
    device = _bucket_device(outs, "out")
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    nbytes = (ns + 7) // 8
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return None
    body, at = _bodies_on(frame, np.asarray(starts, dtype=np.int64)[live], nbytes[live], device)
    table = np.zeros((len(live), _SEG_COLS), dtype=np.int64)
    table[:, _SEG_IN] = at
    table[:, _SEG_AUX] = [outs[p].data_ptr() for p in live.tolist()]
    table[:, _SEG_N] = ns[live]
    table[:, _SEG_F32] = _f32_bits(np.asarray(scales, dtype=np.float32)[live])
    with _Launcher(device) as k:
        seg = _segments(table, nbytes[live], device)
        states = k.states(seg.count)
        k(
            "sign_decode_check_segments",
            seg.count,
            _ptr(seg.rows),
            np.int64(seg.count),
            _ptr(states),
        )
        refused = np.flatnonzero(_read_state(states).reshape(seg.count, _STATE_WORDS)[:, _ST_ERROR])
        good = int(refused[0]) if len(refused) else seg.count
        if good:
            k.tiles("sign_decode_add_segments", _first_rows(seg, nbytes[live], good))
        del body  # stream-ordered: the launches above are queued before its reuse
    if len(refused):
        return int(live[good]), "a padding bit after the last packed value is set"
    return None


def _bodies_on(
    frame: torch.Tensor, starts: np.ndarray, lens: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, np.ndarray]:
    """The bodies ``frame[starts[p]:][:lens[p]]`` side by side in one new buffer on
    ``device`` (one copy there for a host frame; a frame on the device is copied on the
    device, a few percent of the outputs' traffic, so that both cases take this one path),
    and each body's address in it."""
    buf = _gather_bodies(frame, starts, lens, device)
    return buf, buf.data_ptr() + (np.cumsum(lens) - lens)


def _gather_bodies(
    frame: torch.Tensor, starts: np.ndarray, lens: np.ndarray, device: torch.device
) -> torch.Tensor:
    flat = frame.reshape(-1)
    pieces = [flat[a : a + n] for a, n in zip(starts.tolist(), lens.tolist(), strict=True)]
    return torch.cat(pieces).to(device)


def _first_rows(seg: _Segments, units: np.ndarray, count: int) -> _Segments:
    """The first ``count`` rows of a segment table (their tiles are the first ones)."""
    tiles = int(-(-units[:count] // seg.tile).sum())
    return _Segments(seg.rows, count, tiles, seg.tile)


# ---- stochastic quantisers (kernels/quant.cu; see hvdcompress.codecs.quant) -----------------


def qsgd_encode(
    x: torch.Tensor, levels: int, bits: int, bucket: int, key: int
) -> torch.Tensor | None:
    """The QSGD body (norms, then packed codes), or None when x holds a NaN or an Inf or a
    norm overflows float32. Two launches, one device-to-host copy."""
    _check_tensor(x, "x", torch.float32)
    n = x.numel()
    nb = (n + bucket - 1) // bucket
    body = torch.empty(4 * nb + (n * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    if n == 0:
        return body
    norms = body[: 4 * nb].view(torch.float32)  # 4-byte aligned: the body starts the tensor
    with _Launcher(x.device) as k:
        state = k.state()
        k("quant_qsgd_norms", nb, _ptr(x), np.int64(n), np.int64(bucket), _ptr(norms), _ptr(state))
        k(
            "quant_qsgd_encode",
            (n + 7) // 8,
            _ptr(x),
            np.int64(n),
            np.int32(levels),
            np.int32(bits),
            np.int64(bucket),
            np.uint64(key),
            _ptr(norms),
            np.uint64(body.data_ptr() + 4 * nb),
        )
        return None if _read_state(state)[_ST_NONFINITE] else body


def qsgd_decode(
    body: torch.Tensor,
    n: int,
    levels: int,
    bits: int,
    bucket: int,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """Check the body (norms, padding, codes), then decode it into out: PayloadError with
    out untouched on a bad body. Two launches, one device-to-host copy between them."""
    _check_tensor(out, "out", torch.float32)
    nb = (n + bucket - 1) // bucket
    args = (_ptr(body), np.int64(n), np.int32(levels), np.int32(bits), np.int64(bucket))
    with _Launcher(out.device) as k:
        state = k.state()
        k("quant_qsgd_check", max((n + 7) // 8, nb), *args, _ptr(state))
        err = int(_read_state(state)[_ST_ERROR])
        if err & (_QUANT_ERR_NORM | _PRIM_ERR_PADDING | _QUANT_ERR_CODE):
            raise PayloadError("body", _qsgd_refusal(err))
        k("quant_qsgd_decode", (n + 7) // 8, *args, _ptr(out), np.int32(bool(accumulate)))


def qsgd_encode_segments(
    xs: list[torch.Tensor], levels: int, bits: int, bucket: int, keys: list[int]
) -> list[torch.Tensor | None]:
    """``qsgd_encode`` of each (x, key) of a bucket: every norm, then every code, one
    launch each (kernels/quant.cu section 9), one read of the non-finite flags. The bodies
    are views of one buffer, each 4-byte aligned (norms first); None for a non-finite x."""
    return _packed_bucket_encode(xs, keys, levels, bits, bucket, dqsg=False)


def dqsg_encode_segments(
    xs: list[torch.Tensor], keys: list[int], levels: int, bits: int, bucket: int
) -> list[torch.Tensor | None]:
    """DQSG's body of each (x, key) of a bucket, None for a non-finite x. s = levels > 1:
    deltas, then the bit-packed codes q + s: every delta, then every code, one launch
    each, one read of the non-finite flags; views of one buffer (4-byte aligned). s = 1:
    ``_dqsg_ternary_encode``."""
    if levels == 1:
        return _digits_ternary_encode(xs, keys, bucket)
    return _packed_bucket_encode(xs, keys, levels, bits, bucket, dqsg=True)


def digits_encode_segments(
    xs: list[torch.Tensor], keys: list[int], levels: int, rho: int, bits: int, bucket: int
) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """The CPU backend's ``digits_encode_segments`` on one CUDA device: DQSG's quantiser
    (s = levels) of each (x, key) of a bucket, its digits (rho 0: q, DQSG with s = 1;
    rho >= 2: NDQSG's cosets of q) coded as one launch sequence, quartic + zero-run for
    rho <= 3 (``_digits_ternary_encode``) or packed codes coset + rho // 2 of ``bits``
    bits (``_packed_bucket_encode``). Returns (the bodies, None for a non-finite x; the
    int8 q of every tensor, concatenated in order, on the device)."""
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    device = _bucket_device(xs, "x") if xs else torch.device(DEVICE_TYPE)
    ks = torch.empty(int(ns.sum()), dtype=torch.int8, device=device)
    if rho <= 3:
        return _digits_ternary_encode(xs, keys, bucket, levels, rho, ks), ks
    return _packed_bucket_encode(xs, keys, levels, bits, bucket, True, rho, ks), ks


def _digits_ternary_encode(
    xs, keys, bucket: int, levels: int = 1, rho: int = 0, ks: torch.Tensor | None = None
) -> list[torch.Tensor | None]:
    """Bodies of ternary digits (deltas, then the digits quartic + zero-run coded; the
    CPU's ``digits_encode_segments``): DQSG's q at s = 1, or with ``rho`` (2 or 3) NDQSG's
    cosets of q at s = ``levels``, the q into ``ks`` (the tensors' elements in order) when
    given. Every delta (quant_bucket_floats_segments), every quartic byte
    (quant_dqsg_quartic_segments), the bucket's zero-run encode (threelc.cu section 7),
    one read of the states; then one ``cat`` puts each tensor's deltas before its
    zero-run bytes."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns, live, zre = _quartic_table(xs)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    bodies: list[torch.Tensor | None] = [empty] * len(xs)
    if not len(live):
        return bodies
    nb = (ns[live] + bucket - 1) // bucket
    ms = (ns[live] + 4) // 5
    deltas = torch.empty(int(nb.sum()), dtype=torch.float32, device=device)
    dfirst = np.cumsum(nb) - nb
    digits = zre.copy()  # the digit kernel reads column 3 as the deltas, 1 as the quartic
    digits[:, _QUANT_SEG_QUARTIC] = zre[:, _SEG_QOFF]
    digits[:, _QUANT_SEG_DELTAS] = deltas.data_ptr() + 4 * dfirst
    digits[:, _QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    if ks is not None:
        digits[:, _QUANT_SEG_KS] = ks.data_ptr() + (np.cumsum(ns) - ns)[live]
    (per_bucket, groups), (runs,) = _stacked_tilings(
        [(digits, {_SEG_BOFF: nb, _SEG_TILE: ms}), (zre, {_SEG_TILE: ms})], device
    )
    with _Launcher(device) as k:
        states = k.states(len(live))
        args = (np.int32(levels), np.int64(bucket), np.int32(1), _ptr(states))
        k.tiles("quant_bucket_floats_segments", per_bucket, np.int32(_SEG_BOFF), *args)
        quartic = k.empty(int(ms.sum()), torch.uint8)
        digit_args = (np.int64(bucket), np.int32(levels), np.int32(rho), _ptr(states))
        k.tiles("quant_dqsg_quartic_segments", groups, *digit_args, _ptr(quartic))
        out = _zre_encode_segments(k, runs, quartic, states)
        host = _read_state(states).reshape(len(live), _STATE_WORDS)
    coded = _segment_bodies(out, host)
    keep = [r for r in range(len(live)) if not host[r, _ST_NONFINITE]]
    delta_bytes = deltas.view(torch.uint8)
    pieces = []
    for r in keep:
        pieces += [delta_bytes[4 * dfirst[r] :][: 4 * nb[r]], coded[r]]
    joined = torch.cat(pieces) if pieces else delta_bytes[:0]
    at = 0
    for r, i in enumerate(live.tolist()):
        if host[r, _ST_NONFINITE]:
            bodies[i] = None
            continue
        size = 4 * int(nb[r]) + coded[r].numel()
        bodies[i], at = joined[at : at + size], at + size
    return bodies


def _packed_bucket_encode(
    xs, keys, levels: int, bits: int, bucket: int, dqsg: bool, rho: int = 0, ks=None
):
    """A bucket of bodies made of one float32 per ``bucket`` elements (QSGD's norms, or
    with ``dqsg`` DQSG's deltas: quant_bucket_floats_segments, one thread a bucket,
    non-finite flags into the state rows), then ``bits``-bit codes
    (quant_packed_encode_segments, one thread a group of eight: QSGD's, DQSG's, or with
    ``rho`` NDQSG's cosets, the fine indices q into ``ks`` when given)."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns = np.fromiter((x.numel() for x in xs), dtype=np.int64, count=len(xs))
    nb = (ns + bucket - 1) // bucket
    sizes = 4 * nb + (ns * bits + 7) // 8
    room = (sizes + 3) // 4 * 4  # the next body's floats stay 4-byte aligned
    firsts = np.cumsum(room) - room
    buf = torch.empty(int(room.sum()), dtype=torch.uint8, device=device)
    bodies: list[torch.Tensor | None] = [
        buf[a : a + n] for a, n in zip(firsts.tolist(), sizes.tolist(), strict=True)
    ]
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return bodies
    table = _rows(xs, live)
    table[:, _SIGN_SEG_OUT] = buf.data_ptr() + firsts[live]
    table[:, _QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    if ks is not None:
        table[:, _SEG_AUX] = ks.data_ptr() + (np.cumsum(ns) - ns)[live]
    tilings = {_SEG_BOFF: nb[live], _SEG_TILE: (ns[live] + 7) // 8}
    per_bucket, groups = _tilings(table, device, tilings)
    with _Launcher(device) as k:
        states = k.states(per_bucket.count)
        at, flag = np.int32(_SEG_BOFF), np.int32(dqsg)
        args = (np.int32(levels), np.int64(bucket), flag, _ptr(states))
        k.tiles("quant_bucket_floats_segments", per_bucket, at, *args)
        args = (np.int32(levels), np.int32(bits), np.int64(bucket), flag, np.int32(rho))
        k.tiles("quant_packed_encode_segments", groups, np.int32(_SEG_TILE), *args)
        bad = _read_state(states).reshape(per_bucket.count, _STATE_WORDS)[:, _ST_NONFINITE]
    for row, i in enumerate(live.tolist()):
        if bad[row]:
            bodies[i] = None
    return bodies


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
    checked its length) into ``outs[p]`` (on one CUDA device; the frame on the host or that
    device): every body checked (one launch, one read), then one launch that adds the
    bodies before the first refused one. None, or (p, ``qsgd_decode``'s message)."""
    failed, _ = _packed_bucket_decode(frame, starts, ns, None, bits, bucket, outs, "qsgd", levels)
    return None if failed is None else (failed[0], _qsgd_refusal(failed[1]))


_DQSG_ERRORS = ((_QUANT_ERR_NORM, -12), (_PRIM_ERR_PADDING, -14), (_QUANT_ERR_CODE, -15))


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
    """DQSG's decode (accumulating) of each body ``frame[starts[p]:][:lens[p]]`` into
    ``outs[p]`` (on one CUDA device). s = levels > 1: the lengths on the host, every body
    checked (one launch, one read), then one launch that adds the bodies before the first
    refused one. None, or (p, the CPU backend's error code for it: kernels/quant.c
    DQSG_ERR_*). s = 1: ``_digits_ternary_decode``, whose refusal (p, error bits) the codec
    words from the per-payload decoder."""
    if levels == 1:
        return _digits_ternary_decode(frame, starts, lens, ns, keys, bucket, outs)[0]
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    nb = (ns + bucket - 1) // bucket
    short, wrong = lens < 4 * nb, lens - 4 * nb != (ns * bits + 7) // 8
    bad = np.flatnonzero(short | wrong)
    stop = int(bad[0]) if len(bad) else len(outs)
    head = (frame, np.asarray(starts)[:stop], ns[:stop], list(keys)[:stop], bits, bucket)
    failed, _ = _packed_bucket_decode(*head, outs[:stop], "dqsg", levels)
    if failed is not None:
        return failed[0], next(code for bit, code in _DQSG_ERRORS if failed[1] & bit)
    return None if stop == len(outs) else (stop, -11 if short[stop] else -13)


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
    """The CPU backend's ``digits_decode_segments`` on one CUDA device: the decode,
    accumulating, of each body of ``digits_encode_segments`` (DQSG with s = 1 at rho 0, or
    NDQSG's nested code with the side information ``outs[p] / divisor``) as one launch
    sequence, ternary digits by ``_digits_ternary_decode``, packed codes by
    ``_packed_bucket_decode``. Returns (the aliasing count of each body against
    ``k_trues[p]``, 0 where None; None, or (p, error bits; -1 for a length the host
    refused) for the first body that does not decode, the ones before it added)."""
    nested = (rho, divisor, k_trues)
    if rho <= 3:
        failed, aliased = _digits_ternary_decode(frame, starts, lens, ns, keys, bucket, outs,
                                                 *nested)  # fmt: skip
        return aliased, failed
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    lens = np.asarray(lens, dtype=np.int64).reshape(-1)
    nb = (ns + bucket - 1) // bucket
    bad = np.flatnonzero(lens - 4 * nb != (ns * bits + 7) // 8)
    stop = int(bad[0]) if len(bad) else len(outs)
    head = (frame, np.asarray(starts)[:stop], ns[:stop], list(keys)[:stop], bits, bucket)
    trues = None if k_trues is None else list(k_trues)[:stop]
    failed, part = _packed_bucket_decode(*head, outs[:stop], "dqsg", rho // 2, rho, divisor, trues)
    aliased = np.zeros(len(outs), dtype=np.int64)
    aliased[:stop] = part
    if failed is None and stop < len(outs):
        failed = (stop, -1)
    return aliased, failed


def _aliasing_counts(k, live: np.ndarray, k_trues) -> tuple[torch.Tensor | None, ...]:
    """(the device array of each live row's k_true address, 0 where None; the zeroed
    int64 counts the decode kernels add into), or (None, None) when no k_true is given.
    The caller keeps both alive until its launches are queued."""
    if k_trues is None or all(k_trues[p] is None for p in live.tolist()):
        return None, None
    at = [0 if k_trues[p] is None else k_trues[p].data_ptr() for p in live.tolist()]
    trues = torch.tensor(at, dtype=torch.int64).to(k.device)
    return trues, torch.zeros(len(live), dtype=torch.int64, device=k.device)


def _aliased(counts: torch.Tensor | None, live: np.ndarray, count: int) -> np.ndarray:
    out = np.zeros(count, dtype=np.int64)
    if counts is not None:
        out[live] = _read_state(counts).view(np.int64)
    return out


def _digits_ternary_decode(
    frame, starts, lens, ns, keys, bucket: int, outs, rho=0, divisor=1, k_trues=None
):
    """The decode of ``_digits_ternary_encode``'s bodies, accumulating: the lengths on the
    host (the deltas fit, and 1 .. 14 quartic bytes a zero-run byte), the bodies' zero-run
    parts and deltas gathered into one device buffer (one host-to-device copy for a host
    frame), the zero-run lengths and one scan, every body's zero-run total and padding
    (threelc.cu) and deltas (quant_dqsg_deltas_check_segments), one read, then the
    expansion (run groups as zero groups) and quant_dqsg_quartic_decode_add_segments for
    the bodies before the first refused one: DQSG's values, or with ``rho`` NDQSG's side
    decode against ``outs[p] / divisor`` and the aliasing counts against ``k_trues``
    (read after the last launch, only when some k_true is given). (None, or (p, its error
    bits; -1 for a length the host refused); the aliasing count of each body.)"""
    count = len(outs)
    aliased = np.zeros(count, dtype=np.int64)
    if not count:
        return None, aliased
    device = _bucket_device(outs, "out")
    starts, lens, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, lens, ns))
    nb, ms = (ns + bucket - 1) // bucket, (ns + 4) // 5
    zlens = lens - 4 * nb
    bad = np.flatnonzero((zlens < 0) | (zlens > ms) | (zlens * _MAX_RUN < ms))
    stop = int(bad[0]) if len(bad) else count
    failed = None if stop == count else (stop, -1)
    live = np.flatnonzero(ms[:stop] > 0)
    if not len(live):
        return failed, aliased
    zl, lms, lnb = zlens[live], ms[live], nb[live]
    flat = frame.reshape(-1)
    first = starts[live] + 4 * lnb
    pieces = [flat[a : a + n] for a, n in zip(first.tolist(), zl.tolist(), strict=True)]
    pieces += [
        flat[a : a + 4 * n] for a, n in zip(starts[live].tolist(), lnb.tolist(), strict=True)
    ]
    body = torch.cat(pieces).to(device)  # the zero-run parts, then the deltas
    length = int(zl.sum())
    deltas_at = body.data_ptr() + length + 4 * (np.cumsum(lnb) - lnb)
    table = np.zeros((len(live), _SEG_COLS), dtype=np.int64)
    table[:, _SEG_IN] = deltas_at
    table[:, _SEG_AUX] = [outs[p].data_ptr() for p in live.tolist()]
    table[:, _SEG_N] = ns[live]
    table[:, _SEG_QOFF] = np.cumsum(lms) - lms
    table[:, _SEG_BOFF] = np.cumsum(zl) - zl
    table[:, _SEG_BLEN] = zl
    table[:, _QUANT_SEG_DECODE_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    check = np.zeros_like(table)
    check[:, _SEG_IN], check[:, _SEG_N] = deltas_at, ns[live]
    (seg,), (per_bucket,) = _stacked_tilings(
        [(table, {_SEG_TILE: lms}), (check, {_SEG_TILE: lnb})], device
    )
    with _Launcher(device) as k:
        states = k.states(seg.count)
        trues, counts = _aliasing_counts(k, live, k_trues)
        incl = _zre_check_segments(k, seg, body[:length], states)
        at = np.int32(_SEG_TILE)
        k.tiles("quant_dqsg_deltas_check_segments", per_bucket, at, np.int64(bucket),
                _ptr(states))  # fmt: skip
        host = _read_state(states).reshape(seg.count, _STATE_WORDS)
        refused = np.flatnonzero(host[:, _ST_ERROR])
        good = int(refused[0]) if len(refused) else seg.count
        if len(refused):
            failed = (int(live[good]), int(host[good, _ST_ERROR]))
        if good:
            # run groups expanded as plain zero groups: a zero q adds its dither term too
            quartic = _zre_expand_rows(k, table, lms, good, body, incl, _ZERO_GROUP, states)
            part = _first_rows(seg, lms, good)
            side = (np.int32(rho), np.float32(divisor), _ptr(trues), _ptr(counts))
            k.tiles("quant_dqsg_quartic_decode_add_segments", part, np.int64(bucket),
                    _ptr(quartic), *side)  # fmt: skip
        aliased = _aliased(counts, live, count)
        del body  # stream-ordered: the launches above are queued before its reuse
    return failed, aliased


def _packed_bucket_decode(
    frame, starts, ns, keys, bits, bucket, outs, codec: str, levels, rho=0, divisor=1,
    k_trues=None,
):  # fmt: skip
    """The decode of ``_packed_bucket_encode``'s bodies (lengths checked by the caller) of
    ``codec`` ("qsgd" or "dqsg"; with ``rho`` NDQSG's cosets, ``levels`` = rho // 2, side
    information ``outs[p] / divisor``, aliasing against ``k_trues``):
    ``quant_packed_check_segments`` (one launch, one read), then
    ``quant_packed_decode_add_segments`` for the bodies before the first refused one.
    (None, or (p, its error bits); the aliasing count of each body.)"""
    aliased = np.zeros(len(outs), dtype=np.int64)
    if not outs:
        return None, aliased
    device = _bucket_device(outs, "out")
    ns = np.asarray(ns, dtype=np.int64).reshape(-1)
    nb = (ns + bucket - 1) // bucket
    groups = (ns + 7) // 8
    live = np.flatnonzero(ns > 0)
    if not len(live):
        return None, aliased
    sizes = 4 * nb + (ns * bits + 7) // 8
    body, at = _bodies_on(frame, np.asarray(starts, dtype=np.int64)[live], sizes[live], device)
    table = np.zeros((len(live), _SEG_COLS), dtype=np.int64)
    table[:, _SEG_IN] = at
    table[:, _SEG_AUX] = [outs[p].data_ptr() for p in live.tolist()]
    table[:, _SEG_N] = ns[live]
    if keys is not None:
        table[:, _QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    units = np.maximum(groups, nb)[live]
    check, decode = _tilings(table, device, {_SEG_TILE: units, _SEG_BOFF: groups[live]})
    args = (np.int32(levels), np.int32(bits), np.int64(bucket))
    with _Launcher(device) as k:
        states = k.states(check.count)
        trues, counts = _aliasing_counts(k, live, k_trues)
        rule = np.int32(codec == "dqsg")
        at = np.int32(_SEG_TILE)
        k.tiles("quant_packed_check_segments", check, at, *args, rule, _ptr(states))
        errors = _read_state(states).reshape(check.count, _STATE_WORDS)[:, _ST_ERROR]
        refused = np.flatnonzero(errors)
        good = int(refused[0]) if len(refused) else check.count
        if good:
            part = _first_rows(decode, groups[live], good)
            at = np.int32(_SEG_BOFF)
            side = (np.int32(rho), np.float32(divisor), _ptr(trues), _ptr(counts))
            k.tiles("quant_packed_decode_add_segments", part, at, *args, rule, *side)
        aliased = _aliased(counts, live, len(outs))
        del body  # stream-ordered: the launches above are queued before its reuse
    return None if not len(refused) else (int(live[good]), int(errors[good])), aliased


def _qsgd_refusal(err: int) -> str:
    """``qsgd_decode``'s message for the check's error bits (the same order)."""
    if err & _QUANT_ERR_NORM:
        return "a QSGD norm is negative or not finite"
    if err & _PRIM_ERR_PADDING:
        return "a padding bit after the last packed value is set"
    return "a QSGD level is above the levels or a zero is signed"


def terngrad_encode(x: torch.Tensor, key: int) -> tuple[torch.Tensor, float] | None:
    """(zero-run-encoded quartic body, M = max|x|), or None when x holds a NaN or an Inf:
    threelc_absmax, one device-to-host copy (M goes into the header), the quartic kernel,
    then threelc.cu's zero-run encoder."""
    _check_tensor(x, "x", torch.float32)
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=x.device), 0.0
    with _Launcher(x.device) as k:
        state = k.state()
        k("threelc_absmax", n, _ptr(x), _NULL, np.int64(n), _ptr(state))
        max_bits = int(_read_state(state)[_ST_ABSMAX])
        if max_bits >= 0x7F800000:
            return None
        scale = _f32(max_bits)
        quartic = k.empty((n + 4) // 5, torch.uint8)
        k(
            "quant_terngrad_quartic",
            quartic.numel(),
            _ptr(x),
            np.int64(n),
            np.float32(scale),
            np.uint64(key),
            _ptr(quartic),
        )
        out = _zre_encode(k, quartic, state)
        length = _count(_read_state(state))
    return out[:length], scale


def terngrad_encode_segments(
    xs: list[torch.Tensor], keys: list[int]
) -> list[tuple[torch.Tensor, float] | None]:
    """``terngrad_encode`` of each (x, key) of a bucket as one launch sequence: every
    tensor's max|x| (threelc_absmax_segments), its quartic digits
    (quant_terngrad_quartic_segments, M read on the device), the bucket's zero-run encode,
    then one read of the states (M, body length). (body, a view of one buffer; M), or None
    for a non-finite x."""
    if not xs:
        return []
    device = _bucket_device(xs, "x")
    ns, live, table = _quartic_table(xs)
    table[:, _SEG_BLEN] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)  # the key
    encoded: list[tuple[torch.Tensor, float] | None] = [
        (torch.empty(0, dtype=torch.uint8, device=device), 0.0)
    ] * len(xs)
    if not len(live):
        return encoded
    host, bodies = _quartic_bucket(device, table, ns, "quant_terngrad_quartic_segments")
    for row, (i, body) in enumerate(zip(live.tolist(), bodies, strict=True)):
        max_bits = int(host[row, _ST_ABSMAX])
        encoded[i] = None if max_bits >= 0x7F800000 else (body, _f32(max_bits))
    return encoded


def dqsg_quantize(
    w: torch.Tensor, levels: int, bucket: int, key: int, code_offset: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q + code_offset as uint8, deltas float32 per bucket), or None when w holds a NaN or
    an Inf. Two launches, one device-to-host copy (the non-finite flag)."""
    _check_tensor(w, "w", torch.float32)
    n = w.numel()
    nb = (n + bucket - 1) // bucket
    deltas = torch.empty(nb, dtype=torch.float32, device=w.device)
    q = torch.empty(n, dtype=torch.uint8, device=w.device)
    if n == 0:
        return q, deltas
    with _Launcher(w.device) as k:
        state = k.state()
        k(
            "quant_dqsg_deltas",
            nb,
            _ptr(w),
            np.int64(n),
            np.int32(levels),
            np.int64(bucket),
            _ptr(deltas),
            _ptr(state),
        )
        k(
            "quant_dqsg_quantize",
            n,
            _ptr(w),
            np.int64(n),
            np.int32(levels),
            np.int64(bucket),
            np.uint64(key),
            np.int32(code_offset),
            _ptr(deltas),
            _ptr(q),
        )
        return None if _read_state(state)[_ST_NONFINITE] else (q, deltas)


def dqsg_dequantize(
    q: torch.Tensor,
    deltas: torch.Tensor,
    bucket: int,
    key: int,
    out: torch.Tensor,
    accumulate: bool,
) -> None:
    """out = delta * (q - dither), or out += that (q int8, deltas validated float32 bytes)."""
    _check_tensor(out, "out", torch.float32)
    n = q.numel()
    if n == 0:
        return
    with _Launcher(out.device) as k:
        k(
            "quant_dqsg_dequantize",
            n,
            _ptr(q),
            np.int64(n),
            _ptr(deltas),
            np.int64(bucket),
            np.uint64(key),
            _ptr(out),
            np.int32(bool(accumulate)),
        )


# ---- top-k selection (torch on the device; the CPU backend's twin is kernels/sparse.c) -------

TOPK_SAMPLE = 65536  # elements of the strided sample that bounds the threshold from below


def _topk_candidates(mag: torch.Tensor, k: int) -> torch.Tensor | None:
    """Ascending indices of a superset of the k largest |a| (all |a| >= a lower bound from
    a strided sample), or None when the sample's bound is not low enough (then the caller
    scans everything). Deterministic: the sample and the bound are exact."""
    n = mag.numel()
    if n < 4 * TOPK_SAMPLE or 8 * k > n:
        return None
    stride = n // TOPK_SAMPLE
    sample = mag[::stride]
    m = sample.numel()
    j = min(m, math.ceil(m * 2.0 * k / n) + 64)  # aim at about 2k candidates
    bound = torch.topk(sample, j, sorted=False).values.min()
    cand = torch.nonzero(mag >= bound).reshape(-1)
    return cand if cand.numel() >= k else None


def topk_select(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the k largest |a| (0 < k < n, a finite), ties by lowest
    index: t = the k-th largest |a| (torch.topk, exact), every |a| > t, then the |a| == t
    in index order (torch.topk alone may break ties differently on the CPU and the GPU)."""
    mag = a.abs()
    cand = _topk_candidates(mag, k)
    if cand is not None:  # every one of the k largest is a candidate: select among them
        mag = mag[cand]
    thr = torch.topk(mag, k, sorted=False).values.min()  # the k-th largest |a|, exact
    above = mag > thr
    need = k - int(above.sum())
    equal = mag == thr
    keep = above | (equal & (torch.cumsum(equal, 0, dtype=torch.int64) <= need))
    idx = torch.nonzero(keep).reshape(-1)
    return cand[idx] if cand is not None else idx


_TOPK_SEG_U, _TOPK_SEG_K, _TOPK_SEG_FLAGS, _TOPK_SEG_BODY = 3, 4, 5, 7  # HVD_TOPK_SEG_*
_TOPKQ_SEG_A, _TOPKQ_SEG_BODY = 0, 1  # HVD_TOPKQ_SEG_*: sparse_topkq_write_segments' rows
_TOPK_BINS = 2048  # HVD_TOPK_BINS: one histogram of 11-bit digits a segment
TOPKQ_CHUNK = 1024  # primitives.abs_sum's chunk: top-k + sign's magnitude sums


def _topk_table(gs, es, ks, us, empty_rows=False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(numels, the indices of the tensors that get a row: the non-empty ones, or with
    ``empty_rows`` all, their rows for the top-k select: g, e, n, u, k and the flag offset
    filled in; column 7 the caller's), checked."""
    count = len(gs)
    _check_residuals(gs, es)
    if us is not None:
        _check_residuals(gs, us)
    ns = np.fromiter((g.numel() for g in gs), dtype=np.int64, count=count)
    kept = np.asarray(ks, dtype=np.int64).reshape(count)
    if np.any((kept < 0) | (kept > ns)):
        raise ValueError(f"top-k needs 0 <= k <= n for every tensor, got k {ks} for n {ns}")
    live = np.arange(count) if empty_rows else np.flatnonzero(ns > 0)
    table = _rows(gs, live, es)
    if us is not None:
        table[:, _TOPK_SEG_U] = [us[i].data_ptr() for i in live.tolist()]
    table[:, _TOPK_SEG_K] = kept[live]
    table[:, _TOPK_SEG_FLAGS] = np.cumsum(ns[live]) - ns[live]
    return ns, live, table


def _topk_select(k: _Launcher, elements: _Segments, total: int, momentum, states, slots=None):
    """The launch sequence of a bucket's top-k select (kernels/sparse.cu, "Top-k's bucket
    encode") over ``elements`` (``total`` elements in all), through the gather: into the
    bodies, or with ``slots`` (values, indices) into those. No read."""
    m = np.float32(momentum)
    hist = torch.zeros(elements.count * _TOPK_BINS, dtype=torch.int32, device=k.device)
    k.tiles("sparse_topk_finite_segments", elements, m, _ptr(states))
    k.tiles("sparse_topk_update_segments", elements, m, _ptr(states), _ptr(hist))
    for digit in range(3):
        if digit:
            args = (np.int32(digit), _ptr(states), _ptr(hist))
            k.tiles("sparse_topk_histogram_segments", elements, *args)
        pick = (_ptr(elements.rows), np.int64(elements.count), np.int32(digit))
        k("sparse_topk_pick_segments", elements.count, *pick, _ptr(hist), _ptr(states))
    flags = k.empty(total, torch.uint8)
    k.tiles("sparse_topk_ties_segments", elements, _ptr(states), _ptr(flags))
    ties = torch.cumsum(flags, 0, dtype=torch.int64)
    k.tiles("sparse_topk_keep_segments", elements, _ptr(states), _ptr(ties), _ptr(flags))
    incl = torch.cumsum(flags, 0, dtype=torch.int64)
    values, indices = (None, None) if slots is None else slots
    args = (np.int64(TOPK_INDEX32_LIMIT), _ptr(flags), _ptr(incl), _ptr(values), _ptr(indices))
    k.tiles("sparse_topk_gather_segments", elements, *args)


def topk_encode_segments(
    gs: list[torch.Tensor],
    es: list[torch.Tensor],
    ks: list[int],
    us: list[torch.Tensor] | None = None,
    momentum: float = 0.0,
) -> tuple[list[torch.Tensor], list[bool]]:
    """The CPU backend's ``topk_encode_segments`` (the same bodies, non-finite flags,
    residuals and, for DGC, velocities) on one CUDA device, as one launch sequence
    (kernels/sparse.cu, "Top-k's bucket encode"): every segment's finite flag; a into e
    (and u) and the first digit's histogram; three picks of the threshold's digits with the
    next digits' histograms between; the ties flagged and scanned; the kept flags and their
    scan; the values and indices into the bodies (views of one buffer) and e (u) zeroed
    there. The one read is the flags, after the last launch."""
    count = len(gs)
    if not count:
        return [], []
    device = _bucket_device(gs, "g")
    ns, live, table = _topk_table(gs, es, ks, us)
    bodies = [torch.empty(0, dtype=torch.uint8, device=device)] * count
    nonfinite = [False] * count
    if not len(live):
        return bodies, nonfinite
    lns, lks = ns[live], table[:, _TOPK_SEG_K]
    sizes = lks * np.where(lns >= TOPK_INDEX32_LIMIT, 12, 8)
    rooms = -(-sizes // 8) * 8  # every body 8-byte aligned
    firsts = np.cumsum(rooms) - rooms
    with _Launcher(device) as k:
        buf = k.empty(max(int(rooms.sum()), 8), torch.uint8)
        table[:, _TOPK_SEG_BODY] = buf.data_ptr() + firsts
        elements = _segments(table, lns, device)
        states = k.states(elements.count)
        _topk_select(k, elements, int(lns.sum()), momentum, states)
        bad = _read_state(states).reshape(elements.count, _STATE_WORDS)[:, _ST_NONFINITE] != 0
    for row, i in enumerate(live.tolist()):
        nonfinite[i] = bool(bad[row])
        if not bad[row]:
            bodies[i] = buf[int(firsts[row]) :][: int(sizes[row])]
    return bodies, nonfinite


class TopKSignSelection:
    """What the first launch sequence of a bucket's top-k + sign leaves for the second
    (``topkq_select_segments`` -> the caller's magnitudes -> ``topkq_write_segments``),
    as the CPU backend's class of that name: ``ks``, ``nonfinite`` and ``chunk_sums()``
    for the caller; on the device the kept values and indices in slots (a tensor's first
    slot a multiple of TOPKQ_CHUNK, the padding zero), the write kernel's rows, the bodies'
    buffer."""

    def __init__(self, gs, es, ks, device) -> None:
        count = len(gs)
        # every tensor gets a row: an empty one's body is m = 0 (no element tiles)
        self.ns, self.live, table = _topk_table(gs, es, ks, None, empty_rows=True)
        self.ks = np.asarray(ks, dtype=np.int64).reshape(count)
        self.nonfinite = np.zeros(count, dtype=np.int32)
        self.device = device
        lns, lks = self.ns[self.live], table[:, _TOPK_SEG_K]
        self.total = int(lns.sum())
        chunks = -(-lks // TOPKQ_CHUNK)
        self.first_chunk = np.cumsum(chunks) - chunks
        self.chunks = chunks
        slots = max(int(chunks.sum()), 1) * TOPKQ_CHUNK
        self.values = torch.zeros(slots, dtype=torch.float32, device=device)
        self.indices = torch.empty(slots, dtype=torch.int64, device=device)
        slot_at = self.values.data_ptr() + 4 * TOPKQ_CHUNK * self.first_chunk
        table[:, _TOPK_SEG_BODY] = slot_at
        self.sizes = 4 + lks * np.where(lns >= TOPK_INDEX32_LIMIT, 8, 4) + (lks + 7) // 8
        rooms = -(-self.sizes // 4) * 4  # 4-byte aligned: m and the index words
        self.firsts = np.cumsum(rooms) - rooms
        self.buf = torch.empty(max(int(rooms.sum()), 4), dtype=torch.uint8, device=device)
        writes = np.zeros_like(table)
        writes[:, _TOPKQ_SEG_A] = table[:, _SEG_AUX]
        writes[:, _TOPKQ_SEG_BODY] = self.buf.data_ptr() + self.firsts
        writes[:, _SEG_N] = lns
        writes[:, _TOPK_SEG_K] = lks
        writes[:, _TOPK_SEG_BODY] = slot_at
        (self.elements,), (self.slots,) = _stacked_tilings(
            [(table, {_SEG_TILE: lns}), (writes, {_SEG_TILE: np.maximum(lks, 1)})], device
        )
        self.states = self.sums = None

    def chunk_sums(self) -> list[list[float]]:
        """Each tensor's order-fixed chunk sums of |kept| (empty when none are kept)."""
        out = [[] for _ in self.ks]
        for row, i in enumerate(self.live.tolist()):
            first = int(self.first_chunk[row])
            out[i] = self.sums[first : first + int(self.chunks[row])].tolist()
        return out


def topkq_select_segments(gs, es, ks) -> TopKSignSelection:
    """The CPU backend's ``topkq_select_segments`` on one CUDA device: top-k's select
    sequence (kernels/sparse.cu), the kept values and indices gathered into slots, their
    chunk sums (primitives_chunk_sums over the slots), and one read of the non-finite flags
    and the sums together."""
    device = _bucket_device(gs, "g")
    sel = TopKSignSelection(gs, es, ks, device)
    if not len(sel.live):
        return sel
    count = sel.elements.count
    with _Launcher(device) as k:
        size = count * _STATE_WORDS + 2 * sel.values.numel() // TOPKQ_CHUNK
        words = torch.zeros(size, dtype=torch.int32, device=device)  # states, then sums
        states = words[: count * _STATE_WORDS]
        sums = words[count * _STATE_WORDS :].view(torch.float64)
        _topk_select(k, sel.elements, sel.total, 0.0, states, (sel.values, sel.indices))
        chunk_args = (np.int64(sel.values.numel()), np.int64(TOPKQ_CHUNK), np.int32(0))
        k("primitives_chunk_sums", sums.numel(), _ptr(sel.values), *chunk_args, _ptr(sums))
        host = _read_state(words)
    sel.states = states
    state_words = host[: count * _STATE_WORDS].reshape(count, _STATE_WORDS)
    sel.nonfinite[sel.live] = state_words[:, _ST_NONFINITE] != 0
    sel.sums = host[count * _STATE_WORDS :].view(np.float64)
    return sel


def topkq_write_segments(sel: TopKSignSelection, magnitudes: list[float]) -> list[torch.Tensor]:
    """The CPU backend's ``topkq_write_segments`` on the device: one launch writes every
    finite tensor's body (m, indices, sign bits) and subtracts what it decodes to from the
    residual; the bodies are views of one buffer (empty where non-finite)."""
    bodies = [torch.empty(0, dtype=torch.uint8, device=sel.device)] * len(sel.ks)
    if not len(sel.live):
        return bodies
    ms = np.asarray(magnitudes, dtype=np.float32).reshape(len(sel.ks))[sel.live]
    with _Launcher(sel.device) as k:
        dms = torch.from_numpy(ms).to(sel.device)
        args = (np.int64(TOPK_INDEX32_LIMIT), _ptr(sel.values), _ptr(sel.indices), _ptr(dms))
        k.tiles("sparse_topkq_write_segments", sel.slots, *args, _ptr(sel.states))
    for row, i in enumerate(sel.live.tolist()):
        if not sel.nonfinite[i]:
            bodies[i] = sel.buf[int(sel.firsts[row]) :][: int(sel.sizes[row])]
    return bodies


# ---- random-k: the mask from the uniforms, torch ops on the device ---------------------------


def topk_decode_segments(
    frame: torch.Tensor, starts: np.ndarray, ks: np.ndarray, ns: np.ndarray, outs
) -> tuple[int, int] | None:
    """The top-k decode (accumulating) of each body at ``frame[starts[p]:]`` (the caller
    checked its length: ``ks[p]`` values and indices) into ``outs[p]`` (float32 on one CUDA
    device; the frame on the host or that device): the bodies gathered into one device
    buffer, every entry checked (kernels/sparse.cu, one launch, one read), then one launch
    that adds the bodies before the first refused one. None, or (p, its error bits), the
    ones before it added and its output untouched."""
    return _kept_decode_segments(frame, starts, ks, ns, outs, signs=False)


def topkq_decode_segments(
    frame: torch.Tensor, starts: np.ndarray, ks: np.ndarray, ns: np.ndarray, outs
) -> tuple[int, int] | None:
    """``topk_decode_segments`` of top-k + sign bodies (m, the indices, the sign bits)."""
    return _kept_decode_segments(frame, starts, ks, ns, outs, signs=True)


def _kept_decode_segments(frame, starts, ks, ns, outs, signs: bool) -> tuple[int, int] | None:
    if not outs:
        return None
    device = _bucket_device(outs, "out")
    starts, ks, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, ks, ns))
    isz = np.where(ns >= TOPK_INDEX32_LIMIT, 8, 4)
    if signs:  # m, the indices, the sign bits
        sizes = 4 + ks * isz + (ks + 7) // 8
        first_index = 4
    else:  # the values, the indices
        sizes = ks * (4 + isz)
        first_index = 4 * ks
    body, at = _bodies_on(frame, starts, sizes, device)
    table = np.zeros((len(outs), _SEG_COLS), dtype=np.int64)
    table[:, _SPARSE_SEG_VALUES] = at
    table[:, _SPARSE_SEG_OUT] = [out.data_ptr() for out in outs]
    table[:, _SPARSE_SEG_N] = ns
    table[:, _SPARSE_SEG_INDICES] = at + first_index
    table[:, _SPARSE_SEG_SIGNS] = at + 4 + ks * isz
    table[:, _SPARSE_SEG_K] = ks
    table[:, _SPARSE_SEG_WIDE] = isz == 8
    units = np.maximum(ks, 1)  # a tile for every body: top-k + sign checks m even at k = 0
    seg = _segments(table, units, device)
    flag = np.int32(signs)
    with _Launcher(device) as k:
        states = k.states(seg.count)
        k.tiles("sparse_topk_check_segments", seg, flag, _ptr(states))
        errors = _read_state(states).reshape(seg.count, _STATE_WORDS)[:, _ST_ERROR]
        refused = np.flatnonzero(errors)
        good = int(refused[0]) if len(refused) else seg.count
        if good:
            k.tiles("sparse_topk_add_segments", _first_rows(seg, units, good), flag)
        del body  # stream-ordered: the launches above are queued before its reuse
    return None if not len(refused) else (good, int(errors[good]))


def _randomk_mask(key: int, n: int, threshold: int, device: torch.device) -> torch.Tensor:
    # u < T 2^-24 (exact in float32): the CPU compares the uniforms' 24-bit integers with T
    return uniform(key, n, device) < threshold * 2.0**-24


def randomk_encode_segments(
    gs: list[torch.Tensor], keys: list[int], threshold: int, es: list[torch.Tensor] | None
) -> tuple[list[torch.Tensor], list[bool]]:
    """The CPU backend's ``randomk_encode_segments`` (the same bodies, flags and residuals)
    on one CUDA device: every tensor's kept flags, one scan of the bucket's, every kept
    count and non-finite flag (kernels/quant.cu section 10), one read, then one launch
    that writes the kept values of a = g (+ e) into the bodies (views of one buffer) and,
    with the residuals ``es``, e = a with the kept entries zeroed (untouched where a is not
    finite)."""
    if not gs:
        return [], []
    device, ns, live, bodies, nonfinite = _encode_bucket(gs, es)
    if not len(live):
        return bodies, nonfinite
    lns = ns[live]
    table = _rows(gs, live, es)
    table[:, _QUANT_SEG_FLAGS] = np.cumsum(lns) - lns
    table[:, _QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    elements = _segments(table, lns, device)
    total = int(lns.sum())
    with _Launcher(device) as k:
        states = k.states(elements.count)
        flags = k.empty(total, torch.uint8)
        limit = np.float32(threshold * 2.0**-24)  # exact: T <= 2^24
        k.tiles("quant_randomk_flags_segments", elements, limit, _ptr(flags))
        incl = torch.cumsum(flags, 0, dtype=torch.int64)
        k.tiles("quant_randomk_count_segments", elements, _ptr(incl), _ptr(states))
        host = _read_state(states).reshape(elements.count, _STATE_WORDS)
        kept = host[:, _ST_COUNT : _ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        bad = host[:, _ST_NONFINITE] != 0
        sizes = np.where(bad, 0, 4 * kept)
        firsts = np.cumsum(sizes) - sizes
        buf = k.empty(max(int(sizes.sum()), 4), torch.uint8)
        at = torch.from_numpy(buf.data_ptr() + firsts).to(device)
        k.tiles(
            "quant_randomk_gather_segments",
            elements,
            _ptr(flags),
            _ptr(incl),
            _ptr(at),
            _ptr(states),
        )
    for row, i in enumerate(live.tolist()):
        nonfinite[i] = bool(bad[row])
        bodies[i] = buf[int(firsts[row]) :][: int(sizes[row])]
    return bodies, nonfinite


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
    """The CPU backend's ``randomk_decode_segments`` (accumulating; same result, same
    codes) on one CUDA device: the bodies gathered into one device buffer, every tensor's
    kept flags regenerated, one scan of the bucket's flags, every kept count and value
    checked (kernels/quant.cu section 10), one read, then one launch that adds the
    scaled values of the bodies before the first refused one. None, or (p, -1 for a value
    that is not finite, else the regenerated kept count the body does not hold)."""
    count = len(outs)
    if not count:
        return None
    device = _bucket_device(outs, "out")
    starts, lens, ns = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (starts, lens, ns))
    body, at = _bodies_on(frame, starts, lens, device)
    total = int(ns.sum())
    table = np.zeros((count, _SEG_COLS), dtype=np.int64)
    table[:, _SEG_IN] = at
    table[:, _SEG_AUX] = [out.data_ptr() for out in outs]
    table[:, _SEG_N] = ns
    table[:, _QUANT_SEG_FLAGS] = np.cumsum(ns) - ns
    table[:, _QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64).view(np.int64)
    table[:, _QUANT_SEG_BODY_LEN] = lens
    elements, values = _tilings(
        table, device, {_SEG_TILE: ns, _QUANT_SEG_VALUE_TILE: np.maximum(lens // 4, 1)}
    )
    with _Launcher(device) as k:
        states = k.states(count)
        flags = k.empty(max(total, 1), torch.uint8)
        limit = np.float32(threshold * 2.0**-24)  # exact: T <= 2^24
        k.tiles("quant_randomk_flags_segments", elements, limit, _ptr(flags))
        incl = torch.cumsum(flags[:total], 0, dtype=torch.int64) if total else flags.long()
        k.tiles("quant_randomk_check_segments", values, _ptr(incl), _ptr(states))
        host = _read_state(states).reshape(count, _STATE_WORDS)
        kept = host[:, _ST_COUNT : _ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        wrong = 4 * kept != lens
        refused = np.flatnonzero(wrong | (host[:, _ST_ERROR] != 0))
        good = int(refused[0]) if len(refused) else count
        if good:
            part = _first_rows(elements, ns, good)
            k.tiles("quant_randomk_add_segments", part, _ptr(flags), _ptr(incl), np.float32(scale))
        del body  # stream-ordered: the launches above are queued before its reuse
    if not len(refused):
        return None
    return good, int(kept[good]) if wrong[good] else -1


def randomk_encode(
    a: torch.Tensor, key: int, threshold: int, residual: torch.Tensor | None
) -> torch.Tensor:
    """The kept values of the finite flat float32 a in index order; residual <- a with
    the kept entries zeroed (when not None)."""
    mask = _randomk_mask(key, a.numel(), threshold, a.device)
    values = a[mask]
    if residual is not None:
        residual.copy_(a)
        residual[mask] = 0.0
    return values


def randomk_decode(
    body: torch.Tensor,
    key: int,
    n: int,
    threshold: int,
    scale: float,
    out: torch.Tensor,
    accumulate: bool,
) -> int | None:
    """The CPU backend's randomk_decode (same checks, same values) with torch ops."""
    mask = _randomk_mask(key, n, threshold, out.device)
    kept = int(mask.sum())
    if body.numel() != 4 * kept:
        return kept
    values = _as_body(body, out.device).clone().view(torch.float32)
    if kept and not bool(torch.isfinite(values).all()):
        raise PayloadError("body", "a random-k value is not finite")
    values = values * scale
    if accumulate:
        out[mask] += values
    else:
        out.zero_()
        out[mask] = values
    return None


# ---- NDQSG's coset and side-information decoder: torch ops on the device ---------------------


def ndqsg_coset(k: torch.Tensor, rho: int, code_offset: int) -> torch.Tensor:
    """m + code_offset as uint8, m = k - rho * rint(k / rho) (the CPU backend's table)."""
    kf = k.to(torch.float32)
    m = kf - rho * torch.round(kf / torch.full((), float(rho), device=k.device))
    return (m.to(torch.int16) + code_offset).to(torch.uint8)


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
    """The CPU backend's ndqsg_side_decode (the same float32 operations) with torch ops."""
    n = m.numel()
    nb = (n + bucket - 1) // bucket
    pad = nb * bucket - n
    u = (uniform(key, nb * bucket, y.device) - 0.5).view(nb, bucket)
    mf = torch.cat([m.to(torch.float32), m.new_zeros(pad, dtype=torch.float32)]).view(nb, -1)
    y2 = torch.cat([y.to(torch.float32), y.new_zeros(pad, dtype=torch.float32)]).view(nb, -1)
    d = deltas.to(y.device)[:, None]
    safe = torch.where(d > 0, d, torch.ones_like(d))
    r = safe * (mf - u) - y2
    j = torch.round(r / (safe * float(rho)))
    k = torch.where(d > 0, mf - float(rho) * j, torch.zeros_like(mf))
    if out is not None:
        w = (d * (k - u)).view(-1)[:n]
        if accumulate:
            out += w
        else:
            out.copy_(w)
    if k_true is None:
        return 0
    return int((k_true.to(torch.float32) != k.view(-1)[:n]).sum())


# ---- GSpar's scale rounds and draw: torch ops on the device ----------------------------------


_GSPAR_SEG_CHUNK = 4  # HVD_GSPAR_SEG_CHUNK of kernels/quant.cu: a segment's first chunk


def gspar_encode_segments(
    gs: list[torch.Tensor],
    keys: list[int],
    budgets: list[float],
    chunk: int,
    es: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor | None], list[bool]]:
    """The CPU backend's ``gspar_encode_segments`` (the same bodies, flags and residuals)
    on one CUDA device (kernels/quant.cu section 11): every tensor's non-finite flag and
    non-zero count, one read; with error feedback a = g + e formed in e; the scale
    iteration of every tensor at once, one launch and one read a round (the host sums the
    chunk sums with ``math.fsum`` as the CPU does); the draw's flags, one scan, the kept
    counts, one read; then one launch that writes the bodies (views of one buffer). None
    for a tensor whose sum of the rest comes out 0 (the caller's path, e holding a)."""
    if not gs:
        return [], []
    device, ns, live, bodies, nonfinite = _encode_bucket(gs, es)
    if not len(live):
        return bodies, nonfinite
    lns = ns[live]
    chunks = -(-lns // chunk)
    first_chunk = np.cumsum(chunks) - chunks
    nchunks = int(chunks.sum())
    table = _rows(gs, live, es)
    table[:, _QUANT_SEG_FLAGS] = np.cumsum(lns) - lns
    table[:, _GSPAR_SEG_CHUNK] = first_chunk
    table[:, _QUANT_SEG_KEY] = np.asarray(keys, dtype=np.uint64)[live].view(np.int64)
    budget = np.asarray(budgets, dtype=np.float64).reshape(len(gs))[live]
    elements = _segments(table, lns, device)
    rows, nrows = _ptr(elements.rows), np.int64(elements.count)
    with _Launcher(device) as k:
        states = k.states(elements.count)
        k.tiles("quant_gspar_prepare_segments", elements, _ptr(states))
        host = _read_state(states).reshape(elements.count, _STATE_WORDS)
        bad = host[:, _ST_NONFINITE] != 0
        nonzero = host[:, _ST_COUNT : _ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        if es is not None:
            k.tiles("quant_gspar_form_segments", elements, _ptr(states))
        scales = np.where(budget >= nonzero, np.inf, -1.0).astype(np.float32)
        scales[bad] = -1.0
        iterating = ~bad & (budget < nonzero)
        first = iterating.copy()  # the pending round is round 0 (c = 0: nothing saturated)
        left_over = np.zeros(elements.count, dtype=bool)  # the rest summed to 0: per tensor
        saturated = np.zeros(elements.count, dtype=np.int64)
        c32 = np.where(iterating, np.float32(0.0), scales).astype(np.float32)
        words = torch.empty(2 * elements.count + 2 * nchunks, dtype=torch.int32, device=device)
        for _ in range(int(nonzero.max()) + 3):  # codecs/sparse.py gspar_scale's bound
            if not iterating.any():
                break
            words.zero_()
            counts, sums = words[: 2 * elements.count], words[2 * elements.count :]
            at = torch.from_numpy(np.where(iterating, c32, np.float32(-1.0))).to(device)
            args = (rows, nrows, np.int64(nchunks), np.int64(chunk), _ptr(at))
            k("quant_gspar_round_segments", nchunks, *args, _ptr(counts), _ptr(sums))
            read = _read_state(words)
            now = read[: 2 * elements.count].view(np.int64)
            totals = read[2 * elements.count :].view(np.float64)
            for row in np.flatnonzero(iterating).tolist():
                if not first[row] and now[row] == saturated[row]:
                    iterating[row] = False  # converged: c32[row] is the scale
                    continue
                first[row] = False
                saturated[row] = now[row]
                lo = int(first_chunk[row])
                rest = math.fsum(totals[lo : lo + int(chunks[row])].tolist())
                if not rest > 0.0:
                    iterating[row], left_over[row] = False, True
                    continue
                c32[row] = np.float32((budget[row] - saturated[row]) / rest)
        else:
            raise AssertionError("the GSpar scale iteration did not converge")
        draw = np.where(bad | left_over, np.float32(-1.0), c32).astype(np.float32)
        scales_at = torch.from_numpy(draw).to(device)
        flags = k.empty(int(lns.sum()), torch.uint8)
        k.tiles("quant_gspar_flags_segments", elements, _ptr(scales_at), _ptr(flags))
        incl = torch.cumsum(flags, 0, dtype=torch.int64)
        k("quant_gspar_count_segments", elements.count, rows, nrows, _ptr(incl), _ptr(states))
        host = _read_state(states).reshape(elements.count, _STATE_WORDS)
        kept = host[:, _ST_COUNT : _ST_COUNT + 2].copy().view(np.int64).reshape(-1)
        sizes = np.where(draw >= 0, kept * np.where(lns >= TOPK_INDEX32_LIMIT, 12, 8), 0)
        rooms = -(-sizes // 8) * 8
        firsts = np.cumsum(rooms) - rooms
        buf = k.empty(max(int(rooms.sum()), 8), torch.uint8)
        at = np.where(draw >= 0, buf.data_ptr() + firsts, 0).astype(np.int64)
        body_at = torch.from_numpy(at).to(device)
        args = (np.int32(es is None), np.int64(TOPK_INDEX32_LIMIT), _ptr(scales_at))
        gather = (*args, _ptr(flags), _ptr(incl), _ptr(body_at), _ptr(states))
        k.tiles("quant_gspar_gather_segments", elements, *gather)
    for row, i in enumerate(live.tolist()):
        nonfinite[i] = bool(bad[row])
        if left_over[row]:
            bodies[i] = None
        elif not bad[row]:
            bodies[i] = buf[int(firsts[row]) :][: int(sizes[row])]
    return bodies, nonfinite


def gspar_round(a: torch.Tensor, c: float, chunk: int) -> tuple[int, torch.Tensor]:
    """The CPU backend's gspar_round: the saturated count at float32(c) and the float64
    chunk sums of the other magnitudes (chunk_sums' ordered sums)."""
    mag = a.abs()
    saturated = mag * c >= 1.0
    rest = torch.where(saturated, torch.zeros_like(mag), mag)
    return int(saturated.sum()), chunk_sums(rest, chunk, False)


def gspar_draw(
    a: torch.Tensor, c: float, key: int, scaled: bool, budget: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's gspar_draw with torch ops (p from the same float32 product; the
    budget, which sizes the CPU's output, is not needed)."""
    mag = a.abs()
    if math.isinf(c):
        p = (mag > 0).to(torch.float32)
    else:
        p = torch.clamp(mag * torch.tensor(c, dtype=torch.float32, device=a.device), max=1.0)
    keep = uniform(key, a.numel(), a.device) < p
    idx = torch.nonzero(keep).reshape(-1)
    values = a[idx] / p[idx] if scaled else a[idx]
    return values, idx


# ---- DGC's momentum correction: torch ops on the device ---------------------------------------


def dgc_update(g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float) -> bool:
    """The CPU backend's dgc_update (the same float32 operations) with torch temporaries."""
    u_new = u * momentum + g if momentum else g.clone()
    v_new = v + u_new
    if v_new.numel() and not math.isfinite(float(v_new.abs().amax())):
        return True
    u.copy_(u_new)
    v.copy_(v_new)
    return False
