"""The CUDA backend (CuPy kernels of kernels/threelc.cu) on a real GPU, byte for byte
against the CPU backend. Every test marked ``gpu`` takes the ``gpu`` fixture of
conftest.py, which skips it, with the reason from
``hvdcompress.backends.cuda.gpu_unavailable_reason()``, where the kernels cannot run
(no CuPy, no CUDA device, no driver, NVRTC missing).

The ``check_*`` functions take a ``Setup`` (backend under test, CPU backend, device) so
that tests/host_kernels/test_threelc_kernels.py runs the same checks on the CUDA backend's
Python code with the kernels compiled for the host. scripts/gpu_check.sh runs this folder
on a GPU machine: ``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hvdcompress.backends import cuda as cuda_backend
from hvdcompress.wire import PayloadError
from tests import bucket_of_one as one
from tests.gpu.conftest import Setup, bits, check_kernel_source_found, check_nvrtc_compiles
from tests.reference import DESIGN_VECTORS, DESIGN_X

SIZES = [0, 1, 4, 5, 6, 7, 13, 69, 70, 71, 1000, 100003, 1 << 22 | 3]
KINDS = ["dense", "sparse90", "sparse999", "zeros", "runs", "ties", "subnormal"]
SPARSITIES = [1.0, 1.5, 1.9]


def make_input(n: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """CPU float32 test input of one of KINDS."""
    x = torch.randn(n, generator=gen)
    if kind == "sparse90":
        x[torch.rand(n, generator=gen) < 0.9] = 0
    elif kind == "sparse999":
        x[torch.rand(n, generator=gen) < 0.999] = 0
    elif kind == "zeros":
        x.zero_()
    elif kind == "runs":
        # Spikes between zero runs of 5 * (14 k + r) elements: runs of 13, 14, 15, 27,
        # 28, 29, ... zero groups.
        x.zero_()
        pos, k = 0, 0
        while pos < n:
            x[pos] = 1.0 if k % 2 else -1.0
            pos += 5 * (14 * (k % 4 + 1) + (k % 4) - 1) + (k % 3)
            k += 1
    elif kind == "ties":  # a / S = +-0.5 rounds to even (0); -0.0
        vals = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, -0.0, 0.49999997, 0.50000006])
        x = vals[torch.randint(0, len(vals), (n,), generator=gen)]
    elif kind == "subnormal":  # subnormal max and scale: no flush to zero anywhere
        x = x * 1e-39
    return x.contiguous()


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    np.testing.assert_array_equal(a.cpu().numpy(), b.cpu().numpy(), err_msg=what)


def _u8(values, dev) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=dev)


# ---- checks shared with the host emulation -------------------------------------------------


def check_spec_vectors(s: Setup) -> None:
    x = torch.tensor(DESIGN_X, device=s.dev)
    for sparsity, scale, quartic, zre in DESIGN_VECTORS:
        q, sc = s.backend.quantize(x, sparsity)
        assert sc.device == x.device and sc.dim() == 0 and sc.item() == np.float32(scale)
        qb = s.backend.quartic_encode(q)
        assert qb.tolist() == quartic
        assert s.backend.zero_run_encode(qb).tolist() == zre
        enc = one.threelc_encode(s.backend, x, None, sparsity)
        assert enc.body.tolist() == zre and enc.scale == np.float32(scale)
        assert not enc.nonfinite
        back = s.backend.zero_run_decode(_u8(zre, s.dev), 4)
        assert back.tolist() == quartic
        assert s.backend.quartic_decode(back, 20).tolist() == q.tolist()
    buf = _u8([5] + [121] * 31 + [7] + [121] * 3, s.dev)
    body = s.backend.zero_run_encode(buf)
    assert body.tolist() == [5, 255, 255, 244, 7, 244]
    assert s.backend.zero_run_decode(body).tolist() == buf.tolist()


def check_building_blocks(s: Setup, sizes=SIZES) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in sizes:
        for kind in ("dense", "sparse999", "ties"):
            x = make_input(n, kind, gen)
            q, sc = s.backend.quantize(x.to(s.dev, copy=True), 1.5)
            cq, cs = s.cpu.quantize(x, 1.5)
            assert_same_bytes(q, cq, f"quantize {n} {kind}")
            assert float(sc) == float(cs)
            qb = s.backend.quartic_encode(q)
            assert_same_bytes(qb, s.cpu.quartic_encode(cq))
            body = s.backend.zero_run_encode(qb)
            assert_same_bytes(body, s.cpu.zero_run_encode(qb.cpu()))
            assert_same_bytes(s.backend.zero_run_decode(body, qb.numel()), qb)
            assert_same_bytes(s.backend.quartic_decode(qb, n), q)
    with pytest.raises(ValueError):
        s.backend.quartic_encode(torch.tensor([0, 2, 0], dtype=torch.int8, device=s.dev))
    with pytest.raises(ValueError):
        s.backend.zero_run_encode(_u8([121, 250], s.dev))
    with pytest.raises(PayloadError):
        s.backend.quartic_decode(_u8([121, 250], s.dev), 10)
    with pytest.raises(PayloadError):
        s.backend.quartic_decode(_u8([121, 122], s.dev), 7)
    with pytest.raises(PayloadError):
        s.backend.zero_run_decode(_u8([255], s.dev), 13)
    with pytest.raises(ValueError):
        s.backend.quantize(torch.tensor([1.0, float("nan")], device=s.dev), 1.0)


def check_encode(s: Setup, n: int, kinds=KINDS, sparsities=SPARSITIES) -> None:
    gen = torch.Generator().manual_seed(n)
    for kind in kinds:
        g = make_input(n, kind, gen)
        for sparsity in sparsities:
            e0 = make_input(n, "dense", gen) * 0.01
            for with_e in (False, True):
                where = f"n={n} {kind} s={sparsity} e={with_e}"
                e_dev = e0.to(s.dev, copy=True) if with_e else None
                e_cpu = e0.clone() if with_e else None
                enc = one.threelc_encode(s.backend, g.to(s.dev, copy=True), e_dev, sparsity)
                ref = one.threelc_encode(s.cpu, g, e_cpu, sparsity)
                assert (enc.scale, enc.nonfinite) == (ref.scale, ref.nonfinite), where
                assert enc.body.device == s.dev and enc.body.dtype == torch.uint8
                assert_same_bytes(enc.body, ref.body, where)
                if with_e:
                    np.testing.assert_array_equal(bits(e_dev), bits(e_cpu), err_msg=where)


def check_residual_over_steps(s: Setup, n: int = 1 << 20 | 7) -> None:
    gen = torch.Generator().manual_seed(5)
    e_dev = torch.zeros(n, device=s.dev)
    e_cpu = torch.zeros(n)
    for step, kind in enumerate(["dense", "sparse90", "runs", "dense", "ties", "dense"]):
        g = make_input(n, kind, gen)
        enc = one.threelc_encode(s.backend, g.to(s.dev, copy=True), e_dev, 1.9)
        ref = one.threelc_encode(s.cpu, g, e_cpu, 1.9)
        assert enc.scale == ref.scale, step
        assert_same_bytes(enc.body, ref.body, f"step {step}")
        np.testing.assert_array_equal(bits(e_dev), bits(e_cpu), err_msg=f"step {step}")


def check_nonfinite(s: Setup, bad: float, n: int = 100003) -> None:
    gen = torch.Generator().manual_seed(2)
    g = make_input(n, "dense", gen)
    g[n * 7 // 9] = bad  # 3e38: finite, but 1.9 * max overflows float32
    e0 = make_input(n, "dense", gen) * 0.01
    e_dev = e0.to(s.dev, copy=True)
    enc = one.threelc_encode(s.backend, g.to(s.dev, copy=True), e_dev, 1.9)
    ref = one.threelc_encode(s.cpu, g, e0.clone(), 1.9)
    assert enc.nonfinite and ref.nonfinite
    assert enc.body.numel() == 0 and enc.scale == ref.scale == 0.0
    np.testing.assert_array_equal(bits(e_dev), bits(e0))  # residual untouched


def check_decode(s: Setup, n: int) -> None:
    gen = torch.Generator().manual_seed(100 + n)
    for kind in ("dense", "sparse999", "runs", "zeros"):
        g = make_input(n, kind, gen)
        ref = one.threelc_encode(s.cpu, g, None, 1.5)
        body = ref.body.to(s.dev, copy=True)
        out = torch.full((n,), float("nan"), device=s.dev)
        one.threelc_decode(s.backend, body, n, ref.scale, out, False)
        cout = torch.full((n,), float("nan"))
        one.threelc_decode(s.cpu, ref.body, n, ref.scale, cout, False)
        np.testing.assert_array_equal(bits(out), bits(cout), err_msg=kind)
        # Accumulate onto values that include -0.0: zero groups from run codes leave out
        # as it is, every other digit adds S * q (+0.0 for q = 0), as on the CPU.
        base = make_input(n, "dense", gen)
        base[torch.rand(n, generator=gen) < 0.3] = -0.0
        acc = base.to(s.dev, copy=True)
        one.threelc_decode(s.backend, body, n, ref.scale, acc, True)
        cacc = base.clone()
        one.threelc_decode(s.cpu, ref.body, n, ref.scale, cacc, True)
        np.testing.assert_array_equal(bits(acc), bits(cacc), err_msg=f"{kind} accumulate")


def check_corrupt_bodies(s: Setup, trials: int = 300) -> None:
    """Mutated and random bodies: both backends reject them (PayloadError on "body", out
    untouched) or both decode them to the same values."""
    gen = torch.Generator().manual_seed(9)
    rng = np.random.default_rng(9)
    agree = rejected = 0
    for trial in range(trials):
        n = int(rng.integers(0, 500))
        g = make_input(n, ["sparse90", "runs", "dense"][trial % 3], gen)
        ref = one.threelc_encode(s.cpu, g, None, 1.0)
        body = ref.body.numpy().copy()
        if trial % 4 == 0 or body.size == 0:
            body = rng.integers(0, 256, int(rng.integers(0, 30)), dtype=np.uint8)
        else:
            body[rng.integers(body.size)] = rng.integers(0, 256)
        body_t = torch.from_numpy(body)
        out = torch.full((n,), 9.0, device=s.dev)
        dev_err = cpu_err = None
        try:
            one.threelc_decode(s.backend, body_t.to(s.dev, copy=True), n, ref.scale, out, False)
        except PayloadError as exc:
            dev_err = exc
            rejected += 1
            assert exc.field == "body"
            assert bool((out == 9.0).all()), f"trial {trial}: out written before raising"
        cout = torch.full((n,), 9.0)
        try:
            one.threelc_decode(s.cpu, body_t, n, ref.scale, cout, False)
        except PayloadError as exc:
            cpu_err = exc
        assert (dev_err is None) == (cpu_err is None), f"trial {trial}: {dev_err} / {cpu_err}"
        if dev_err is None:
            np.testing.assert_array_equal(bits(out), bits(cout))
            agree += 1
    assert agree > trials // 10 and rejected > trials // 10


def check_checksum(s: Setup, size: int) -> None:
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator())
    on_device = buf.to(s.dev, copy=True)
    for start in sorted({0, min(1, size), min(12, size), size // 2, size}):
        # the checksum of the segment [start, size), each position from its start
        got = s.backend.checksum_segments(on_device, [start], [size - start])
        assert got == s.cpu.checksum_segments(buf, [start], [size - start])


# A bucket: empty tensors, every input kind, sizes around a group and a run, a non-finite
# tensor, tensors of zeros side by side (their runs must stop at each tensor's end).
BUCKET_SIZES = [0, 1, 4, 5, 6, 7, 13, 69, 70, 71, 0, 1000, 7001, 100003]


def make_bucket(gen: torch.Generator, sizes=BUCKET_SIZES) -> list[torch.Tensor]:
    bucket = [make_input(n, KINDS[i % len(KINDS)], gen) for i, n in enumerate(sizes)]
    bucket += [torch.zeros(71), torch.zeros(1403), make_input(333, "runs", gen)]
    bucket[3][2] = float("nan")
    return bucket


def gapped_frame(
    bodies: list[torch.Tensor], seed: int, most: int
) -> tuple[torch.Tensor, np.ndarray]:
    """The host bodies one after another in one uint8 tensor, each after 0 .. most - 1
    random bytes (a frame's headers stand there); returns it and where each body starts."""
    rng = np.random.default_rng(seed)
    pieces, starts, at = [], [], 0
    for body in bodies:
        gap = rng.integers(0, 256, int(rng.integers(0, most)), dtype=np.uint8)
        pieces += [gap, body.numpy()]
        starts.append(at + gap.size)
        at += gap.size + body.numel()
    return torch.from_numpy(np.concatenate(pieces)), np.array(starts, np.int64)


def check_encode_segments(s: Setup, sizes=BUCKET_SIZES, steps: int = 3) -> list[torch.Tensor]:
    """A bucket's one launch sequence (``threelc_encode_segments``) gives the CPU backend's
    bodies, scales, flags and residuals, step after step (error feedback built up).
    Returns the last step's CPU bodies."""
    gen = torch.Generator().manual_seed(21)
    grads = make_bucket(gen, sizes)
    sparsities = [SPARSITIES[i % len(SPARSITIES)] for i in range(len(grads))]
    es_cpu = [make_input(g.numel(), "dense", gen) * 0.01 for g in grads]
    es_dev = [e.to(s.dev, copy=True) for e in es_cpu]
    flagged = []
    for step in range(steps):
        gs = grads if step == 0 else [make_input(g.numel(), "sparse90", gen) for g in grads]
        if step == 1:
            gs[5][0] = float("inf")
        ref = s.cpu.threelc_encode_segments(gs, es_cpu, sparsities)
        got = s.backend.threelc_encode_segments(
            [g.to(s.dev, copy=True) for g in gs], es_dev, sparsities
        )
        assert got[1] == ref[1] and got[2] == ref[2], f"step {step}: scales or flags"
        flagged.append(sum(ref[2]))
        for i, (body, want) in enumerate(zip(got[0], ref[0], strict=True)):
            assert body.device == s.dev or body.numel() == 0
            assert_same_bytes(body, want, f"step {step} tensor {i}")
        for i, (e, want) in enumerate(zip(es_dev, es_cpu, strict=True)):
            np.testing.assert_array_equal(bits(e), bits(want), f"step {step} residual {i}")
    assert flagged[:2] == [1, 1], flagged  # the NaN of step 0, the Inf of step 1
    return ref[0]


def check_decode_segments(s: Setup, frame_on_device: bool) -> None:
    """A bucket's bodies at gaps in one frame, added into outputs by one launch sequence
    (``threelc_decode_segments``), equal the CPU backend's sums; a refused body stops at
    its index with ``threelc_decode``'s message, the ones before it added, it and the ones
    after it untouched."""
    gen = torch.Generator().manual_seed(22)
    grads = make_bucket(gen)
    encoded = [one.threelc_encode(s.cpu, g, None, 1.5) for g in grads]
    keep = [i for i, enc in enumerate(encoded) if not enc.nonfinite]
    frame, starts = gapped_frame([encoded[i].body for i in keep], 22, 40)
    lens = np.array([encoded[i].body.numel() for i in keep], np.int64)
    ns = np.array([grads[i].numel() for i in keep], np.int64)
    scales = np.array([encoded[i].scale for i in keep], np.float32)
    bases = [make_input(int(n), "dense", gen) for n in ns]

    def run(frame, lens):
        outs = [b.to(s.dev, copy=True) for b in bases]
        src = frame.to(s.dev, copy=True) if frame_on_device else frame
        failed = s.backend.threelc_decode_segments(src, starts, lens, ns, scales, outs)
        couts = [b.clone() for b in bases]
        cfailed = s.cpu.threelc_decode_segments(frame, starts, lens, ns, scales, couts)
        assert (failed is None) == (cfailed is None), (failed, cfailed)
        if failed is not None:
            assert failed[0] == cfailed[0], (failed, cfailed)
        for p, (out, cout) in enumerate(zip(outs, couts, strict=True)):
            np.testing.assert_array_equal(bits(out), bits(cout), f"output {p}")
        return failed

    assert run(frame, lens) is None
    big = int(np.argmax(ns))
    seven = int(np.flatnonzero(ns == 7)[0])
    literal = int(np.flatnonzero(encoded[keep[big]].body.numpy() <= 242)[0])
    for what, target in (("short", big), ("run", big), ("padding", seven), ("bound", big)):
        bad_frame, bad_lens = frame.clone(), lens.copy()
        where = int(starts[target])
        if what == "short":  # one quartic byte too few: the device check refuses it
            bad_lens[target] -= 1
        elif what == "run":  # a literal byte made a run of 14: 13 quartic bytes too many
            bad_frame[where + literal] = 255
        elif what == "padding":  # 7 values: the last byte's padding digits must be 1
            bad_frame[where + lens[target] - 1] = 0
        else:  # more quartic bytes than a body of this length can hold: the host bound
            bad_lens[target] = 1
        failed = run(bad_frame, bad_lens)
        assert failed is not None and failed[0] == target, (what, failed)
        body = bad_frame[where:][: int(bad_lens[target])]
        out = torch.zeros(int(ns[target]), device=s.dev)
        with pytest.raises(PayloadError) as exc:  # the per-payload decoder's message
            one.threelc_decode(
                s.backend, body.to(s.dev, copy=True), int(ns[target]), 1.0, out, True
            )
        assert failed[1] == exc.value.detail, what


def check_checksum_segments(s: Setup) -> None:
    """One launch for a frame's checksums (``checksum_segments``) and the checksum fields
    written in place (``store_checksums``) equal the CPU backend's."""
    gen = torch.Generator().manual_seed(23)
    buf = torch.randint(0, 256, (70001,), dtype=torch.uint8, generator=gen)
    starts = [0, 5, 5, 100, 4096, 20000, 69000]
    lengths = [5, 0, 95, 3996, 15904, 49000, 1001]
    want = s.cpu.checksum_segments(buf, starts, lengths)
    assert s.backend.checksum_segments(buf.to(s.dev, copy=True), starts, lengths) == want
    field = 12
    dev = buf.to(s.dev, copy=True)
    ref = buf.clone()
    fields = (np.array(starts)[:, None] + field + np.arange(4)).reshape(-1)
    dev[torch.from_numpy(fields).to(s.dev)] = 0
    ref[torch.from_numpy(fields)] = 0
    s.backend.store_checksums(dev, starts[2:], lengths[2:], field)
    s.cpu.store_checksums(ref, starts[2:], lengths[2:], field)
    assert_same_bytes(dev, ref)
    assert s.cpu.checksum_segments(ref, starts[2:], lengths[2:]) != [0] * 5


# ---- on the GPU ----------------------------------------------------------------------------


@pytest.mark.gpu
def test_spec_vectors(gpu):
    check_spec_vectors(gpu)


@pytest.mark.gpu
def test_building_blocks_match_cpu(gpu):
    check_building_blocks(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_encode_matches_cpu(gpu, n):
    check_encode(gpu, n)


@pytest.mark.gpu
def test_residual_over_steps_matches_cpu(gpu):
    check_residual_over_steps(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), 3e38])
