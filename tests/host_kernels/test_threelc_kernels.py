"""The CUDA kernels of kernels/threelc.cu, compiled for the host with g++ (kernels/cuda_host.h).

No GPU is needed: tests/host_kernels/host_threelc.cpp runs the kernel sequence of
hvdcompress/backends/cuda/ (scans done sequentially), and every result is compared byte
for byte (and residuals bit for bit) with the CPU backend and the numpy oracle in
tests/reference.py, under several launch shapes so that grid-stride loops are exercised.
tests/host_kernels/index64.cpp checks 64-bit indexing on sparse virtual buffers of more
than 2^32 elements. Last, hvdcompress/backends/cuda/ itself runs on the host kernels
(conftest.py) through the checks of tests/gpu/test_threelc_gpu.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hvdcompress
from hvdcompress import framing, wire
from hvdcompress.backends.cuda import FRAME, THREELC, _runtime
from hvdcompress.wire import PayloadError
from tests import bucket_of_one as one
from tests import reference
from tests.fuzz.harness import field_mutations, fix_checksum, mutate, mutations
from tests.gpu import test_buckets_gpu, test_threelc_gpu
from tests.gpu.conftest import Setup
from tests.host_kernels.conftest import (
    ARG_DTYPES,
    CXX,
    HOST,
    I64,
    KERNELS,
    LAUNCHES,
    U32,
    HostLibrary,
    P,
    build_host_library,
    compile_host,
    kernel_signatures,
    loaded_families,
    patch_cuda,
    ptr,
)
from tests.reference import DESIGN_VECTORS, DESIGN_X

pytestmark = pytest.mark.host_kernels

# Error bits of kernels/threelc.cu (HVD_ERR_*).
ERR_LENGTH, ERR_BYTE, ERR_PADDING, ERR_OVERFLOW, ERR_INPUT = 1, 2, 4, 8, 16
ST_SCALE, ST_NONFINITE = 1, 2

SIZES = [0, 1, 4, 5, 6, 7, 13, 69, 70, 71, 1000, 100003]
KINDS = ["dense", "sparse90", "sparse999", "zeros", "runs", "ties", "subnormal"]
SPARSITIES = [1.0, 1.5, 1.9]


try:
    from hvdcompress.backends import cpu as cpu_backend
except Exception as exc:  # noqa: BLE001 - any import failure means: compare with numpy only
    cpu_backend = None
    CPU_MISSING = f"hvdcompress.backends.cpu unavailable: {exc}"
else:
    CPU_MISSING = None


class HostKernels(HostLibrary):
    """ctypes view of libhost_threelc.so; numpy arrays in and out."""

    SIGNATURES = {
        "host_threelc_encode": (I64, [P, P, I64, ctypes.c_float, P, P]),
        "host_quantize": (None, [P, I64, ctypes.c_float, P, P]),
        "host_quartic_encode": (U32, [P, I64, P]),
        "host_zre_encode": (I64, [P, I64, P, I64, P]),
        "host_zre_decode": (U32, [P, I64, I64, P, I64, P, ctypes.c_int]),
        "host_threelc_decode": (U32, [P, I64, I64, ctypes.c_float, P, ctypes.c_int]),
        "host_quartic_decode": (U32, [P, I64, P]),
        "host_quartic_decode_scale": (U32, [P, I64, ctypes.c_float, P, ctypes.c_int]),
        "host_checksum": (U32, [P, I64, ctypes.c_ulonglong]),
    }

    def encode(self, g, e, sparsity):
        """-> (body, scale, nonfinite); e (or None) is updated in place."""
        body = np.zeros(max(1, (g.size + 4) // 5), np.uint8)
        state = np.zeros(8, np.uint32)
        n = self.lib.host_threelc_encode(ptr(g), ptr(e), g.size, sparsity, ptr(body), ptr(state))
        scale = float(state[ST_SCALE : ST_SCALE + 1].view(np.float32)[0])
        if n < 0:
            assert state[ST_NONFINITE] == 1
            return np.zeros(0, np.uint8), scale, True
        assert state[ST_NONFINITE] == 0
        return body[:n].copy(), scale, False

    def quantize(self, x, sparsity):
        q = np.zeros(x.size, np.int8)
        state = np.zeros(8, np.uint32)
        self.lib.host_quantize(ptr(x), x.size, sparsity, ptr(q), ptr(state))
        scale = state[ST_SCALE : ST_SCALE + 1].view(np.float32)[0]
        return q, scale, bool(state[ST_NONFINITE])

    def quartic_encode(self, q):
        out = np.zeros(max(1, (q.size + 4) // 5), np.uint8)
        err = self.lib.host_quartic_encode(ptr(q), q.size, ptr(out))
        return out[: (q.size + 4) // 5], err

    def zre_encode(self, buf):
        out = np.full(buf.size + 16, 0xEE, np.uint8)
        err = U32(0)
        n = self.lib.host_zre_encode(ptr(buf), buf.size, ptr(out), buf.size, ctypes.byref(err))
        assert (out[buf.size :] == 0xEE).all(), "zre scatter wrote past its output"
        return out[:n].copy(), err.value

    def zre_decode(self, body, numel=-1, cap=None, force=False):
        """-> (expanded bytes up to the total, total, error bits); guard bytes checked."""
        cap = body.size * 14 if cap is None else cap
        out = np.full(cap + 64, 0xEE, np.uint8)
        total = I64(0)
        err = self.lib.host_zre_decode(
            ptr(body), body.size, numel, ptr(out), cap, ctypes.byref(total), int(force)
        )
        assert (out[cap:] == 0xEE).all(), "zre expansion wrote past its output"
        return out[: min(total.value, cap)].copy(), total.value, err

    def decode(self, body, numel, scale, out, accumulate):
        return self.lib.host_threelc_decode(
            ptr(body), body.size, numel, scale, ptr(out), int(accumulate)
        )

    def quartic_decode(self, qb, numel):
        q = np.zeros(numel, np.int8)
        return q, self.lib.host_quartic_decode(ptr(qb), numel, ptr(q))

    def quartic_decode_scale(self, qb, numel, scale, out, accumulate):
        return self.lib.host_quartic_decode_scale(ptr(qb), numel, scale, ptr(out), int(accumulate))

    def checksum(self, buf, offset):
        return self.lib.host_checksum(ptr(buf), buf.size, offset)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    kernels = build_host_library(HostKernels, "host_threelc.cpp", THREELC.file, tmp_path_factory)
    yield kernels
    kernels.launch_shape(*LAUNCHES[0])


def make_input(n: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "sparse90":
        x[rng.random(n) < 0.9] = 0
    elif kind == "sparse999":
        x[rng.random(n) < 0.999] = 0
    elif kind == "zeros":
        x[:] = 0
    elif kind == "runs":
        # Spikes separated by zero runs of 5 * (14 k + r) elements, r in -1..2, so the
        # quartic bytes hold runs of 13, 14, 15, 27, 28, 29, ... zero groups.
        x[:] = 0
        pos, k = 0, 0
        while pos < n:
            x[pos] = 1.0 if k % 2 else -1.0
            pos += 5 * (14 * (k % 4 + 1) + (k % 4) - 1) + (k % 3)
            k += 1
    elif kind == "ties":
        # With s = 1 and max 1: a / S = +-0.5 rounds to 0 (half to even), -0.0 stays 0.
        x = rng.choice(np.float32([1.0, -1.0, 0.5, -0.5, 0.0, -0.0, 0.49999997, 0.50000006]), n)
        x = x.astype(np.float32)
    elif kind == "subnormal":
        x = (x * np.float32(1e-39)).astype(np.float32)  # subnormal M and S: no flush to zero
    return x


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, every NaN mapped to one: NaN payloads differ between hardware (a GPU
    returns the canonical 0x7fffffff, x86 0xffc00000 for Inf * 0) and carry no meaning."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32).copy()
    b[np.isnan(a)] = 0x7FC00000
    return b


def cpu_encode(g: np.ndarray, e: np.ndarray | None, sparsity: float):
    et = None if e is None else torch.from_numpy(e)
    enc = one.threelc_encode(cpu_backend, torch.from_numpy(g), et, sparsity)
    return enc.body.numpy().copy(), enc.scale, enc.nonfinite


# ---- design-doc vectors ------------------------------------------------------------------


@pytest.mark.parametrize("sparsity,scale,quartic,zre", DESIGN_VECTORS)
def test_spec_vectors(shaped, sparsity, scale, quartic, zre):
    x = np.array(DESIGN_X, np.float32)
    q, s, nonfinite = shaped.quantize(x, sparsity)
    assert not nonfinite and s == np.float32(scale)
    qb, err = shaped.quartic_encode(q)
    assert err == 0 and qb.tolist() == quartic
    body, err = shaped.zre_encode(qb)
    assert err == 0 and body.tolist() == zre
    body2, s2, nonfinite2 = shaped.encode(x.copy(), None, sparsity)
    assert body2.tolist() == zre and s2 == np.float32(scale) and not nonfinite2
    expanded, total, err = shaped.zre_decode(np.array(zre, np.uint8), 20)
    assert err == 0 and total == 4 and expanded.tolist() == quartic
    back, err = shaped.quartic_decode(np.array(quartic, np.uint8), 20)
    assert err == 0 and back.tolist() == q.tolist()


def test_spec_zre_vector(shaped):
    buf = np.array([5] + [121] * 31 + [7] + [121] * 3, np.uint8)
    body, err = shaped.zre_encode(buf)
    assert err == 0 and body.tolist() == [5, 255, 255, 244, 7, 244]
    expanded, total, err = shaped.zre_decode(body)
    assert err == 0 and total == buf.size and expanded.tolist() == buf.tolist()


# ---- encode: random inputs against the CPU backend and the oracle ------------------------


@pytest.mark.parametrize("n", SIZES)
def test_encode_matches(shaped, n):
    rng = np.random.default_rng(n)
    for kind in KINDS:
        g = make_input(n, kind, rng)
        for sparsity in SPARSITIES:
            e0 = (make_input(n, "dense", rng) * np.float32(0.01)).astype(np.float32)
            for with_e in (False, True):
                e_host = e0.copy() if with_e else None
                body, scale, nonfinite = shaped.encode(g, e_host, sparsity)
                assert not nonfinite
                want_body, want_scale, want_e = reference.encode(
                    g, e0 if with_e else np.zeros(n, np.float32), sparsity
                )
                where = f"{kind} s={sparsity} e={with_e}"
                assert np.float32(scale) == want_scale, where
                np.testing.assert_array_equal(body, want_body, err_msg=where)
                if with_e:
                    np.testing.assert_array_equal(bits(e_host), bits(want_e), err_msg=where)
                if cpu_backend is not None:
                    e_cpu = e0.copy() if with_e else None
                    cbody, cscale, cnonfinite = cpu_encode(g, e_cpu, sparsity)
                    assert (cscale, cnonfinite) == (scale, nonfinite), where
                    np.testing.assert_array_equal(body, cbody, err_msg=where)
                    if with_e:
                        np.testing.assert_array_equal(bits(e_host), bits(e_cpu), err_msg=where)


def test_quantize_building_blocks_match(shaped):
    rng = np.random.default_rng(7)
    for n in SIZES:
        for kind in ("dense", "sparse90", "ties"):
            x = make_input(n, kind, rng)
            q, s, nonfinite = shaped.quantize(x, 1.5)
            want_q, want_s = reference.quantize(x, 1.5)
            assert not nonfinite and s == want_s
            np.testing.assert_array_equal(q, want_q)
            qb, err = shaped.quartic_encode(q)
            assert err == 0
            np.testing.assert_array_equal(qb, reference.quartic(want_q))
            back, err = shaped.quartic_decode(qb, n)
            assert err == 0
            np.testing.assert_array_equal(back, q)
            if cpu_backend is not None:
                cq, cs = cpu_backend.quantize(torch.from_numpy(x), 1.5)
                np.testing.assert_array_equal(q, cq.numpy())
                assert float(cs) == float(s)
                cqb = cpu_backend.quartic_encode(torch.from_numpy(q)).numpy()
                np.testing.assert_array_equal(qb, cqb)


def test_residual_updates_over_steps(shaped):
    """Error feedback: residuals carried over five steps stay bit-identical."""
    rng = np.random.default_rng(11)
    n = 100003
    e_host = np.zeros(n, np.float32)
    e_ref = np.zeros(n, np.float32)
    e_cpu = np.zeros(n, np.float32)
    for step in range(5):
        g = make_input(n, ["dense", "sparse90", "runs", "dense", "ties"][step], rng)
        body, scale, _ = shaped.encode(g, e_host, 1.9)
        want_body, want_scale, e_ref = reference.encode(g, e_ref, 1.9)
        assert np.float32(scale) == want_scale
        np.testing.assert_array_equal(body, want_body)
        np.testing.assert_array_equal(bits(e_host), bits(e_ref))
        if cpu_backend is not None:
            cbody, cscale, _ = cpu_encode(g, e_cpu, 1.9)
            assert cscale == scale
            np.testing.assert_array_equal(body, cbody)
            np.testing.assert_array_equal(bits(e_host), bits(e_cpu))


def test_negative_zero_residual(host):
    """a = -0.0 keeps a residual of -0.0 (S * q with q an integer zero), as the CPU does."""
    g = np.array([-0.0, 1.0, -0.0, 0.25, -0.3], np.float32)
    e = np.full(5, -0.0, np.float32)  # a = g + e is -0.0 only when both are
    host.encode(g, e, 1.0)
    assert bits(e).tolist() == bits(np.float32([-0.0, 0.0, -0.0, 0.25, -0.3])).tolist()
    if cpu_backend is not None:
        e_cpu = np.full(5, -0.0, np.float32)
        cpu_encode(g, e_cpu, 1.0)
        assert bits(e).tolist() == bits(e_cpu).tolist()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "overflow"])
@pytest.mark.parametrize("n", [1, 7, 1000, 100003])
def test_nonfinite_input(shaped, bad, n):
    rng = np.random.default_rng(3)
    g = make_input(n, "dense", rng)
    if bad == "overflow":  # max|a| finite but 1.9 * max overflows float32
        g[rng.integers(n)] = np.float32(3e38)
    else:
        g[rng.integers(n)] = bad
    e = (make_input(n, "dense", rng) * np.float32(0.01)).astype(np.float32)
    e_before = e.copy()
    body, scale, nonfinite = shaped.encode(g, e, 1.9)
    assert nonfinite and body.size == 0
    np.testing.assert_array_equal(bits(e), bits(e_before))  # residual untouched
    if bad != "overflow":  # the raw S is NaN or Inf; cuda.py reports 0.0 like the CPU
        assert not np.isfinite(scale)
    q, _, nonfinite_q = shaped.quantize(g, 1.9)
    assert nonfinite_q and not q.any()
    if cpu_backend is not None:
        e_cpu = e_before.copy()
        cbody, _, cnonfinite = cpu_encode(g, e_cpu, 1.9)
        assert cnonfinite and cbody.size == 0
        np.testing.assert_array_equal(bits(e_cpu), bits(e_before))


# ---- decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_decode_matches(shaped, n):
    rng = np.random.default_rng(100 + n)
    for kind in ("dense", "sparse999", "runs", "zeros"):
        g = make_input(n, kind, rng)
        body, scale, _ = shaped.encode(g, None, 1.5)
        q, s = reference.quantize(g, 1.5)
        want = (s * q.astype(np.float32)).astype(np.float32)
        out = np.full(n, np.nan, np.float32)
        assert shaped.decode(body, n, scale, out, False) == 0
        np.testing.assert_array_equal(bits(out), bits(want))
        # Accumulate onto values that include -0.0: zero groups from runs leave them as
        # they are, zero digits of literal bytes add S * 0 = +0.0 (CPU semantics).
        base = make_input(n, "dense", rng)
        base[rng.random(n) < 0.3] = -0.0
        acc = base.copy()
        assert shaped.decode(body, n, scale, acc, True) == 0
        if cpu_backend is not None:
            cout = np.full(n, np.nan, np.float32)
            one.threelc_decode(
                cpu_backend, torch.from_numpy(body), n, scale, torch.from_numpy(cout), False
            )
            np.testing.assert_array_equal(bits(out), bits(cout))
            cacc = base.copy()
            one.threelc_decode(
                cpu_backend, torch.from_numpy(body), n, scale, torch.from_numpy(cacc), True
            )
            np.testing.assert_array_equal(bits(acc), bits(cacc), err_msg=kind)
        else:
            np.testing.assert_array_equal(acc, (base + want).astype(np.float32))


def test_decode_scale_nonfinite_and_negative_scale_like_cpu(host):
    """Odd scales (never produced by an encoder) still decode exactly like the CPU."""
    rng = np.random.default_rng(5)
    g = make_input(1000, "sparse90", rng)
    body, _, _ = host.encode(g, None, 1.0)
    for scale in (-2.0, float("inf"), float("nan"), 0.0):
        for accumulate in (False, True):
            out = np.zeros(1000, np.float32)
            out[::3] = -0.0
            ref = out.copy()
            assert host.decode(body, 1000, scale, out, accumulate) == 0
            if cpu_backend is not None:
                one.threelc_decode(
                    cpu_backend,
                    torch.from_numpy(body),
                    1000,
                    scale,
                    torch.from_numpy(ref),
                    accumulate,
                )
                np.testing.assert_array_equal(bits(out), bits(ref))


def _corruptions(body: np.ndarray, n: int):
    m = (n + 4) // 5
    yield "extra literal", np.append(body, 7)
    yield "extra run", np.append(body, 255)
    if body.size:
        yield "truncated", body[:-1]
        yield "last byte 243 more", np.append(body[:-1], np.uint8(min(255, body[-1] + 1)))
        yield "first byte a long run", np.concatenate([[255], body[1:]]).astype(np.uint8)
    yield "all runs", np.full(max(1, m // 14 + 2), 255, np.uint8)
    yield "empty", np.zeros(0, np.uint8)
    if n % 5 and body.size:
        # Same length, but the last quartic byte is 122: digits (1, 1, 1, 1, 2), so the
        # last (padding) digit is not 1.
        last = int(body[-1])
        if last < 243:
            tail = [122]
        elif last == 243:
            tail = [121, 122]
        else:
            tail = [last - 1, 122]
        yield "bad padding", np.append(body[:-1], tail).astype(np.uint8)


@pytest.mark.parametrize("n", [0, 1, 6, 13, 70, 71, 1000])
def test_corrupt_bodies_are_rejected(shaped, n):
    rng = np.random.default_rng(n)
    g = make_input(n, "sparse90", rng)
    body, scale, _ = shaped.encode(g, None, 1.0)
    for what, bad in _corruptions(body, n):
        bad = np.ascontiguousarray(bad, np.uint8)
        expanded_len = sum(b - 241 if b >= 243 else 1 for b in bad.tolist())
        valid_len = expanded_len == (n + 4) // 5
        out = np.full(n, 3.0, np.float32)
        err = shaped.decode(bad, n, scale, out, False)
        cpu_err = None
        if cpu_backend is not None:
            try:
                one.threelc_decode(
                    cpu_backend,
                    torch.from_numpy(bad),
                    n,
                    scale,
                    torch.zeros(n, dtype=torch.float32),
                    False,
                )
            except PayloadError as exc:
                cpu_err = exc
            assert (err != 0) == (cpu_err is not None), what
        if not valid_len:
            assert err & ERR_LENGTH, what
        if err:
            assert (out == 3.0).all(), f"{what}: output written despite error {err}"
        # The expansion kernel on its own, forced past a failed check, stays in bounds.
        cap = (n + 4) // 5
        _, total, zerr = shaped.zre_decode(bad, n, cap=cap, force=True)
        assert total == expanded_len
        if total > cap:
            assert zerr & ERR_OVERFLOW, what


def test_random_bodies_agree_with_cpu(host):
    """Mutated and random bodies: rejected by both backends, or decoded identically."""
    rng = np.random.default_rng(2024)
    agree = rejected = 0
    for trial in range(400):
        n = int(rng.integers(0, 400))
        g = make_input(n, ["sparse90", "runs", "dense"][trial % 3], rng)
        body, scale, _ = host.encode(g, None, 1.0)
        if trial % 4 == 0 or body.size == 0:
            body = rng.integers(0, 256, int(rng.integers(0, 30)), dtype=np.uint8)
        else:
            body = body.copy()
            body[rng.integers(body.size)] = rng.integers(0, 256)
        out = np.full(n, 9.0, np.float32)
        err = host.decode(body, n, scale, out, False)
        if err:
            rejected += 1
            assert (out == 9.0).all()
        if cpu_backend is None:
            continue
        cout = torch.full((n,), 9.0)
        try:
            one.threelc_decode(cpu_backend, torch.from_numpy(body), n, scale, cout, False)
        except PayloadError:
            assert err != 0, f"trial {trial}: CPU rejects a body the kernels accept"
            continue
        assert err == 0, f"trial {trial}: kernels reject (err {err}) a body the CPU accepts"
        np.testing.assert_array_equal(bits(out), bits(cout.numpy()))
        agree += 1
    assert rejected > 50
    assert cpu_backend is None or agree > 50


def test_quartic_decode_validation(host):
    q, err = host.quartic_decode(np.array([121, 243], np.uint8), 10)
    assert err & ERR_BYTE
    _, err = host.quartic_decode(np.array([121, 122], np.uint8), 7)  # padding digit 2
    assert err == ERR_PADDING
    _, err = host.quartic_decode(np.array([121, 120], np.uint8), 9)  # 120: last digit 0
    assert err == ERR_PADDING
    q, err = host.quartic_decode(np.array([121, 122], np.uint8), 10)  # no padding: fine
    assert err == 0 and q.tolist() == [0] * 9 + [1]
    out = np.zeros(7, np.float32)
    assert host.quartic_decode_scale(np.array([121, 122], np.uint8), 7, 1.0, out, False)
    assert host.quartic_decode_scale(np.array([250], np.uint8), 5, 1.0, out, False) & ERR_BYTE


def test_encoder_input_validation(host):
    _, err = host.quartic_encode(np.array([0, 1, -1, 2, 0], np.int8))
    assert err == ERR_INPUT
    _, err = host.zre_encode(np.array([121, 121, 250], np.uint8))
    assert err == ERR_INPUT


def test_zre_roundtrip_random(shaped):
    rng = np.random.default_rng(9)
    for m in [0, 1, 2, 13, 14, 15, 27, 28, 29, 100, 4096]:
        for p in (0.0, 0.5, 0.9, 0.99, 1.0):
            buf = rng.integers(0, 243, m).astype(np.uint8)
            buf[rng.random(m) < p] = 121
            body, err = shaped.zre_encode(buf)
            assert err == 0
            np.testing.assert_array_equal(body, reference.zre(buf))
            if cpu_backend is not None:
                cbody = cpu_backend.zero_run_encode(torch.from_numpy(buf)).numpy()
                np.testing.assert_array_equal(body, cbody)
            back, total, err = shaped.zre_decode(body)
            assert err == 0 and total == m
            np.testing.assert_array_equal(back, buf)


# ---- checksum ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 1000, 65537])
def test_checksum_matches(shaped, size):
    rng = np.random.default_rng(size)
    buf = rng.integers(0, 256, size, dtype=np.uint8)
    for offset in (0, 12, 2**32 - 5, 2**40 + 3, 2**63 - 40):
        got = shaped.checksum(buf, offset)
        assert got == wire.checksum_numpy(buf, offset)
        if cpu_backend is not None:
            # the C checksum at a payload position (kernels/frame.c; the backend's bucket
            # checksums call it at offset 0)
            assert got == cpu_backend.LIB.hvdc_checksum(buf.ctypes.data, buf.size, offset)
            if offset == 0:
                assert got == one.checksum(cpu_backend, torch.from_numpy(buf))


# ---- 64-bit indices ----------------------------------------------------------------------


def test_64bit_indices(tmp_path):
    """Kernels index in 64 bits: blocks with blockIdx.x * blockDim.x > 2^32 and a grid
    stride > 2^32, on sparse virtual buffers of 2.1e10 elements (see index64.cpp)."""
    if CXX is None:
        pytest.skip("g++ not found: the host build of kernels/threelc.cu needs a C++17 compiler")
    exe = tmp_path / "index64"
    compile_host(exe, HOST / "index64.cpp")
    try:
        res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("index64 did not finish in 120 s: a grid stride computed in 32 bits?")
    if res.returncode == 77:
        pytest.skip(f"sparse virtual mappings refused here: {res.stderr.strip()}")
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout}{res.stderr}"
    assert "all 64-bit index checks passed" in res.stdout


def test_cpu_backend_present():
    """Reports (as a skip) when comparisons ran against the numpy oracle only."""
    if CPU_MISSING:
        pytest.skip(CPU_MISSING)


# ---- the CUDA backend's Python code, on the host kernels -----------------------------------
#
# hvdcompress/backends/cuda/ runs here on CPU tensors through the stand-in for CuPy of
# conftest.py (cuda_on_host), with the checks of tests/gpu/test_threelc_gpu.py.


class Emulated(NamedTuple):
    setup: object  # tests.gpu.conftest.Setup
    calls: list  # kernel names launched, in order
    reads: list  # one entry per device-to-host read of the state


@pytest.fixture
def emulated(cuda_on_host, monkeypatch):
    if cpu_backend is None:
        pytest.skip(CPU_MISSING)
    cuda_backend = cuda_on_host.backend
    reads: list[int] = []
    read_state = _runtime._read_state

    def counted_read(state):
        reads.append(1)
        return read_state(state)

    patch_cuda(monkeypatch, "_read_state", counted_read)
    setup = Setup(cuda_backend, cpu_backend, torch.device("cpu"))
    return Emulated(setup, cuda_on_host.calls, reads)


EMULATED_SIZES = [0, 1, 4, 5, 6, 7, 13, 69, 70, 71, 1000, 100003]


def test_kernel_signatures_parse():
    sigs = kernel_signatures((KERNELS / THREELC.file).read_text())
    assert sigs["threelc_quantize_quartic"] == [
        "pointer",
        "pointer",
        "long long",
        "float",
        "pointer",
        "pointer",
        "pointer",
    ]
    assert sigs["threelc_zre_expand"][3] == "unsigned char"
    assert all(p in ARG_DTYPES for params in sigs.values() for p in params)
    assert set(THREELC.names) <= set(sigs)
    sigs = kernel_signatures((KERNELS / FRAME.file).read_text())
    assert sigs["hvd_checksum"][2] == "unsigned long long"
    assert all(p in ARG_DTYPES for params in sigs.values() for p in params)
    assert set(FRAME.names) <= set(sigs)


def test_emulated_spec_vectors(emulated):
    test_threelc_gpu.check_spec_vectors(emulated.setup)


def test_emulated_building_blocks(emulated):
    test_threelc_gpu.check_building_blocks(emulated.setup, EMULATED_SIZES)


@pytest.mark.parametrize("n", EMULATED_SIZES)
def test_emulated_encode(emulated, n):
    test_threelc_gpu.check_encode(emulated.setup, n)


def test_emulated_residual_over_steps(emulated):
    test_threelc_gpu.check_residual_over_steps(emulated.setup, 100003)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3e38])
def test_emulated_nonfinite(emulated, bad):
    test_threelc_gpu.check_nonfinite(emulated.setup, bad)


@pytest.mark.parametrize("n", EMULATED_SIZES)
def test_emulated_decode(emulated, n):
    test_threelc_gpu.check_decode(emulated.setup, n)


def test_emulated_corrupt_bodies(emulated):
    test_threelc_gpu.check_corrupt_bodies(emulated.setup)


@pytest.mark.parametrize("size", [0, 1, 31, 33, 1000, 65537])
def test_emulated_checksum(emulated, size):
    test_threelc_gpu.check_checksum(emulated.setup, size)


def test_emulated_one_device_read_per_call(emulated):
    """Each call reads the state back once, after all its kernels (decode: before it
    writes anything), and launches the kernels the design says."""
    cuda, calls, reads = emulated.setup.backend, emulated.calls, emulated.reads
    g = torch.from_numpy(make_input(100003, "sparse90", np.random.default_rng(1)))
    e = torch.zeros_like(g)
    enc = one.threelc_encode(cuda, g, e, 1.0)
    assert len(reads) == 1
    assert calls == [
        "threelc_absmax_segments",
        "threelc_quantize_quartic_segments",
        "threelc_zre_run_starts_segments",
        "threelc_zre_flags",
        "threelc_zre_scatter_segments",
    ]
    calls.clear()
    out = torch.empty_like(g)
    one.threelc_decode(cuda, enc.body, g.numel(), enc.scale, out, True)
    assert len(reads) == 2
    assert calls == [
        "threelc_zre_lengths",
        "threelc_zre_decode_check_segments",
        "threelc_zre_expand",
        "threelc_quartic_decode_add_segments",
    ]
    one.checksum(cuda, enc.body)
    assert len(reads) == 3
    with pytest.raises(PayloadError):  # one byte short: rejected by the read, no scatter
        calls.clear()
        one.threelc_decode(cuda, enc.body[:-1], g.numel(), enc.scale, out, False)
    assert len(reads) == 4 or calls == []  # the host-side length bound may answer first
    assert "threelc_quartic_decode_add_segments" not in calls
    assert loaded_families(cuda) == {THREELC.file, FRAME.file}  # the checksum: frame.cu


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 5000, 1024 * 1024 + 7, 3 * 1024 * 1024])
def test_running_max_equals_cummax(n):
    """The zero-run encoder's two-level scan (backends/cuda/ ``_running_max``, torch ops
    only, so it runs here) equals torch.cummax, over one, two and three levels, for the
    encoder's input shape: -1 everywhere except increasing run starts."""
    from hvdcompress.backends.cuda.threelc import _running_max

    gen = torch.Generator().manual_seed(n)
    starts = torch.where(torch.rand(n, generator=gen) < 0.01, torch.arange(n), -1)
    assert torch.equal(_running_max(starts), torch.cummax(starts, 0).values)
    values = torch.randint(-(2**40), 2**40, (n,), generator=gen)  # any int64 sequence
    assert torch.equal(_running_max(values), torch.cummax(values, 0).values)


