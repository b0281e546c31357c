"""The backend protocol: every operation a codec backend provides, with its signature and
contract (docs/backends.md). ``hvdcompress.backends.cpu`` (the C library through ctypes) and
``hvdcompress.backends.cuda`` (CuPy RawKernels) each implement all of it, and for identical
input they return identical bytes; ``tests/test_backend_protocol.py`` checks both, operation
by operation, from this table. One form per operation: the per-tensor API is the bucket
operation with one tensor (a bucket op takes lists, one entry per tensor).

Conventions: tensors are contiguous and on the backend's device; float32 unless named
otherwise; a bucket decoder adds into its ``outs`` and returns None, or (index, detail) of
the first body it refuses (the ones before it added, that one untouched); residuals
(``e``, ``es``) are updated only for finite input. Each backend also has what only its
device needs (CPU: ``frame_write``, ``num_threads``, ``scale_for``; CUDA: ``length_prefixes``,
``gpu_unavailable_reason``).
"""

from __future__ import annotations

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
        ...

    def bitpack(self, codes: torch.Tensor, bits: int) -> torch.Tensor:
        """Each code of ``codes`` (int64, each < 2**bits) in ``bits`` bits, LSB first, as uint8
        bytes."""
        ...

    def bitunpack(self, buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        """The first ``n`` ``bits``-bit codes of ``buf`` (``bitpack``'s inverse), int64."""
        ...

    def chunk_sums(self, x: torch.Tensor, chunk: int, square: bool) -> torch.Tensor:
        """Per chunk of ``chunk`` elements the float64 sum, strictly left to right, of |x| (or
        x*x with ``square``)."""
        ...

    def splits(self, n: int) -> bool:
        """Whether the codec threads cut a tensor of ``n`` elements into parts (the bucket ops
        then take it in parts)."""
        ...

    # ---- checksums and frames ------------------------------------------------
    def checksum_segments(
        self, buf: torch.Tensor, starts: list[int], lengths: list[int]
    ) -> list[int]:
        """The payload checksum (offset 0) of each segment ``buf[starts[i]:][:lengths[i]]``."""
        ...

    def store_checksums(
        self, buf: torch.Tensor, starts: list[int], lengths: list[int], field: int
    ) -> None:
        """Write each segment's checksum little-endian into its 4 bytes at ``field``."""
        ...

    def frame_scan(self, frame: torch.Tensor, count: int) -> FrameScan | None:
        """Every payload header of a frame of ``count`` payloads checked and read
        (``FrameScan``), or None when the length table does not describe the frame."""
        ...

    # ---- 3LC -----------------------------------------------------------------
    def quantize(self, x: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
        """3LC's three values: q = rint(x / S) in {-1, 0, 1} (int8) and S = fl32(sparsity *
        max|x|) (float32 0-dim)."""
        ...

    def quartic_encode(self, q: torch.Tensor) -> torch.Tensor:
        """Five ternary digits a byte (q + 1 in base 3), the last byte padded with zeros."""
        ...

    def quartic_decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """``numel`` int8 values of quartic bytes; PayloadError on a byte above 242 or nonzero
        padding."""
        ...

    def zero_run_encode(self, buf: torch.Tensor) -> torch.Tensor:
        """3LC's zero-run encoding of quartic bytes."""
        ...

    def zero_run_decode(self, buf: torch.Tensor, expected_len: int | None = None) -> torch.Tensor:
        """Its inverse; PayloadError (field 'body') when ``expected_len`` is given and not met,
        or on a run past the end."""
        ...

    def threelc_encode_segments(
        self, gs: list[torch.Tensor], es: list[torch.Tensor | None], sparsities: list[float]
    ) -> tuple[list[torch.Tensor], list[float], list[bool]]:
        """A bucket's 3LC encode: per tensor a = g + e, S, q, the residual e <- a - S q (e
        given, input finite), quartic + zero-run body; returns (bodies, scales,
        nonfinite). Non-finite input: empty body, e untouched."""
        ...

    def threelc_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        lens: np.ndarray,
        ns: np.ndarray,
        scales: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Add scale * q of each body into ``outs``; None, or (index, message) of the first
        body refused (those before it added, it untouched)."""
        ...

    # ---- signSGD and EF-signSGD ----------------------------------------------
    def sign_encode_segments(self, xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """signSGD: each tensor's sign bits (1 for x >= 0), or None for a non-finite tensor."""
        ...

    def sign_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ns: np.ndarray,
        scales: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Add +-scale of each body's bits into ``outs``; None, or (index, message) of the
        first refused."""
        ...

    def efsign_sums_segments(
        self, gs: list[torch.Tensor], es: list[torch.Tensor]
    ) -> tuple[list[list[float]], list[bool]]:
        """EF-signSGD's order-fixed chunk sums of |g + e| per tensor, and whether each is
        finite."""
        ...

    def efsign_encode_segments(
        self, gs: list[torch.Tensor], es: list[torch.Tensor], scales: list[float], skip: list[bool]
    ) -> list[torch.Tensor]:
        """EF-signSGD's bits of a = g + e and e <- a -+ scale, for the tensors not skipped."""
        ...

    # ---- QSGD, TernGrad, DQSG and NDQSG --------------------------------------
    def qsgd_encode_segments(
        self, xs: list[torch.Tensor], levels: int, bits: int, bucket: int, keys: list[int]
    ) -> list[torch.Tensor | None]:
        """QSGD: per bucket of ``bucket`` elements its float32 norm and ``bits``-bit stochastic
        levels (stream ``keys[i]``); None for a non-finite tensor."""
        ...

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
        """Add the decoded QSGD bodies into ``outs``; None, or (index, message) of the first
        refused."""
        ...

    def terngrad_encode_segments(
        self, xs: list[torch.Tensor], keys: list[int]
    ) -> list[tuple[torch.Tensor, float] | None]:
        """TernGrad: per tensor its quartic body of stochastic ternary values and the scale
        max|x|, or None when non-finite."""
        ...

    def dqsg_quantize(
        self, w: torch.Tensor, levels: int, bucket: int, key: int, code_offset: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """DQSG's dithered quantiser of one tensor: (codes, deltas), or None when non-finite."""
        ...

    def dqsg_dequantize(
        self,
        q: torch.Tensor,
        deltas: torch.Tensor,
        bucket: int,
        key: int,
        out: torch.Tensor,
        accumulate: bool,
    ) -> None:
        """DQSG's reconstruction of codes with their deltas, written (or added) into ``out``."""
        ...

    def dqsg_encode_segments(
        self, xs: list[torch.Tensor], keys: list[int], levels: int, bits: int, bucket: int
    ) -> list[torch.Tensor | None]:
        """A bucket's DQSG encode (s > 1): each tensor's packed body, or None when non-finite."""
        ...

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
        """Add the decoded DQSG bodies into ``outs``; None, or (index, code) of the first
        refused."""
        ...

    def digits_encode_segments(
        self, xs: list[torch.Tensor], keys: list[int], levels: int, rho: int, bits: int, bucket: int
    ) -> tuple[list[torch.Tensor | None], torch.Tensor]:
        """DQSG with s = 1 and NDQSG's nested code: digit bodies (quartic), and the fine
        indices kept for NDQSG."""
        ...

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
        """Add the decoded digit bodies into ``outs`` (NDQSG: with the coset rule and side
        information); aliasing counts, and None or the first refusal."""
        ...

    def ndqsg_coset(self, k: torch.Tensor, rho: int, code_offset: int) -> torch.Tensor:
        """NDQSG's coset index of each fine index ``k`` (modulo rho, offset by the code
        offset)."""
        ...

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
        """NDQSG's decode of coset indices with side information ``y``: the fine index nearest
        y in each coset; returns the aliasing count."""
        ...

    # ---- top-k, top-k + sign, DGC, random-k, GSpar ---------------------------
    def topk_select(self, a: torch.Tensor, k: int) -> torch.Tensor:
        """The indices of the k largest |a| (ties by lower index), sorted ascending."""
        ...

    def topk_encode_segments(
        self,
        gs: list[torch.Tensor],
        es: list[torch.Tensor],
        ks: list[int],
        us: list[torch.Tensor] | None = None,
        momentum: float = 0.0,
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """A bucket's top-k (DGC with ``us``/``momentum``): indices and values of the k largest
        |g + e| per tensor, the residuals updated; (bodies, nonfinite)."""
        ...

    def topk_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ks: np.ndarray,
        ns: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, str] | None:
        """Scatter-add each body's (index, value) pairs into ``outs``; None, or the first
        refused."""
        ...

    def topkq_select_segments(self, gs, es, ks) -> TopKSignSelection:
        """Top-k + sign's selection: each tensor's k largest |g + e| and their signs
        (``TopKSignSelection``)."""
        ...

    def topkq_write_segments(
        self, sel: TopKSignSelection, magnitudes: list[float]
    ) -> list[torch.Tensor]:
        """Top-k + sign's bodies from a selection and each tensor's magnitude, residuals
        updated."""
        ...

    def topkq_decode_segments(
        self,
        frame: torch.Tensor,
        starts: np.ndarray,
        ks: np.ndarray,
        ns: np.ndarray,
        outs: list[torch.Tensor],
    ) -> tuple[int, int] | None:
        """Add +-magnitude at each body's indices into ``outs``; None, or the first refused."""
        ...

    def dgc_update(
        self, g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float
    ) -> bool:
        """DGC's momentum correction: u <- momentum u + g, v <- v + u; False when non-finite
        (u, v untouched)."""
        ...

    def randomk_encode_segments(
        self, gs: list[torch.Tensor], keys: list[int], threshold: int, es: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Random-k: each element kept when its counter-based draw is below ``threshold``; kept
        values per tensor, residuals updated; (bodies, nonfinite)."""
        ...

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
        """Add scale * the kept values of each body at the drawn positions into ``outs``; None,
        or the first refused."""
        ...

    def gspar_round(self, a: torch.Tensor, c: float, chunk: int) -> tuple[int, torch.Tensor]:
        """GSpar's scale rounds: the number of rounds and the per-element keep probabilities of
        a."""
        ...

    def gspar_draw(
        self, a: torch.Tensor, c: float, key: int, scaled: bool, budget: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """GSpar's draw of the kept elements (stream ``key``): indices and values."""
        ...

    def gspar_encode_segments(
        self,
        gs: list[torch.Tensor],
        keys: list[int],
        budgets: list[float],
        chunk: int,
        es: list[torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor | None], list[bool]]:
        """A bucket's GSpar encode: bodies per tensor (None when non-finite) and the non-finite
        flags."""
        ...


OPERATIONS = (
    "uniform",
    "bitpack",
    "bitunpack",
    "chunk_sums",
    "splits",
    "checksum_segments",
    "store_checksums",
    "frame_scan",
    "quantize",
    "quartic_encode",
    "quartic_decode",
    "zero_run_encode",
    "zero_run_decode",
    "threelc_encode_segments",
    "threelc_decode_segments",
    "sign_encode_segments",
    "sign_decode_segments",
    "efsign_sums_segments",
    "efsign_encode_segments",
    "qsgd_encode_segments",
    "qsgd_decode_segments",
    "terngrad_encode_segments",
    "dqsg_quantize",
    "dqsg_dequantize",
    "dqsg_encode_segments",
    "dqsg_decode_segments",
    "digits_encode_segments",
    "digits_decode_segments",
    "ndqsg_coset",
    "ndqsg_side_decode",
    "topk_select",
    "topk_encode_segments",
    "topk_decode_segments",
    "topkq_select_segments",
    "topkq_write_segments",
    "topkq_decode_segments",
    "dgc_update",
    "randomk_encode_segments",
    "randomk_decode_segments",
    "gspar_round",
    "gspar_draw",
    "gspar_encode_segments",
)
