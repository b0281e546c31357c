"""Building blocks of the baseline codecs: counter-based randomness, bit packing, sums.

Every stochastic codec (randomk, qsgd, terngrad, dqsg) draws its randomness from a
counter-based generator, so that a payload is a deterministic function of (input, seed,
step, rank, tensor) on every backend, and a receiver can regenerate the sender's random
numbers from the header alone:

    key  = rng_key(seed, step, rank, tensor_id)       # Python, below
    u_i  = (mix64(key + (i + 1) * 0x9E3779B97F4A7C15) >> 40) * 2**-24     # i = element index

``mix64`` is SplitMix64's output function, so u_i is output number i + 1 of the SplitMix64
stream seeded with ``key``, reduced to its top 24 bits: an exact float32 in [0, 1) (C in
kernels/primitives.c, CUDA in kernels/primitives.cu, NumPy in ``uniform_numpy``; all
bit-identical). ``tensor_id`` is a 64-bit hash of the tensor's name, so the same names
give the same ids on every rank.

Bit packing is LSB first: value i occupies bits [i b, i b + b) of the little-endian bit
stream, 1 <= b <= 8; padding bits are zero and decoding rejects anything else.

``chunk_sums`` are sums of |x| or x^2 over fixed chunks, accumulated in double strictly
left to right, so a norm or a mean is the same float on the CPU and the GPU (a torch
reduction's order, hence its rounding, differs between devices).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct

import numpy as np
import torch

from hvdcompress.backends import for_device
from hvdcompress.errors import PayloadError

GOLDEN = 0x9E3779B97F4A7C15
MASK64 = (1 << 64) - 1
MAX_SEED = MASK64

# seed, step, tensor id (uint64 each), rank (uint32): the header parameters that let a
# receiver regenerate the sender's random numbers.
RNG_PARAMS = struct.Struct("<QQQI")


def mix64(z: int) -> int:
    """SplitMix64's output function on a Python int (mod 2**64)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def rng_key(seed: int, step: int, rank: int, tensor_id: int) -> int:
    """The 64-bit stream key of one tensor's payload at one step from one rank."""
    h = 0
    for v in (seed, step, rank, tensor_id):
        h = mix64(((h ^ v) + GOLDEN) & MASK64)
    return h


@functools.lru_cache(maxsize=1 << 16)  # the same names every step, on both sides
def tensor_id(name: str) -> int:
    """A stable 64-bit id of a tensor name (blake2b), the same on every rank."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**64 - 1], got {seed!r}")
    return seed


def check_rank(rank: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**32:
        raise ValueError(f"rank must be an int in [0, 2**32 - 1], got {rank!r}")
    return rank


def uniform(key: int, n: int, device: torch.device) -> torch.Tensor:
    """n float32 uniforms in [0, 1) on ``device``; element i depends only on (key, i)."""
    return for_device(device).uniform(key, n, device)


def uniform_numpy(key: int, n: int, offset: int = 0) -> np.ndarray:
    """NumPy reference of ``uniform`` (elements offset .. offset + n - 1)."""
    c = np.arange(offset + 1, offset + n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(key) + c * np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)


def packed_len(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def bits_for(count: int) -> int:
    """Fewest bits that hold ``count`` distinct codes 0 .. count - 1."""
    return max(1, math.ceil(math.log2(count))) if count > 1 else 1


def bitpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits, 1 <= bits <= 8) into ceil(n bits / 8) bytes."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"bitpack takes uint8 codes, got {codes.dtype}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    return for_device(codes.device).bitpack(codes.reshape(-1).contiguous(), bits)


def bitunpack(buf: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Unpack n uint8 codes; raises PayloadError on a wrong length or set padding bits."""
    if buf.numel() != packed_len(n, bits):
        raise PayloadError(
            "body",
            f"{buf.numel()} packed bytes cannot hold {n} values of {bits} bits "
            f"(expected {packed_len(n, bits)})",
        )
    return for_device(buf.device).bitunpack(buf.reshape(-1).contiguous(), n, bits)


def chunk_sums(x: torch.Tensor, chunk: int, square: bool) -> torch.Tensor:
    """float64 sums of |x| (or x^2) over consecutive chunks, order fixed (see module doc)."""
    return for_device(x.device).chunk_sums(x, chunk, square)


def abs_sum(x: torch.Tensor, chunk: int = 1024) -> float:
    """sum |x| as a correctly rounded double of the chunk sums (device-independent)."""
    return math.fsum(chunk_sums(x, chunk, False).cpu().tolist())


def flat_f32(x: torch.Tensor) -> torch.Tensor:
    """x as a flat contiguous float32 tensor (a view when it is one already)."""
    return f32_data(x).detach().view(-1)