# ---- a bucket as one launch sequence (kernels/threelc.cu section 7) -------------------------


@pytest.fixture(params=[64, 2048], ids=lambda t: f"tile{t}")
def bucketed(emulated, monkeypatch, request):
    """``emulated`` with segment tiles of 64 units (segments of many tiles, blocks looping
    over tiles of several segments) or the backend's default."""
    patch_cuda(monkeypatch, "SEGMENT_TILE", request.param)
    return emulated


@contextlib.contextmanager
def serving_cpu_tensors(backend):
    """Within: ``for_device`` gives the emulated CUDA backend for CPU tensors, so that the
    compressors and codecs call it."""
    from hvdcompress import backends

    saved = backends._BACKENDS.get("cpu")
    backends._BACKENDS["cpu"] = backend
    try:
        yield
    finally:
        if saved is None:
            backends._BACKENDS.pop("cpu", None)
        else:
            backends._BACKENDS["cpu"] = saved


def test_emulated_encode_segments(bucketed):
    test_threelc_gpu.check_encode_segments(bucketed.setup)


@pytest.mark.parametrize("frame_on_device", [False, True], ids=["host_frame", "device_frame"])
def test_emulated_decode_segments(bucketed, frame_on_device):
    test_threelc_gpu.check_decode_segments(bucketed.setup, frame_on_device)