def test_nonfinite_matches_cpu(gpu, bad):
    check_nonfinite(gpu, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES)
def test_decode_matches_cpu(gpu, n):
    check_decode(gpu, n)


@pytest.mark.gpu
def test_corrupt_bodies_raise_and_leave_out_untouched(gpu):
    check_corrupt_bodies(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("size", [0, 1, 31, 33, 1000, 65537, 1 << 24 | 5])
def test_checksum_matches_cpu(gpu, size):
    check_checksum(gpu, size)


@pytest.mark.gpu
def test_encode_segments_match_cpu(gpu):
    check_encode_segments(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("frame_on_device", [False, True], ids=["host_frame", "device_frame"])
def test_decode_segments_match_cpu(gpu, frame_on_device):
    check_decode_segments(gpu, frame_on_device)


@pytest.mark.gpu
def test_checksum_segments_match_cpu(gpu):
    check_checksum_segments(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compressor_payloads_match_cpu(gpu, dtype):
    """Whole payloads (header, checksum, body) from a CUDA tensor equal the CPU's, for
    every gradient dtype; decoding and the gather path's rank-order sum agree too."""
    from hvdcompress.compressors.threelc import ThreeLC

    gen = torch.Generator().manual_seed(3)
    shape = (37, 101)
    on_gpu, on_cpu = ThreeLC(sparsity=1.5), ThreeLC(sparsity=1.5)
    grads = [make_input(37 * 101, k, gen).view(shape).to(dtype) for k in KINDS[:4]]
    for step, grad in enumerate(grads):  # error feedback carried over steps
        p_gpu, _ = on_gpu.compress(grad.to(gpu.dev), "w")
        p_cpu, _ = on_cpu.compress(grad, "w")
        assert_same_bytes(p_gpu, p_cpu, f"{dtype} step {step}")
        dec = on_gpu.decode(p_cpu.to(gpu.dev))
        assert dec.dtype == dtype and dec.shape == shape and dec.device == gpu.dev
        np.testing.assert_array_equal(bits(dec.float()), bits(on_cpu.decode(p_cpu).float()))
    payloads = [on_cpu.compress(g, f"r{i}")[0] for i, g in enumerate(grads)]
    total_gpu = torch.zeros(37 * 101, device=gpu.dev)
    total_cpu = torch.zeros(37 * 101)
    for p in payloads:
        on_gpu.decode(p.to(gpu.dev), out=total_gpu, accumulate=True)
        on_cpu.decode(p, out=total_cpu, accumulate=True)
    np.testing.assert_array_equal(bits(total_gpu), bits(total_cpu))


@pytest.mark.gpu
def test_side_stream(gpu):
    """Kernels run on torch's current stream: work queued before them on a side stream is
    seen, and their results are ready for work queued after them."""
    gen = torch.Generator().manual_seed(4)
    g = make_input(1 << 22, "sparse90", gen)
    ref = one.threelc_encode(gpu.cpu, g, None, 1.0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        g_dev = torch.empty(g.shape, device=gpu.dev)
        g_dev.copy_(g.pin_memory(), non_blocking=True)
        torch.cuda._sleep(50_000_000)  # a busy stream: kernels on another one would race
        x = g_dev * 1.0
        enc = one.threelc_encode(gpu.backend, x, None, 1.0)
        out = torch.empty_like(x)
        one.threelc_decode(gpu.backend, enc.body, x.numel(), enc.scale, out, False)
        out_host = out.to("cpu")
    side.synchronize()
    assert_same_bytes(enc.body, ref.body)
    cout = torch.empty_like(g)
    one.threelc_decode(gpu.cpu, ref.body, g.numel(), ref.scale, cout, False)
    np.testing.assert_array_equal(bits(out_host), bits(cout))


@pytest.mark.gpu
def test_beyond_2_pow_32_elements(gpu):
    """n > 2^32 on the device (64-bit indices end to end): spikes past 2^31 and 2^32."""
    n = (1 << 32) + 13
    free, _ = torch.cuda.mem_get_info()
    if free < 80 * 2**30 and not os.environ.get("HVDC_GPU_FORCE_BIG"):
        pytest.skip(f"needs about 80 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    spikes = {7: 1.0, (1 << 31) + 3: -1.0, (1 << 32) - 1: 1.0, (1 << 32) + 2: -1.0, n - 1: 1.0}
    g = torch.zeros(n, device=gpu.dev)
    for i, v in spikes.items():
        g[i] = v
    e = torch.zeros(n, device=gpu.dev)
    enc = one.threelc_encode(gpu.backend, g, e, 1.0)
    assert not enc.nonfinite and enc.scale == 1.0
    assert int(torch.count_nonzero(e)) == 0  # 1 - 1 * 1 and 0 - 0 everywhere
    del e
    # Expected body: quartic bytes 121 except at the spikes' groups, then zero runs.
    m = (n + 4) // 5
    groups: dict[int, list[int]] = {}
    for i, v in spikes.items():
        groups.setdefault(i // 5, [1] * 5)[i % 5] = int(v) + 1
    parts, prev = [], -1
    for j in sorted(groups):
        d = groups[j]
        parts += [_zero_run(j - prev - 1), [81 * d[0] + 27 * d[1] + 9 * d[2] + 3 * d[3] + d[4]]]
        prev = j
    parts.append(_zero_run(m - prev - 1))
    want = np.concatenate([np.asarray(p, np.uint8) for p in parts])
    np.testing.assert_array_equal(enc.body.cpu().numpy(), want)
    out = g  # decode over the input: every element must be rewritten
    out.fill_(float("nan"))
    one.threelc_decode(gpu.backend, enc.body, n, enc.scale, out, False)
    assert int(torch.isnan(out).sum()) == 0
    assert int(torch.count_nonzero(out)) == len(spikes)
    for i, v in spikes.items():
        assert float(out[i]) == v
    assert one.checksum(gpu.backend, enc.body) == one.checksum(gpu.cpu, enc.body.cpu())


def _zero_run(r: int) -> np.ndarray:
    tail = [241 + r % 14] if r % 14 >= 2 else [121] if r % 14 == 1 else []
    return np.concatenate([np.full(r // 14, 255, np.uint8), np.array(tail, np.uint8)])


# ---- without a GPU -------------------------------------------------------------------------


def test_unavailable_reason_explains():
    reason = cuda_backend.gpu_unavailable_reason()
    if torch.cuda.is_available() and reason is None:
        return
    assert isinstance(reason, str) and len(reason) > 10


@pytest.mark.parametrize("family", cuda_backend.FAMILIES, ids=lambda f: f.file)
def test_nvrtc_compiles_every_kernel_family(family):
    """NVRTC accepts each kernels/*.cu file with the backend's options (see conftest.py),
    and the file defines every kernel the backend launches from it."""
    check_kernel_source_found(family)
    check_nvrtc_compiles(family)


def test_every_kernel_source_is_a_family():
    """Each kernels/*.cu file is a family the backend loads."""
    sources = {p.name for p in cuda_backend.kernel_dir().glob("*.cu")}
    assert sources == {f.file for f in cuda_backend.FAMILIES}