def batched_except_split(ws: list, keys: list, splits, batched, single) -> list:
    """``batched(rest)`` for the (w, key) pairs whose tensors w the backend does not cut into
    parts for its codec threads (``splits(w.numel())`` False) and ``single(w, key)`` for each
    of the others, results in the pairs' order: a bucket's one-call encoders leave the big
    tensors to the threaded per-tensor path."""
    items = list(zip(ws, keys, strict=True))
    large = {i for i, (w, _) in enumerate(items) if splits(w.numel())}
    if not large:
        return batched(items)
    small = [i for i in range(len(items)) if i not in large]
    results = dict(zip(small, batched([items[i] for i in small]) if small else [], strict=True))
    results.update({i: single(*items[i]) for i in large})
    return [results[i] for i in range(len(items))]


def decode_one(add, out: torch.Tensor, accumulate: bool) -> None:
    """One body through a bucket decoder (the backends decode buckets only, accumulating):
    ``add(target)`` adds the body into ``target`` as a bucket of one, returning None or
    (0, message or PayloadError). Written, not added (``accumulate`` False): added into a
    copy filled with -0.0 (-0.0 + v is v, bit for bit, for every v, +0.0 and -0.0
    included), which then replaces ``out``. The bucket decoder's failure raises as the
    PayloadError (field "body") with ``out`` untouched."""
    target = out if accumulate else torch.full_like(out, -0.0)
    failed = add(target)
    if failed is not None:
        error = failed[1]
        raise error if isinstance(error, PayloadError) else PayloadError("body", error)
    if not accumulate:
        out.copy_(target)


def one(values, dtype=np.int64) -> np.ndarray:
    """A one-entry array of the bucket decoders' tables."""
    return np.array([values], dtype=dtype)


def decode_to_wrong_length(lens: np.ndarray, need: np.ndarray, decode, length_error):
    """A bucket decoder for bodies whose length the header fixes (``need``): ``decode(upto)``
    adds the bodies before the first of a wrong length (None, or (i, PayloadError) of a
    body that does not decode), then that body's ``length_error(i)``, as the per-payload
    decoders, which check the length first, would stop there."""
    wrong = np.flatnonzero(lens != need)
    upto = int(wrong[0]) if wrong.size else len(lens)
    failed = decode(upto)
    if failed is not None:
        return failed
    return (upto, length_error(upto)) if wrong.size else None


def refusal(decode) -> PayloadError:
    """The PayloadError that the per-payload ``decode()`` raises for a body a bucket's
    native decoder refused (its message names the check): the batched decoders return an
    error code only, and this keeps one source for every message."""
    try:
        decode()
    except PayloadError as err:
        return err
    raise RuntimeError("a native bucket decoder refused a body its per-payload decoder accepts")


def f32_data(x: torch.Tensor) -> torch.Tensor:
    """x's values as a contiguous float32 tensor, for native calls that take only an
    address and a size (a bucket's segment tables): x itself when it is one already (no
    view made: a view costs microseconds, which a bucket pays per tensor), else a flat
    float32 copy."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def absmax(x: torch.Tensor) -> float:
    """max |x| exactly (0.0 when empty); NaN or Inf when x holds a NaN or an Inf. One pass
    of the 3LC library's vectorised reduction on the CPU, torch's amax on a GPU (a max is
    exact, so both give the same float)."""
    if x.numel() == 0:
        return 0.0
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous():
        from hvdcompress.backends import cpu

        bits = cpu.LIB.hvdc_threelc_absmax_bits(x.data_ptr(), None, x.numel())
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return float(x.abs().amax())


def sum_finite(g: torch.Tensor, e: torch.Tensor) -> bool:
    """Whether every float32 g + e is finite, without forming g + e (one read pass of the
    3LC library on the CPU; flat contiguous float32 tensors of one size)."""
    if g.device.type == "cpu":
        from hvdcompress.backends import cpu

        return (
            cpu.LIB.hvdc_threelc_absmax_bits(g.data_ptr(), e.data_ptr(), g.numel())
            < cpu.NONFINITE_BITS
        )
    return bool(torch.isfinite(g + e).all())


def divide(x: torch.Tensor, d: float) -> torch.Tensor:
    """x / d with each element one correctly rounded float32 division on every device.

    Why not ``x / d``: for a Python-number divisor torch's CUDA kernel computes
    ``x * (1 / d)``, two roundings, which can differ from the CPU's quotient in the last
    bit (seen on an H200: DQSG's bucket deltas, and with them whole payloads, differed from
    the CPU backend's). A 0-dim tensor on x's device is divided by for real."""
    return x / torch.full((), d, dtype=x.dtype, device=x.device)


def all_finite(x: torch.Tensor) -> bool:
    return math.isfinite(absmax(x))


def floats_from(body: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` little-endian float32 values of a uint8 body (a copy)."""
    return body[: 4 * count].clone().view(torch.float32)


def float_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.uint8)
