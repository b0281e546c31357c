"""The CPU codec primitives (hvdcompress.codecs.primitives) against independent Python /
NumPy references: counter-based uniforms and their keys, bit packing, chunk sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.codecs import primitives as prim
from hvdcompress.wire import PayloadError


def _uniform_python(key: int, i: int) -> float:
    z = (key + (i + 1) * prim.GOLDEN) & prim.MASK64
    return (prim.mix64(z) >> 40) * 2.0**-24


@pytest.mark.parametrize("key", [0, 1, 2**64 - 1, prim.rng_key(7, 3, 1, prim.tensor_id("w"))])
def test_uniform_matches_python_and_numpy(key):
    n = 1000
    got = prim.uniform(key, n, torch.device("cpu")).numpy()
    np.testing.assert_array_equal(got, prim.uniform_numpy(key, n))
    assert [float(v) for v in got[:50]] == [_uniform_python(key, i) for i in range(50)]
    assert got.min() >= 0.0 and got.max() < 1.0
    assert abs(got.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)


@pytest.mark.parametrize("offset", [0, 1, 3, 511, 2**40 + 5])
def test_uniform_at_any_offset_and_length(offset):
    """The native generator stages 512 integers at a time and hashes four per step: every
    (offset, length) around those boundaries gives the numpy reference's numbers."""
    lib, ptr = cpu_backend.LIB, cpu_backend._ptr
    key = prim.rng_key(3, 1, 0, prim.tensor_id("u"))
    want = prim.uniform_numpy(key, 1100, offset)
    for n in (0, 1, 2, 3, 4, 5, 7, 511, 512, 513, 515, 1024, 1027, 1100):
        got = torch.full((n + 1,), -1.0)
        lib.hvdc_prim_uniform(key, offset, n, ptr(got))
        np.testing.assert_array_equal(got[:n].numpy(), want[:n])
        assert got[n] == -1.0


def test_rng_key_pins_the_format():
    # Changing these changes every stochastic payload: they are part of the wire format.
    assert prim.mix64(1) == 0x5692161D100B05E5
    assert prim.tensor_id("w") == int.from_bytes(
        __import__("hashlib").blake2b(b"w", digest_size=8).digest(), "little"
    )
    keys = {prim.rng_key(s, t, r, 5) for s in range(3) for t in range(3) for r in range(3)}
    assert len(keys) == 27


def _pack_numpy(codes: np.ndarray, bits: int) -> np.ndarray:
    stream = ((codes[:, None].astype(np.int64) >> np.arange(bits)) & 1).reshape(-1)
    stream = np.concatenate([stream, np.zeros(-len(stream) % 8, np.int64)])
    return (stream.reshape(-1, 8) << np.arange(8)).sum(1).astype(np.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [0, 1, 3, 8, 13, 16, 31, 32, 33, 1001])
def test_bitpack_matches_numpy_and_roundtrips(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 2**bits, n).astype(np.uint8)
    packed = prim.bitpack(torch.from_numpy(codes), bits)
    np.testing.assert_array_equal(packed.numpy(), _pack_numpy(codes, bits))
    np.testing.assert_array_equal(prim.bitunpack(packed, n, bits).numpy(), codes)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [16, 17, 23, 24, 25, 31, 33, 40, 4099])
def test_bitpack_ignores_the_bits_above(bits, n):
    """Codes with bits set above `bits` pack as their low bits, on every path (SSSE3 pairs
    of groups, portable groups, the tail)."""
    rng = np.random.default_rng(bits * 7 + n)
    codes = rng.integers(0, 256, n).astype(np.uint8)
    packed = prim.bitpack(torch.from_numpy(codes), bits)
    np.testing.assert_array_equal(packed.numpy(), _pack_numpy(codes & (2**bits - 1), bits))


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("portable", [0, 1])
def test_group_pack_and_unpack_paths_keep_the_bit_layout(bits, portable):
    """The group packer and unpacker under bitpack / bitunpack, both the SSSE3 path (taken
    where the CPU has it, for the pairs of groups that a 16-byte access keeps inside the
    buffer) and the portable one, give the NumPy bit layout at every group count around
    the 16-byte boundary, and write nothing past the last group."""
    lib, ptr = cpu_backend.LIB, cpu_backend._ptr
    rng = np.random.default_rng(bits)
    for groups in (*range(0, 12), 17, 100, 1001):
        codes = rng.integers(0, 2**bits, 8 * groups).astype(np.uint8)
        packed = _pack_numpy(codes, bits)
        got = torch.full((bits * groups + 16,), 0xA5, dtype=torch.uint8)
        lib.hvdc_prim_pack_groups(ptr(torch.from_numpy(codes)), groups, bits, ptr(got), portable)
        np.testing.assert_array_equal(got[: bits * groups].numpy(), packed)
        assert (got[bits * groups :] == 0xA5).all(), groups
        back = torch.full((8 * groups + 16,), 0xA5, dtype=torch.uint8)
        src = torch.from_numpy(packed.copy())
        lib.hvdc_prim_unpack_groups(ptr(src), groups, bits, ptr(back), portable)
        np.testing.assert_array_equal(back[: 8 * groups].numpy(), codes)
        assert (back[8 * groups :] == 0xA5).all(), groups


@pytest.mark.parametrize("bits", [1, 3, 5, 7])
def test_bitunpack_rejects_padding_and_length(bits):
    n = 9  # 9 * bits is not a multiple of 8 for odd bits
    packed = prim.bitpack(torch.zeros(n, dtype=torch.uint8), bits).clone()
    packed[-1] |= 0x80
    with pytest.raises(PayloadError, match="padding"):
        prim.bitunpack(packed, n, bits)
    with pytest.raises(PayloadError):
        prim.bitunpack(packed[:-1], n, bits)


@pytest.mark.parametrize("square", [False, True])
def test_chunk_sums_are_left_to_right_doubles(square):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(10007) * 10.0 ** rng.integers(-6, 6, 10007)).astype(np.float32)
    got = prim.chunk_sums(torch.from_numpy(x), 512, square).numpy()
    v = x.astype(np.float64)
    v = v * v if square else np.abs(v)
    want = [np.add.accumulate(v[i : i + 512])[-1] for i in range(0, len(v), 512)]
    np.testing.assert_array_equal(got, want)