def test_emulated_checksum_segments(bucketed):
    test_threelc_gpu.check_checksum_segments(bucketed.setup)


def test_emulated_bucket_frames(bucketed):
    cuda = bucketed.setup.backend
    test_buckets_gpu.check_bucket_frames(bucketed.setup, "3lc", lambda: serving_cpu_tensors(cuda))


def test_emulated_wire_bucket_frame(emulated):
    """The device frame writer (headers staged once, one cat, checksums stored by the
    backend) gives ``wire.frame`` of the assembled payloads."""
    gen = torch.Generator().manual_seed(5)
    heads, bodies, payloads = [], [], []
    for i, n in enumerate([0, 3, 700, 1, 64]):
        body = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        header = wire.Header("3lc", 0, torch.float32, (5 * n + i,), bytes(8), n)
        heads.append(header.pack())
        bodies.append(body)
        payloads.append(wire.assemble(header, body))
    emulated.calls.clear()
    with serving_cpu_tensors(emulated.setup.backend):
        frame = wire.device_frame(heads, bodies)
    assert torch.equal(frame, wire.frame(payloads))
    assert emulated.calls == ["hvd_checksum_segments", "hvd_checksum_store"]
    assert emulated.reads == []  # no host round trip


def test_emulated_bucket_launches_do_not_grow_with_tensors(emulated):
    """A bucket of 40 tensors: the launches and state reads of one tensor's call, not 40
    times them."""
    cuda, calls, reads = emulated.setup.backend, emulated.calls, emulated.reads
    gen = torch.Generator().manual_seed(6)
    gs = [make_input(int(n), "sparse90", np.random.default_rng(n)) for n in range(1, 41)]
    gs = [torch.from_numpy(g) for g in gs]
    es = [torch.zeros_like(g) for g in gs]
    bodies, scales, _ = cuda.threelc_encode_segments(gs, es, [1.0] * len(gs))
    assert calls == [
        "threelc_absmax_segments",
        "threelc_quantize_quartic_segments",
        "threelc_zre_run_starts_segments",
        "threelc_zre_flags",
        "threelc_zre_scatter_segments",
    ]
    assert len(reads) == 1
    calls.clear()
    frame = torch.cat(bodies)
    lens = np.array([b.numel() for b in bodies], np.int64)
    starts = np.cumsum(lens) - lens
    ns = np.array([g.numel() for g in gs], np.int64)
    outs = [torch.randn(g.numel(), generator=gen) for g in gs]
    assert cuda.threelc_decode_segments(frame, starts, lens, ns, np.array(scales), outs) is None
    assert calls == [
        "threelc_zre_lengths",
        "threelc_zre_decode_check_segments",
        "threelc_zre_expand",
        "threelc_quartic_decode_add_segments",
    ]
    assert len(reads) == 2


