"""The backend protocol: every operation a codec backend provides, with its signature and
contract (docs/backends.md). ``hvdcompress.backends.cpu`` (the C library through ctypes) and
``hvdcompress.backends.cuda`` (CuPy RawKernels) each implement all of it, and for identical
input they return identical bytes; ``tests/host_kernels/test_backend_protocol.py`` checks
both, operation by operation, from ``OPERATIONS``. One form per operation: the per-tensor API
is the bucket operation with one tensor (a bucket op takes lists, one entry per tensor).
This is the one statement of each operation's contract; an implementation's docstring says
only how it does it.

Conventions: tensors are contiguous and on the backend's device; float32 unless named
otherwise; a bucket encoder's bodies are views of one new buffer; a bucket decoder adds into
its ``outs`` and returns None, or (index, detail) of the first body it refuses (the ones
before it added, that one untouched); residuals (``e``, ``es``) are updated only for finite
input. Each backend also has what only its device needs (CPU: ``frame_write``,
``num_threads``, ``scale_for``; CUDA: ``length_prefixes``, ``gpu_unavailable_reason``).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Protocol, runtime_checkable

import numpy as np
import torch  # noqa: F401 - in the signatures

from hvdcompress.backends.records import FrameScan  # noqa: F401 - in the signatures

# ruff: noqa: E501 - signatures as the backends spell them


class TopKSignSelection(Protocol):
    """What ``topkq_select_segments`` leaves for ``topkq_write_segments``, each backend's own
    class: the caller reads ``ks``, ``nonfinite`` and ``chunk_sums()`` (the order-fixed
    sums of the kept |a|, from which it forms each tensor's magnitude)."""

    ks: np.ndarray
    nonfinite: np.ndarray  # int32, nonzero: the tensor was not finite

    def chunk_sums(self) -> list[list[float]]: ...


@runtime_checkable
class Backend(Protocol):
    """What ``hvdcompress.backends.for_device`` returns (module doc)."""

    # ---- primitives ----------------------------------------------------------
    def uniform(self, key: int, n: int, device: torch.device | None = None) -> torch.Tensor:
        """``n`` float32 uniforms in [0, 1) of the counter-based stream ``key`` (element i from
        counter i), on ``device``."""

    def bitpack(self, codes: torch.Tensor, bits: int) -> torch.Tensor:
        """Each code of ``codes`` (uint8, each < 2**bits) in ``bits`` bits, LSB first, as
        ceil(n * bits / 8) bytes."""

    def bitunpack(self, buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        """The ``n`` ``bits``-bit codes of ``buf`` (``bitpack``'s inverse), uint8; PayloadError
        (field 'body') when buf is not ceil(n * bits / 8) bytes or a padding bit is set."""

    def chunk_sums(self, x: torch.Tensor, chunk: int, square: bool) -> torch.Tensor:
        """Per chunk of ``chunk`` elements the float64 sum, strictly left to right, of |x| (or
        x*x with ``square``)."""

    def nonfinite(self, x: torch.Tensor) -> bool:
        """Whether the contiguous float32, float16 or bfloat16 tensor ``x`` holds a NaN or an
        Inf: the check of a decode into a new tensor (``framing.checked_cast``),
        one read of ``x``."""

    def splits(self, n: int) -> bool:
        """Whether the codec threads cut a tensor of ``n`` elements (bucket ops take it in parts)."""

    # ---- checksums and frames ------------------------------------------------
    def checksum_segments(
        self, buf: torch.Tensor, starts: list[int], lengths: list[int]
    ) -> list[int]:
        """The payload checksum (offset 0, ``wire.checksum``) of each segment
        ``buf[starts[i]:][:lengths[i]]``."""

    def store_checksums(
        self, buf: torch.Tensor, starts: list[int], lengths: list[int], field: int
    ) -> None:
        """Write each segment's checksum (computed with its 4 bytes at ``start + field`` zero)
        little-endian into those 4 bytes: a frame's checksum fields."""

    def frame_scan(self, frame: torch.Tensor, count: int) -> FrameScan | None:
        """Every payload header of a frame of ``count`` payloads checked and read
        (``FrameScan``), or None when the length table does not describe the frame."""

    # ---- 3LC -----------------------------------------------------------------
    def quantize(self, x: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
        """3LC's three values: q = rint(x / S) in {-1, 0, 1} (int8) and S = fl32(sparsity *
        max|x|) (float32 0-dim); ValueError when x holds a NaN or an Inf or S overflows."""

    def quartic_encode(self, q: torch.Tensor) -> torch.Tensor:
        """Five ternary digits a byte (q + 1 in base 3), the last byte padded with zeros;
        ValueError for a digit outside {-1, 0, 1}."""

    def quartic_decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` int8 values of quartic bytes; PayloadError on a byte > 242 or nonzero padding."""

    def zero_run_encode(self, buf: torch.Tensor) -> torch.Tensor:
        """3LC's zero-run encoding of quartic bytes; ValueError for a byte above 242."""

    def zero_run_decode(self, buf: torch.Tensor, expected_len: int | None = None) -> torch.Tensor:
        """Its inverse; PayloadError (field 'body') when ``expected_len`` is given and not met,
        or on a run past the end."""

    def threelc_encode_segments(
        self, gs: list[torch.Tensor], es: list[torch.Tensor | None], sparsities: list[float]
    ) -> tuple[list[torch.Tensor], list[float], list[bool]]:
        """A bucket's 3LC encode: per tensor a = g + e (e None: a = g), S, q, the residual
        e <- a - S q, quartic + zero-run body; returns (bodies, scales, nonfinite).
        Non-finite input or S: empty body, scale 0, e untouched."""

    def threelc_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        lens: np.ndarray,
        ns: np.ndarray,
        scales: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Add scale * q of each body ``frame[starts[p]:][:lens[p]]`` into ``outs[p]``."""

    # ---- signSGD and EF-signSGD ----------------------------------------------
    def sign_encode_segments(self, xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """signSGD: each tensor's packed sign bits (bit 1 for x < 0), None for a non-finite one."""

    def sign_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ns: np.ndarray,
        scales: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Add bit ? -scale : scale of each body at ``frame[starts[p]:]`` (lengths checked by
        the caller) into ``outs[p]``; None, or (index, message) of the first with a padding
        bit set."""

    def efsign_sums_segments(
        self, gs: list[torch.Tensor], es: list[torch.Tensor]
    ) -> tuple[list[list[float]], list[bool]]:
        """EF-signSGD's float64 sums of |g + e| over EF_CHUNK-element chunks (each left to
        right) per tensor, and whether each g + e holds a NaN or an Inf."""

    def efsign_encode_segments(
        self, gs: list[torch.Tensor], es: list[torch.Tensor], scales: list[float], skip: list[bool]
    ) -> list[torch.Tensor]:
        """EF-signSGD's sign bits of a = g + e and e <- a - (a < 0 ? -scale : scale), for the
        tensors not skipped (skipped: empty body, e untouched)."""

    # ---- QSGD, TernGrad, DQSG and NDQSG --------------------------------------
    def qsgd_encode_segments(
        self, xs: list[torch.Tensor], levels: int, bits: int, bucket: int, keys: list[int]
    ) -> list[torch.Tensor | None]:
        """QSGD: per bucket of ``bucket`` elements its float32 norm, then the ``bits``-bit
        stochastic levels (stream ``keys[i]``); None for a non-finite tensor or a norm that
        overflows float32."""

    def qsgd_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ns: np.ndarray,
        levels: int,
        bits: int,
        bucket: int,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Add the decoded QSGD bodies at ``frame[starts[p]:]`` (lengths checked by the
        caller) into ``outs``; None, or (index, message: a bad norm, padding or code)."""

    def terngrad_encode_segments(
        self, xs: list[torch.Tensor], keys: list[int]
    ) -> list[tuple[torch.Tensor, float] | None]:
        """TernGrad: per tensor its zero-run-encoded quartic body of stochastic ternary values
        and the scale M = max|x|, or None when non-finite."""

    def dqsg_quantize(
        self, w: torch.Tensor, levels: int, bucket: int, key: int, code_offset: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """DQSG's dithered quantiser of one tensor: (q + code_offset as uint8, a float32
        delta per bucket), or None when w holds a NaN or an Inf."""

    def dqsg_dequantize(
        self,
        q: torch.Tensor,
        deltas: torch.Tensor,
        bucket: int,
        key: int,
        out: torch.Tensor,
        accumulate: bool,
    ) -> None:
        """DQSG's reconstruction out = delta * (q - dither), or out += that (q int8, deltas
        validated float32)."""

    def dqsg_encode_segments(
        self, xs: list[torch.Tensor], keys: list[int], levels: int, bits: int, bucket: int
    ) -> list[torch.Tensor | None]:
        """A bucket's DQSG encode (s = levels > 1): each tensor's body (deltas, then the
        bit-packed codes), or None when non-finite."""

    def dqsg_decode_segments(
        self,
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
        """Add the decoded DQSG bodies (s = levels > 1) into ``outs``; None, or (index, error
        code: kernels/quant.c DQSG_ERR_*) of the first refused."""

    def digits_encode_segments(
        self, xs: list[torch.Tensor], keys: list[int], levels: int, rho: int, bits: int, bucket: int
    ) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """DQSG's quantiser (s = levels), its digits coded: the fine indices k (rho 0: DQSG
        with s = 1) or their cosets (NDQSG's nested code, rho >= 2), quartic + zero-run for
        rho <= 3, else ``bits``-bit codes. Returns (the bodies, None for a non-finite x; the
        int8 k of every tensor, concatenated in order)."""

    def digits_decode_segments(
        self,
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
        """Add the decoded ``digits_encode_segments`` bodies into ``outs`` (NDQSG: with the
        side information ``outs[p] / divisor``). Returns (the aliasing count of each body
        against ``k_trues[p]``, 0 where None or not given; None, or (index, error code))."""

    def ndqsg_coset(self, k: torch.Tensor, rho: int, code_offset: int) -> torch.Tensor:
        """NDQSG's coset m + code_offset as uint8, m = k - rho * rint(k / rho), of each int8
        fine index ``k``."""

    def ndqsg_side_decode(
        self,
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
        """NDQSG's decode of the int8 cosets ``m`` with side information ``y`` (the fine index
        nearest y in each coset): out <- (or +=) w_hat (out None: not formed); returns how
        many decoded fine indices differ from the int8 ``k_true`` (None: 0)."""

    # ---- top-k, top-k + sign, DGC, random-k, GSpar ---------------------------
    def topk_select(self, a: torch.Tensor, k: int) -> torch.Tensor:
        """The int64 indices of the k largest |a| (0 < k < n, a finite; ties by lower index),
        sorted ascending."""

    def topk_encode_segments(
        self,
        gs: list[torch.Tensor],
        es: list[torch.Tensor],
        ks: list[int],
        us: list[torch.Tensor] | None = None,
        momentum: float = 0.0,
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """A bucket's top-k with error feedback: bodies of the k largest |g + e| (k values, then
        their ascending indices, int32 below 2**31 elements), e <- g + e with the kept values
        zeroed; (bodies, nonfinite), e untouched where non-finite.
        DGC (``us``): u <- momentum u + g, e <- e + u, the top-k of e, u and e zeroed there."""

    def topk_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ks: np.ndarray,
        ns: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Scatter-add each body's (index, value) pairs (lengths checked by the caller)."""

    def topkq_select_segments(self, gs, es, ks) -> TopKSignSelection:
        """Top-k + sign's selection: each tensor's k largest |g + e| and their signs
        (``TopKSignSelection``)."""

    def topkq_write_segments(
        self, sel: TopKSignSelection, magnitudes: list[float]
    ) -> list[torch.Tensor]:
        """Top-k + sign's bodies (m, indices, sign bits) from a selection and each tensor's
        magnitude, each residual less what its body decodes to; empty where non-finite."""

    def topkq_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ks: np.ndarray,
        ns: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, int] | None:
        """Add +-magnitude at each body's indices into ``outs``; None, or (index, error code)
        of the first refused: -1 / -2 the indices, -4 the magnitude, -5 a sign padding bit."""

    def dgc_update(
        self, g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float
    ) -> bool:
        """DGC's momentum correction in place: u <- momentum u + g (u <- g at momentum 0),
        v <- v + u; True, u and v untouched, when the new v would hold a NaN or an Inf."""

    def randomk_encode_segments(
        self, gs: list[torch.Tensor], keys: list[int], threshold: int, es: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Random-k: element i kept iff its 24-bit hash is below ``threshold``; each body the
        kept values in index order; with ``es`` a = g + e formed in e and e = a with the kept
        entries zeroed (untouched where not finite); (bodies, nonfinite)."""

    def randomk_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        lens: np.ndarray,
        ns: np.ndarray,
        keys: list[int],
        threshold: int,
        scale: float,
        outs: list[torch.Tensor],
    ) -> tuple[int, int] | None:
        """Add scale * the kept values of each body at the regenerated positions into ``outs``;
        None, or (index, code: -1 a value not finite, else the regenerated kept count)."""

    def gspar_round(self, a: torch.Tensor, c: float, chunk: int) -> tuple[int, torch.Tensor]:
        """One round of GSpar's scale: how many |a_i| * float32(c) >= 1, and the float64 sums
        of the other |a_i| per chunk."""

    def gspar_draw(
        self, a: torch.Tensor, c: float, key: int, scaled: bool, budget: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GSpar's draw at scale float32(c) (c = inf: every non-zero entry; stream ``key``):
        (kept values, 1/p-scaled with ``scaled``; ascending int64 indices). ``budget``, sum
        p_i, is the mean kept count."""

    def gspar_encode_segments(
        self,
        gs: list[torch.Tensor],
        keys: list[int],
        budgets: list[float],
        chunk: int,
        es: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[bool]]:
        """A bucket's GSpar encode: bodies in top-k's layout (scaled values; with ``es`` a =
        g + e formed in e, unscaled values, e = a with the kept entries zeroed) and the
        non-finite flags. None: a tensor the caller encodes alone, its e then holding a."""


# The operations, in the order above.
OPERATIONS = tuple(
    name for name, value in vars(Backend).items() if not name.startswith("_") and callable(value)
)


def bind_operations(namespace: dict) -> None:
    """Bind each of ``OPERATIONS`` in a backend package's ``namespace`` (its ``globals()``)
    from the one of the package's modules that defines it; an operation defined in none or
    in two fails the package's import."""
    package = namespace["__name__"]
    modules = [
        importlib.import_module(f"{package}.{info.name}")
        for info in pkgutil.iter_modules(namespace["__path__"])
    ]
    for name in OPERATIONS:
        owners = [m for m in modules if getattr(vars(m).get(name), "__module__", "") == m.__name__]
        if len(owners) != 1:
            raise ImportError(f"{name} is defined in {len(owners)} of {package}'s modules")
        namespace[name] = vars(owners[0])[name]
