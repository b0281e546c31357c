"""NDQSG: nested dithered quantisation (Abdi & Fekri, arXiv 1904.01197; docs/codecs.md,
"NDQSG": the float32 operations, packing and receiver checks).

Fine lattice: DQSG's with s1 = ``levels`` (hvdcompress.codecs.dqsg), fine index k. The
nested code keeps only the coset of k in the coarse lattice rho Z, rho = s1 / s2:

    m = k - rho * rint(k / rho)            # {-1, 0, 1} for rho = 3 (rint: half to even)

Decoding with side information y (an estimate of w, the same on every receiver):

    r     = delta1 * (m - u) - y
    j     = rint(r / delta2)               # delta2 = rho * delta1
    k_hat = m - rho * j                    # the index of the coset closest to y
    w_hat = delta1 * (k_hat - u)

When k_hat == k (|w - y| below about (rho - 1) delta1 / 2) w_hat is bit for bit DQSG's
reconstruction; farther away it aliases to another point of k's coset. Body: the deltas
(float32 per bucket), then m: rho <= 3 quartic + zero-run coded, else bit-packed codes.
"""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.codecs import dqsg, quant, threelc
from hvdcompress.codecs import primitives as prim
from hvdcompress.errors import PayloadError


def check_levels(fine: int, coarse: int) -> int:
    """Return rho = fine / coarse, or raise naming the valid ranges."""
    for what, v in (("fine_levels", fine), ("coarse_levels", coarse)):
        if not quant.int_in(v, 1, quant.MAX_LEVELS):
            raise ValueError(f"ndqsg {what} must be an int in [1, 127], got {v!r}")
    if fine % coarse or fine // coarse < 2:
        raise ValueError(
            f"ndqsg fine_levels / coarse_levels must be an integer rho >= 2, got {fine} / {coarse}"
        )
    return int(fine) // int(coarse)


def m_half(rho: int) -> int:
    """The largest |m|: rho // 2 (m in [-(rho // 2), rho // 2])."""
    return max(1, rho // 2)


def m_bits(rho: int) -> int:
    return prim.bits_for(2 * m_half(rho) + 1)


def coset(k: torch.Tensor, rho: int, code_offset: int = 0) -> torch.Tensor:
    """m = k - rho * rint(k / rho) of the int8 k, as int8 (code_offset 0) or as the uint8
    codes m + code_offset."""
    m = for_device(k.device).ndqsg_coset(k.reshape(-1).contiguous(), rho, code_offset)
    return m.view(torch.int8) if code_offset == 0 else m


def encode_nested(w: torch.Tensor, levels: int, rho: int, bucket: int, key: int):
    """(body, k) of the finite flat float32 w: k is the fine index (int8), kept by the
    caller to measure its own aliasing."""
    k, deltas = dqsg.quantize(w, levels, bucket, key)
    if rho <= 3:
        packed = threelc.zero_run_encode(threelc.quartic_encode(coset(k, rho)))
    else:
        packed = prim.bitpack(coset(k, rho, m_half(rho)), m_bits(rho))
    return torch.cat([prim.float_bytes(deltas), packed]), k


def encode_nested_segments(
    ws: list[torch.Tensor], levels: int, rho: int, bucket: int, keys: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """``encode_nested`` of each (w, key) of a bucket (contiguous float32 on one device),
    None for a w with a NaN or an Inf: one backend call for the tensors the codec threads
    do not cut (``splits``)."""
    if not ws:
        return []
    backend = for_device(ws[0].device)

    def batched(pairs):
        xs, xkeys = [w for w, _ in pairs], [key for _, key in pairs]
        bodies, ks = backend.digits_encode_segments(xs, xkeys, levels, rho, m_bits(rho), bucket)
        ends = np.cumsum([x.numel() for x in xs]).tolist()
        return [
            None if body is None else (body, ks[end - x.numel() : end])
            for x, body, end in zip(xs, bodies, ends, strict=True)
        ]

    def single(w, key):
        return encode_nested(w, levels, rho, bucket, key) if prim.all_finite(w) else None

    return prim.batched_except_split(ws, keys, backend.splits, batched, single)


def max_numel(body_len: int, rho: int) -> int:
    if rho <= 3:
        return body_len * threelc.MAX_VALUES_PER_BYTE
    return 8 * body_len // m_bits(rho)


def decode_m(body: torch.Tensor, n: int, rho: int, bucket: int):
    """(m int8, deltas float32) from a nested body; raises PayloadError when corrupt."""
    return dqsg.read_body(body, n, bucket, rho <= 3, m_half(rho), "an NDQSG")


def side_decode_into(
    m: torch.Tensor,
    deltas: torch.Tensor,
    y: torch.Tensor,
    rho: int,
    bucket: int,
    key: int,
    out: torch.Tensor | None,
    accumulate: bool,
    k_true: torch.Tensor | None = None,
) -> int:
    """w_hat (see the module docstring) from the coset m (int8), the validated deltas and
    the side information y (flat float32, m's device), written to out or added to it (out
    None: not formed). Returns how many decoded fine indices k_hat differ from the int8
    k_true (the aliasing count; 0 without k_true)."""
    return for_device(y.device).ndqsg_side_decode(
        m.reshape(-1).contiguous(), deltas.contiguous(), y.reshape(-1).contiguous(), rho,
        bucket, key, out, accumulate,
        None if k_true is None else k_true.reshape(-1).contiguous(),
    )  # fmt: skip


def decode_segments(
    frame: torch.Tensor,
    starts: np.ndarray,
    lens: np.ndarray,
    ns: np.ndarray,
    rho: int,
    bucket: int,
    keys: list[int],
    rank: int,
    outs: list[torch.Tensor],
    k_trues: list[torch.Tensor | None],
) -> tuple[np.ndarray, tuple[int, PayloadError] | None]:
    """``decode_m`` then ``side_decode_into`` (accumulating) of each nested body
    ``frame[starts[i]:][:lens[i]]`` into ``outs[i]`` with the gather path's side
    information ``outs[i] / rank`` (rank >= 1), formed in the same pass: (the aliasing count
    of each body against ``k_trues[i]``, 0 where None; what
    ``GatherCompressor.decode_segments`` returns)."""
    backend = for_device(outs[0].device) if outs else None
    if backend is None:
        return np.zeros(0, dtype=np.int64), None
    aliased, failed = backend.digits_decode_segments(
        frame, starts, lens, ns, keys, bucket, outs, rho, m_bits(rho), rank, k_trues
    )
    if failed is None:
        return aliased, None
    i = failed[0]
    body = frame[int(starts[i]) : int(starts[i]) + int(lens[i])]
    return aliased, (i, prim.refusal(lambda: decode_m(body, int(ns[i]), rho, bucket)))