# ---- frames on the device (kernels/frame.cu) ---------------------------------


def test_emulated_frame_scan(bucketed):
    test_buckets_gpu.check_frame_scan(bucketed.setup)


def test_emulated_length_prefixes(emulated):
    test_buckets_gpu.check_length_prefixes(emulated.setup)


_FUZZ_FRAME = test_buckets_gpu.frame_scan_cases()[0][1]
_FUZZ_COUNT = test_buckets_gpu.frame_scan_cases()[0][2]


@settings(
    max_examples=max(settings.default.max_examples // 5, 20),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    deadline=None,
)
@given(
    index=st.integers(0, _FUZZ_COUNT - 1),
    ops=st.one_of(mutations, field_mutations),
    forge=st.booleans(),
    whole=st.booleans(),
)
def test_emulated_frame_scan_fuzzed(emulated, index, ops, forge, whole):
    """Mutated frames (one payload's bytes or header fields, checksum recomputed or not;
    or the frame's own bytes, its length table included): the device scan's verdict and
    fields are the CPU scan's."""
    if whole:
        buf = mutate(bytearray(_FUZZ_FRAME.numpy().tobytes()), ops)
    else:
        names = [str(i) for i in range(_FUZZ_COUNT)]
        payloads = wire.unframe(_FUZZ_FRAME, _FUZZ_COUNT, 0, names)
        one = mutate(bytearray(payloads[index].numpy().tobytes()), ops)
        one = fix_checksum(one) if forge else one
        payloads[index] = torch.frombuffer(bytearray(one) or bytearray(1), dtype=torch.uint8)
        payloads[index] = payloads[index][: len(one)]
        buf = bytearray(wire.frame(payloads).numpy().tobytes())
    frame = torch.frombuffer(bytearray(buf) or bytearray(1), dtype=torch.uint8)[: len(buf)]
    test_buckets_gpu.check_frame_scan(emulated.setup, [("fuzzed", frame, _FUZZ_COUNT)])


def test_emulated_frame_scan_is_three_launches_and_one_read(emulated):
    """A frame of 40 payloads is scanned by three launches and one read, not by a launch
    or a read per payload."""
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(n, generator=gen) for n in range(1, 41)]
    frame, _ = framing.compress_bucket(
        hvdcompress.get_compressor("3lc"), grads, [str(i) for i in range(40)]
    )
    emulated.calls.clear()
    scanned = emulated.setup.backend.frame_scan(frame, 40)
    assert bool(scanned.fields[:, wire.SCAN["ok"]].all())
    assert emulated.calls == ["hvd_frame_table", "hvd_checksum_segments", "hvd_frame_headers"]
    assert len(emulated.reads) == 1


def test_emulated_decode_frame_scans_on_the_device(emulated):
    """``decode_frame`` of a frame where the CUDA backend serves it: the scan runs on the
    device (its three kernels, no host scan), then the bucket decode; two reads in all,
    and the sums are the CPU backend's. A payload whose checksum does not hold is refused
    with the per-payload path's error and the outputs before it added."""
    from hvdcompress.backends import cpu as cpu_module

    gen = torch.Generator().manual_seed(9)
    grads = test_threelc_gpu.make_bucket(gen)
    names = [f"layer{i}" for i in range(len(grads))]
    sender, receiver = hvdcompress.get_compressor("3lc"), hvdcompress.get_compressor("3lc")
    frame, ctxs = framing.compress_bucket(sender, grads, names)
    bases = [torch.linspace(-1, 1, g.numel()) for g in grads]
    want = [b.clone() for b in bases]
    framing.decode_frame(receiver, frame, want, ctxs, rank=1)
    host_scans = []
    real_scan = cpu_module.frame_scan

    def counted_scan(*args):
        host_scans.append(1)
        return real_scan(*args)

    outs = [b.clone() for b in bases]
    emulated.calls.clear()
    with serving_cpu_tensors(emulated.setup.backend), pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_module, "frame_scan", counted_scan)
        framing.decode_frame(receiver, frame, outs, ctxs, rank=1)
    assert host_scans == []
    assert emulated.calls[:3] == ["hvd_frame_table", "hvd_checksum_segments", "hvd_frame_headers"]
    assert "threelc_quartic_decode_add_segments" in emulated.calls
    assert len(emulated.reads) == 2
    for out, ref in zip(outs, want, strict=True):
        np.testing.assert_array_equal(test_threelc_gpu.bits(out), test_threelc_gpu.bits(ref))
    bad = frame.clone()
    payloads = wire.unframe(frame, len(names), 1, names)
    at = 8 * (len(names) + 1) + sum(p.numel() for p in payloads[:5])
    bad[at + payloads[5].numel() - 1] ^= 1  # payload 5's last byte: its checksum fails
    want_outs, outs = [b.clone() for b in bases], [b.clone() for b in bases]
    with pytest.raises(PayloadError) as want_err:
        framing.decode_frame(receiver, bad, want_outs, ctxs, rank=1)
    with serving_cpu_tensors(emulated.setup.backend), pytest.raises(PayloadError) as got_err:
        framing.decode_frame(receiver, bad, outs, ctxs, rank=1)
    assert str(got_err.value) == str(want_err.value)
    assert got_err.value.tensor == "layer5"
    for out, ref in zip(outs, want_outs, strict=True):
        np.testing.assert_array_equal(test_threelc_gpu.bits(out), test_threelc_gpu.bits(ref))
