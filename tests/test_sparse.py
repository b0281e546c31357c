"""The sparsifying compressors: top-k, random-k, top-k + sign (topkq), GSpar
(magnitude-proportional) and DGC (momentum correction, factor masking, warm-up, local
clipping). Statistical tests use fixed seeds, so they are deterministic; their bounds are
5-sigma ones.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdcompress import framing, wire
from hvdcompress.backends import cpu as cpu_backend
from hvdcompress.backends import cuda as cuda_backend
from hvdcompress.codecs import primitives as prim
from hvdcompress.codecs import sparse
from hvdcompress.wire import PayloadError
from tests.codec_inputs import gradients
from tests.fuzz.harness import fix_checksum
from tests.helpers import assert_error_feedback_invariant, bound, comp

# ---- top-k ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,ratio", [(1, 0.01), (100, 0.01), (1000, 0.05), (10007, 0.01)])
def test_topk_keeps_exactly_the_k_largest_and_residual_holds_the_rest(n, ratio):
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32)
    c = comp("topk", ratio=ratio)
    payload, ctx = c.compress(torch.from_numpy(g), "w")
    dec = c.decompress(payload, ctx).numpy()
    k = max(1, math.ceil(n * ratio))
    kept = np.flatnonzero(dec)
    assert len(kept) == k
    order = np.argsort(-np.abs(g), kind="stable")
    assert set(kept) == set(order[:k])
    np.testing.assert_array_equal(dec[kept], g[kept])
    e = c.memory.residuals["w"].numpy()
    assert (e[kept] == 0).all()
    np.testing.assert_array_equal(dec + e, g)
    header, _ = wire.read_header(payload)
    assert header.body_len == 8 * k


def test_topk_ties_are_broken_by_lowest_index_and_ef_over_steps():
    g = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.5])
    c = comp("topk", ratio=0.34)  # k = 3 of 6... ceil(2.04) = 3
    dec = c.decompress(*c.compress(g, "w"))
    assert torch.equal(dec, torch.tensor([0.0, -3.0, 3.0, 0.0, -3.0, 0.0]))
    c = comp("topk", ratio=0.3)  # k = 2: ties at 3.0 keep indices 1, 2
    dec = c.decompress(*c.compress(g, "w"))
    assert torch.equal(dec, torch.tensor([0.0, -3.0, 3.0, 0.0, 0.0, 0.0]))
    # over steps, everything sent plus the residual is everything computed
    assert_error_feedback_invariant(comp("topk", ratio=0.1), n=300, steps=20, seed=1)


def test_topk_int64_indices_above_2_pow_31():
    assert sparse.index_dtype(2**31 - 1) == torch.int32
    assert sparse.index_dtype(2**31) == torch.int64


# Both backends' selections: the CPU's radix select (kernels/sparse.c) and the CUDA
# backend's torch.topk path, which runs on CPU tensors as well.
SELECTIONS = {"cpu-radix": cpu_backend.topk_select, "cuda-torch": cuda_backend.topk_select}


def stable_topk(x: np.ndarray, k: int) -> np.ndarray:
    """The codec's kept set by its definition: a stable sort by decreasing |x|."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


@pytest.mark.parametrize("select", SELECTIONS.values(), ids=SELECTIONS.keys())
@pytest.mark.parametrize("kind", ["gauss", "ties", "sample_heavy", "zeros_on_sample"])
@pytest.mark.parametrize("n", [20_011, 300_007, 1_200_007])
def test_topk_selection_on_large_tensors(select, kind, n):
    """The sampled-candidate path (n >= TOPK_MIN_SAMPLED: a stride of TOPK_MIN_STRIDE at
    20,011 and 300,007 elements, of n / TOPK_SAMPLE at 1,200,007) and its fallback select
    exactly what a stable sort selects: the k largest |x|, ties by lowest index."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal(n).astype(np.float32)
    stride = max(cpu_backend.TOPK_MIN_STRIDE, n // cpu_backend.TOPK_SAMPLE)
    if kind == "ties":
        x = np.rint(x * 3).astype(np.float32)
    elif kind == "sample_heavy":  # every sampled element is large: fewer than k candidates
        x *= 1e-3
        x[::stride] = 100.0 + np.arange(len(x[::stride]), dtype=np.float32)
    elif kind == "zeros_on_sample":
        x[::stride] = 0.0
    for k in (1, n // 100, n // 10, n - 1):
        idx = select(torch.from_numpy(x), k).numpy()
        np.testing.assert_array_equal(idx, stable_topk(x, k))


@pytest.mark.parametrize("name", ["topk", "topkq"])
@pytest.mark.parametrize("kind", ["gauss", "ties", "sample_heavy", "zeros_on_sample"])
def test_topk_encode_segments_is_topk_encode_of_each(kind, name):
    """A bucket's one-call top-k (and top-k + sign) encoder (kernels/sparse.c) gives each
    tensor's encode: the same bodies (sampled and direct selections, ties, k == n, k == 0,
    a non-finite tensor left untouched) and the same residuals, over two steps."""
    rng = np.random.default_rng(3)
    n = 300_007
    stride = max(cpu_backend.TOPK_MIN_STRIDE, n // cpu_backend.TOPK_SAMPLE)
    big = rng.standard_normal(n).astype(np.float32)
    if kind == "ties":
        big = np.rint(big * 3).astype(np.float32)
    elif kind == "sample_heavy":
        big *= 1e-3
        big[::stride] = 100.0 + np.arange(len(big[::stride]), dtype=np.float32)
    elif kind == "zeros_on_sample":
        big[::stride] = 0.0
    mid = torch.from_numpy(np.rint(rng.standard_normal(20_011) * 3).astype(np.float32))
    tensors = [torch.from_numpy(big), mid, torch.randn(1), torch.zeros(0), torch.randn(5003)]
    tensors.append(torch.tensor([1.0, float("nan"), 2.0]))
    names = [f"t{i}" for i in range(len(tensors))]
    for ratio in (0.01, 1.0):
        one, bucket = comp(name, ratio=ratio), comp(name, ratio=ratio)
        for _ in range(2):
            want = [one.encode(t, tn) for t, tn in zip(tensors, names, strict=True)]
            got = bucket.encode_bucket(tensors, names)
            for (wf, wp, wb), (gf, gp, gb) in zip(want, got, strict=True):
                assert (wf, wp) == (gf, gp) and torch.equal(wb, gb)
        for tn in names:
            a, b = one.memory.residuals[tn], bucket.memory.residuals[tn]
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@settings(max_examples=200)
@given(x=gradients(allow_nonfinite=False), frac=st.floats(0.0, 1.0), ties=st.booleans())
def test_topk_radix_select_matches_the_definition(x, frac, ties):
    """Any finite input (zeros, -0.0, subnormals, huge values, many ties), any k: the
    native selection, torch's and the definition agree."""
    n = x.numel()
    if ties:
        x = torch.sign(x) * torch.round(
            torch.rand(n, generator=torch.Generator().manual_seed(n)) * 4
        )
    k = sparse.topk_count(n, max(frac, 1e-9)) if n else 0
    want = stable_topk(x.numpy(), k)
    np.testing.assert_array_equal(sparse.topk_select(x, k).numpy(), want)
    if 0 < k < n:
        np.testing.assert_array_equal(cuda_backend.topk_select(x, k).numpy(), want)


# ---- random-k ------------------------------------------------------------------------------


def test_randomk_receiver_regenerates_the_indices():
    x = torch.randn(5000)
    c = comp("randomk", ratio=0.1, unbiased=True, seed=3, rank=2)
    payload, ctx = c.compress(x, "layer.weight")
    header, _ = wire.read_header(payload)
    seed, step, tid, rank = prim.RNG_PARAMS.unpack_from(header.params, 0)
    assert (seed, step, rank, tid) == (3, 0, 2, prim.tensor_id("layer.weight"))
    key = prim.rng_key(seed, step, rank, tid)
    mask = prim.uniform_numpy(key, 5000) < sparse.randomk_threshold(0.1) / 2**24
    dec = comp("randomk", ratio=0.1, unbiased=True, seed=3).decode(payload).numpy()
    np.testing.assert_array_equal(dec != 0, mask)
    scale = np.float32(sparse.randomk_scale(0.1, True))
    assert abs(scale - 10.0) < 1e-5  # 1 / p for the p = round(0.1 * 2**24) / 2**24 used
    np.testing.assert_array_equal(dec[mask], x.numpy()[mask] * scale)
    assert header.body_len == 4 * mask.sum()
    assert abs(mask.mean() - 0.1) < 5 * math.sqrt(0.09 / 5000)


def test_randomk_unbiased_mean_over_seeds_approaches_x():
    n, steps, p = 200, 2000, 0.25
    x = torch.randn(n)
    c = comp("randomk", ratio=p, unbiased=True, seed=5)
    total = torch.zeros(n)
    for _ in range(steps):
        c.decode(c.compress(x, "w")[0], out=total, accumulate=True)
    mean = total / steps
    bound = 5 * x.abs() * math.sqrt((1 - p) / p / steps) + 1e-6
    assert ((mean - x).abs() <= bound).all()


def test_randomk_error_feedback_invariant():
    c = comp("randomk", ratio=0.3, unbiased=False, error_feedback=True, seed=1)
    assert_error_feedback_invariant(c, n=400, steps=30, seed=2)


def test_randomk_default_is_stich_et_al_mem_sgd():
    """The default random-k (memory, kept values unscaled) run under SGD is MEM-SGD
    (Stich et al. 2018, Algorithm 1: v = comp_k(m + eta g), x -= v, m += eta g - v) with
    m = eta e: the same iterates on a least-squares problem, step for step, and it
    converges. Only the kept coordinates come from the codec (its mask is tested above)."""
    torch.manual_seed(5)
    n, eta, steps = 200, 0.02, 300
    a_mat = 0.3 * torch.randn(n, n, dtype=torch.float64) / n**0.5 + torch.eye(
        n, dtype=torch.float64
    )
    b = torch.randn(n, dtype=torch.float64)

    def grad(x):
        return a_mat.T @ (a_mat @ x - b)

    c = comp("randomk", ratio=0.1, seed=3)
    x = torch.zeros(n, dtype=torch.float64)
    x_ref, m = x.clone(), torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        decoded = c.decode(c.compress(grad(x).float(), "w")[0]).double()
        x -= eta * decoded
        g_ref = grad(x_ref)
        v = torch.where(decoded != 0, m + eta * g_ref, torch.zeros_like(m))
        x_ref, m = x_ref - v, m + eta * g_ref - v
        torch.testing.assert_close(x, x_ref, rtol=1e-3, atol=1e-4)  # float32 g and e
    loss = float(((a_mat @ x - b) ** 2).sum())
    assert loss < 0.1 * float((b**2).sum())


def _randomk_reference(a: torch.Tensor, key: int, ratio: float) -> np.ndarray:
    """The mask of the codec's definition: u_i < T / 2**24 with NumPy's uniforms."""
    return prim.uniform_numpy(key, a.numel()) < sparse.randomk_threshold(ratio) / 2**24


@pytest.mark.parametrize("ratio", [2**-24, 0.01, 0.1, 0.5, 1.0])
def test_randomk_native_pass_keeps_the_defined_set(ratio):
    """The CPU codec compares each element's 24-bit hash with T in one pass (no mask, no
    float uniforms): its values, residual and decoded tensor (written and accumulated)
    are those of the mask u < T / 2**24, at sizes around its 512-element chunks."""
    gen = torch.Generator().manual_seed(11)
    key = prim.rng_key(4, 2, 1, prim.tensor_id("w"))
    scale = sparse.randomk_scale(ratio, True)
    for n in (0, 1, 3, 511, 512, 513, 1029, 20000):
        a = torch.randn(n, generator=gen)
        mask = torch.from_numpy(_randomk_reference(a, key, ratio))
        residual = torch.full((n,), 7.0)
        values = sparse.randomk_encode(a, key, ratio, residual)
        assert torch.equal(values, a[mask])
        assert torch.equal(residual, torch.where(mask, torch.zeros_like(a), a))
        out = torch.randn(n, generator=gen)
        for accumulate in (False, True):
            got = out.clone()
            sparse.randomk_decode_into(
                values.view(torch.uint8), key, n, ratio, scale, got, accumulate
            )
            scaled = values * np.float32(scale)  # one product, then one sum
            want = out.clone() if accumulate else torch.zeros(n)
            want[mask] = out[mask] + scaled if accumulate else scaled
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_randomk_keeps_strictly_below_the_threshold():
    """An element whose 24-bit hash equals T is not kept (u < p, strict): T is set to the
    hashes of chosen elements, on both sides of the codec."""
    key, n = prim.rng_key(9, 0, 0, 1), 2000
    hashes = (prim.uniform_numpy(key, n) * 2**24).astype(np.int64)
    a = torch.arange(1, n + 1, dtype=torch.float32)
    for j in (0, 777, n - 1):
        ratio = float(hashes[j]) / 2**24  # randomk_threshold(ratio) == hashes[j]
        assert sparse.randomk_threshold(ratio) == hashes[j]
        values = sparse.randomk_encode(a, key, ratio, None)
        assert torch.equal(values, a[torch.from_numpy(hashes < hashes[j])])
        out = torch.zeros(n)
        sparse.randomk_decode_into(values.view(torch.uint8), key, n, ratio, 1.0, out, True)
        assert out[j] == 0.0 and torch.equal(out[out != 0], values)


def test_randomk_decode_refuses_a_wrong_count_or_a_nonfinite_value_out_untouched():
    key, n, ratio = prim.rng_key(1, 0, 0, 5), 3000, 0.1
    a = torch.randn(n)
    body = sparse.randomk_encode(a, key, ratio, None).view(torch.uint8)
    kept = body.numel() // 4
    nan = body.clone()
    nan[4 * (kept // 2) : 4 * (kept // 2) + 4] = torch.tensor([0, 0, 0xC0, 0x7F])
    cases = [
        (body[:-4], f"keeps {kept} values"),
        (torch.cat([body, body[:4]]), f"keeps {kept} values"),
        (body[:-1], f"keeps {kept} values"),
        (torch.empty(0, dtype=torch.uint8), f"keeps {kept} values"),
        (nan, "not finite"),
    ]
    for bad, match in cases:
        for accumulate in (False, True):
            out = torch.full((n,), 5.0)
            with pytest.raises(PayloadError, match=match):
                sparse.randomk_decode_into(bad, key, n, ratio, 1.0, out, accumulate)
            assert torch.equal(out, torch.full((n,), 5.0))


# ---- top-k + sign (topkq) and GSpar, CAT's other compressors -------------------------------


def test_topkq_sends_the_mean_magnitude_with_signs_and_keeps_the_rest():
    x = torch.tensor([0.5, -4.0, 1.0, 3.0, -0.25, 2.0])
    c = comp("topkq", ratio=0.5)  # k = 3: indices 1, 3, 5, magnitude (4 + 3 + 2) / 3
    payload, ctx = c.compress(x, "w")
    dec = c.decompress(payload, ctx)
    assert dec.tolist() == [0.0, -3.0, 0.0, 3.0, 0.0, 3.0]
    np.testing.assert_array_equal(c.memory.residual("w", x).numpy(), (x - dec).numpy())
    # 4-byte magnitude + 3 int32 indices + 1 byte of sign bits
    assert wire.read_header(payload)[0].body_len == 4 + 12 + 1


def test_topkq_error_feedback_keeps_a_equal_decode_plus_residual():
    torch.manual_seed(2)
    c = comp("topkq", ratio=0.05)
    e_prev = torch.zeros(4000)
    for _ in range(4):
        g = torch.randn(4000)
        payload, ctx = c.compress(g, "w")
        dec = c.decompress(payload, ctx)
        e = c.memory.residual("w", g)
        torch.testing.assert_close(dec + e, g + e_prev, rtol=0, atol=1e-6)
        e_prev = e.clone()


def test_gspar_scale_solves_the_budget_with_saturation():
    mag = torch.tensor([100.0, 50.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    c, rounds = sparse.gspar_scale(mag, 3.0)  # the two large ones saturate: c = 1 / 5
    assert c == pytest.approx(0.2) and rounds >= 2
    p = torch.clamp(mag * c, max=1.0)
    assert float(p.sum()) == pytest.approx(3.0)
    assert sparse.gspar_scale(mag, 7.0)[0] == math.inf  # every non-zero entry kept


def _gspar_scale_reference(mag: torch.Tensor, budget: float) -> tuple[float, int]:
    """The scale iteration as torch ops (the codec before it went native)."""
    nonzero = int(torch.count_nonzero(mag))
    if budget >= nonzero:
        return math.inf, 0
    saturated = torch.zeros_like(mag, dtype=torch.bool)
    count = 0
    for rounds in range(1, nonzero + 2):
        rest = prim.abs_sum(torch.where(saturated, torch.zeros_like(mag), mag))
        c = (budget - count) / rest
        saturated = mag * c >= 1.0
        new = int(saturated.sum())
        if new == count:
            return c, rounds
        count = new
    raise AssertionError


def _gspar_encode_reference(a, budget, key, scaled):
    mag = a.abs()
    c, _ = _gspar_scale_reference(mag, budget)
    if math.isinf(c):
        p = (mag > 0).to(torch.float32)
    else:
        p = torch.clamp(mag * torch.tensor(c, dtype=torch.float32), max=1.0)
    keep = torch.from_numpy(prim.uniform_numpy(key, a.numel())) < p
    idx = torch.nonzero(keep).reshape(-1)
    values = a[idx] / p[idx] if scaled else a[idx]
    return torch.cat(
        [values.view(torch.uint8), idx.to(sparse.index_dtype(a.numel())).view(torch.uint8)]
    )


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.2, 0.6, 1.0])
def test_gspar_native_rounds_and_draw_match_the_torch_formulas(ratio):
    """One pass per round (the saturated count and the others' ordered chunk sums) and
    one draw pass give the torch formulas' c, rounds and body, scaled or not: heavy-tailed
    inputs that saturate over several rounds, zeros, sizes around the 1024-element chunks
    and their groups of four."""
    # an entry exactly at the boundary, |a| c == 1, is saturated (>=): (1/16, 2 rounds)
    boundary = torch.ones(4096)
    boundary[0] = 16.0
    assert sparse.gspar_scale(boundary, 4111 / 16) == (0.0625, 2)
    assert _gspar_scale_reference(boundary, 4111 / 16) == (0.0625, 2)
    gen = torch.Generator().manual_seed(int(ratio * 1000))
    key = prim.rng_key(2, 5, 1, prim.tensor_id("g"))
    for n in (1, 7, 1023, 1024, 4097, 5000, 20000):
        a = torch.randn(n, generator=gen) * torch.randn(n, generator=gen).abs() ** 6
        a[::7] = 0.0
        budget = ratio * n
        assert sparse.gspar_scale(a, budget) == _gspar_scale_reference(a.abs(), budget)
        for scaled in (True, False):
            body, idx = sparse.gspar_encode(a, budget, key, scaled)
            assert torch.equal(body, _gspar_encode_reference(a, budget, key, scaled))


@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.6, 1.0])
def test_gspar_bucket_encode_is_the_per_tensor_encode(ratio):
    """GSpar's one-call bucket encoder (the scale rounds with a native correctly rounded
    sum, then the draw) gives each tensor's payload: heavy-tailed tensors that saturate
    over several rounds, zeros, a non-finite tensor, every entry kept at ratio 1."""
    gen = torch.Generator().manual_seed(int(ratio * 100))
    tensors = [
        torch.randn(n, generator=gen) * torch.randn(n, generator=gen).abs() ** 6
        for n in (1, 7, 1023, 1024, 5000, 20000)
    ]
    tensors[3][::3] = 0.0
    tensors.append(torch.zeros(50))
    tensors.append(torch.tensor([1.0, float("nan"), 2.0]))
    names = [f"t{i}" for i in range(len(tensors))]
    one, bucketed = comp("gspar", ratio=ratio, seed=6), comp("gspar", ratio=ratio, seed=6)
    for _ in range(2):
        frame, _ = framing.compress_bucket(bucketed, tensors, names)
        want = wire.frame([one.compress(t, n)[0] for t, n in zip(tensors, names, strict=True)])
        assert torch.equal(frame, want)


@pytest.mark.parametrize("room", [0, 3])
def test_random_draws_call_again_when_the_room_is_short(monkeypatch, room):
    """Random-k and GSpar size their output from the mean kept count (plus 8 standard
    deviations); a draw that keeps more is drawn again with exact room: same values,
    indices and residual as the reference."""
    monkeypatch.setattr(cpu_backend.sparse, "_kept_room", lambda n, mean: room)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(3000, generator=gen)
    key = prim.rng_key(1, 2, 3, 4)
    mask = torch.from_numpy(_randomk_reference(a, key, 0.1))
    residual = torch.randn(3000, generator=gen)
    assert torch.equal(sparse.randomk_encode(a, key, 0.1, residual), a[mask])
    assert torch.equal(residual, torch.where(mask, torch.zeros_like(a), a))
    body, _ = sparse.gspar_encode(a, 300.0, key, True)
    assert torch.equal(body, _gspar_encode_reference(a, 300.0, key, True))
    # a bucket's one-call encoder: the tensors that overflow are encoded again alone
    tensors = [torch.randn(n, generator=gen) for n in (0, 5, 3000, 70)]
    names = [f"t{i}" for i in range(len(tensors))]
    for name, ef in itertools.product(("randomk", "gspar"), (False, True)):
        # with error feedback the residuals must come out the same too
        kw = {"ratio": 0.1, "seed": 2, "error_feedback": ef}
        one, bucketed = comp(name, **kw), comp(name, **kw)
        for _ in range(2):
            frame, _ = framing.compress_bucket(bucketed, tensors, names)
            sent = [one.compress(t, n)[0] for t, n in zip(tensors, names, strict=True)]
            assert torch.equal(frame, wire.frame(sent)), (name, ef)
        for tensor in names if ef else ():
            got, want = bucketed.memory.residuals[tensor], one.memory.residuals[tensor]
            assert torch.equal(got, want), (name, tensor)


@pytest.mark.parametrize("n", [1, 17, 5000])
def test_gspar_sends_a_over_p_and_keeps_everything_at_full_budget(n):
    torch.manual_seed(n)
    x = torch.randn(n)
    c = comp("gspar", ratio=1.0)
    payload, ctx = c.compress(x, "w")
    np.testing.assert_array_equal(c.decompress(payload, ctx).numpy(), x.numpy())
    c = comp("gspar", ratio=0.1, seed=4)
    payload, ctx = c.compress(x, "w")
    dec = c.decompress(payload, ctx)
    kept = dec != 0
    scale, _ = sparse.gspar_scale(x.abs(), 0.1 * n)
    p = torch.clamp(x.abs() * torch.tensor(scale, dtype=torch.float32), max=1.0)
    np.testing.assert_array_equal(dec[kept].numpy(), (x[kept] / p[kept]).numpy())


def test_gspar_is_unbiased_and_spends_its_budget_on_average():
    torch.manual_seed(0)
    n, ratio, draws = 2000, 0.05, 400
    x = torch.randn(n) * torch.linspace(0.01, 3.0, n)
    c = comp("gspar", ratio=ratio, seed=9)
    total, kept = torch.zeros(n, dtype=torch.float64), 0
    for _ in range(draws):
        payload, ctx = c.compress(x, "w")
        dec = c.decompress(payload, ctx)
        total += dec.double()
        kept += int((dec != 0).sum())
    assert abs(kept / draws - ratio * n) < 5 * math.sqrt(ratio * n / draws)
    scale, _ = sparse.gspar_scale(x.abs(), ratio * n)
    p = torch.clamp(x.abs().double() * scale, max=1.0)
    sd = (x.double().abs() * torch.sqrt((1 - p) / p) / math.sqrt(draws)).clamp(min=1e-12)
    z = ((total / draws - x.double()) / sd).abs()
    assert float(z.max()) < 6.0  # 2000 coordinates, none beyond 6 sigma


def _gspar_variance(mag: torch.Tensor, budget: float) -> float:
    """E||decode - a||^2 / ||a||^2 of the unbiased estimate at expected budget T, from
    p_i = min(1, c |a_i|) solved for T by bisection in float64 (independent of the codec)."""
    m = mag.double()
    lo, hi = 0.0, 1.0
    while float(torch.clamp(hi * m, max=1.0).sum()) < budget:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(torch.clamp(mid * m, max=1.0).sum()) < budget else (lo, mid)
    p = torch.clamp(hi * m, max=1.0)
    nz = m > 0
    return float(((1 / p[nz] - 1) * m[nz] ** 2).sum() / (m**2).sum())


@pytest.mark.parametrize("variance", [0.05, 1.0, 9.0])
@pytest.mark.parametrize("shape", ["gauss", "heavy", "one_large"])
def test_gspar_variance_budget_is_the_least_budget_within_the_variance(variance, shape):
    """Wangni et al.'s problem: the fewest expected kept entries whose estimate's variance
    is at most variance * ||a||^2. The budget meets the bound (to rounding) and a budget 1%
    smaller does not: the least one."""
    torch.manual_seed(7)
    a = {
        "gauss": torch.randn(3000),
        "heavy": torch.randn(3000) ** 3,
        "one_large": torch.cat([torch.tensor([1e3]), torch.randn(999) * 1e-2]),
    }[shape]
    budget = sparse.gspar_variance_budget(a, variance)
    assert 0 < budget < a.numel()
    assert _gspar_variance(a.abs(), budget) == pytest.approx(variance, rel=1e-6)
    assert _gspar_variance(a.abs(), budget * 0.99) > variance
    assert sparse.gspar_variance_budget(torch.zeros(5), variance) == 0.0
    assert sparse.gspar_variance_budget(torch.tensor([1.0, math.nan]), variance) == 0.0


def test_gspar_with_a_variance_budget_is_unbiased_within_its_variance():
    """The paper's own budget through the compressor: unbiased over seeds, the measured
    E||decode - a||^2 at most variance ||a||^2 (within sampling error), the kept count
    the budget's on average, and no policy may set a ratio."""
    torch.manual_seed(3)
    n, variance, draws = 2000, 0.5, 300
    x = torch.randn(n) * torch.linspace(0.01, 3.0, n)
    budget = sparse.gspar_variance_budget(x, variance)
    total, err, kept = torch.zeros(n, dtype=torch.float64), 0.0, 0
    for seed in range(draws):
        c = comp("gspar", variance=variance, seed=seed)
        dec = c.decode(c.compress(x, "w")[0]).double()
        total += dec
        err += float(((dec - x.double()) ** 2).sum())
        kept += int((dec != 0).sum())
    norm2 = float((x.double() ** 2).sum())
    assert err / draws / norm2 == pytest.approx(variance, rel=0.15)
    assert abs(kept / draws - budget) < 5 * math.sqrt(budget / draws)
    assert float(((total / draws - x.double()) ** 2).sum() / norm2) < 3 * variance / draws
    with pytest.raises(ValueError, match="cannot set its ratio"):
        comp("gspar", variance=variance).set_level("w", 0.1)
    # with error feedback, E||a - C(a)||^2 = sum (1 - p_i) a_i^2 <= variance ||a||^2
    assert comp("gspar", variance=0.25, error_feedback=True).contraction(100) == 0.75
    assert comp("gspar", variance=1.0, error_feedback=True).contraction(100) is None
    for bad in (0.0, -1.0, math.nan, math.inf, True):
        with pytest.raises(ValueError, match="gspar variance must be"):
            comp("gspar", variance=bad)


# ---- DGC (docs/baselines.md) ---------------------------------------------------------------


def _dgc_reference(gs, ratio, momentum):
    """NumPy DGC: momentum correction and factor masking, top-k by |v| (ties low index)."""
    n = gs[0].size
    u, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    sent = []
    for g in gs:
        u = (u * np.float32(momentum) + g).astype(np.float32)
        v = (v + u).astype(np.float32)
        k = max(1, math.ceil(n * ratio))
        idx = np.sort(np.argsort(-np.abs(v), kind="stable")[:k])
        s = np.zeros(n, np.float32)
        s[idx] = v[idx]
        sent.append(s)
        u[idx] = 0
        v[idx] = 0
    return sent, u, v


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dgc_momentum_correction_and_factor_masking(momentum):
    rng = np.random.default_rng(3)
    gs = [rng.standard_normal(500).astype(np.float32) for _ in range(6)]
    c = comp("dgc", ratio=0.05, momentum=momentum)
    got = [c.decompress(*c.compress(torch.from_numpy(g), "w")).numpy() for g in gs]
    sent, u, v = _dgc_reference(gs, 0.05, momentum)
    for a, b in zip(got, sent, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c.velocity.residuals["w"].numpy(), u)
    np.testing.assert_array_equal(c.memory.residuals["w"].numpy(), v)
    kept = got[-1] != 0
    assert (c.velocity.residuals["w"].numpy()[kept] == 0).all()  # masking
    assert (c.memory.residuals["w"].numpy()[kept] == 0).all()


def test_dgc_without_momentum_is_error_feedback_top_k():
    c = comp("dgc", ratio=0.02, momentum=0.0)
    assert_error_feedback_invariant(c, n=400, steps=15, seed=4)


def test_dgc_warmup_schedule():
    # the paper's: 4 warm-up epochs (stages), sparsity 75 %, 93.75 %, 98.4 %, 99.6 %, 99.9 %
    c = comp("dgc", ratio=0.001, warmup_steps=40, warmup_stages=4)
    dens = [c.density(t) for t in (0, 9, 10, 19, 20, 30, 39, 40, 1000)]
    want = [0.25, 0.25, 0.0628, 0.0628, 0.0158, 0.00397, 0.00397, 0.001, 0.001]
    for d, w in zip(dens, want, strict=True):
        assert d == pytest.approx(w, rel=0.01)
    # continuous: exponential, strictly decreasing to ratio
    c = comp("dgc", ratio=0.01, warmup_steps=10)
    dens = [c.density(t) for t in range(12)]
    assert dens[0] == 0.25 and dens[10] == dens[11] == 0.01
    assert all(a > b for a, b in zip(dens[:10], dens[1:11], strict=True))
    ratios = [b / a for a, b in zip(dens[:10], dens[1:11], strict=True)]
    assert max(ratios) == pytest.approx(min(ratios))
    # the payloads follow it: k = ceil(density * n)
    for t in range(12):
        dec = c.decompress(*c.compress(torch.randn(1000) + 5.0, "w"))
        assert int(dec.count_nonzero()) == math.ceil(1000 * dens[t])
    assert comp("dgc", ratio=0.5, warmup_steps=10).density(0) == 0.5  # no warm-up above 0.25


def test_dgc_receiver_checks_the_schedule():
    sender = comp("dgc", ratio=0.01, warmup_steps=10)
    payload, ctx = sender.compress(torch.randn(300), "w")
    with pytest.raises(PayloadError, match="density"):
        comp("dgc", ratio=0.01).decompress(payload, ctx)
    with pytest.raises(PayloadError, match="ratio"):
        comp("dgc", ratio=0.02, warmup_steps=10).decompress(payload, ctx)
    raw = bytearray(payload.numpy().tobytes())
    header, _ = wire.read_header(payload)
    off = header.size - 8  # the density double
    raw[off : off + 8] = np.float64(0.5).tobytes()
    forged = torch.frombuffer(bytearray(fix_checksum(raw)), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="density"):
        comp("dgc", ratio=0.01, warmup_steps=10).decompress(forged, ctx)


def test_dgc_local_clipping_scales_by_world_size():
    g = torch.randn(100) * 10
    c = bound("dgc", 0, 4, ratio=1.0, momentum=0.0, clip_norm=2.0)
    dec = c.decompress(*c.compress(g, "w"))
    assert float(dec.norm()) == pytest.approx(1.0, rel=1e-4)  # 2 / sqrt(4)
    torch.testing.assert_close(dec / dec.norm(), g / g.norm())
    small = torch.full((100,), 1e-3)
    assert torch.equal(c.decompress(*c.compress(small, "s")), small)  # under the limit


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dgc_momentum_update_in_place_or_untouched(momentum):
    """u <- m u + g (g itself at m = 0, -0.0 kept) and v <- v + u, in place, one float32
    operation each; a v that would overflow or turn NaN leaves u and v untouched."""
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 1000, 4099):
        g, u, v = (torch.randn(n, generator=gen) for _ in range(3))
        g[0] = -0.0
        want_u = g.clone() if momentum == 0.0 else u * momentum + g
        want_v = v + want_u
        assert not sparse.momentum_update(g, u, v, momentum)
        assert torch.equal(u.view(torch.int32), want_u.view(torch.int32))
        assert torch.equal(v.view(torch.int32), want_v.view(torch.int32))
        for bad in (3e38, float("nan"), float("-inf")):
            g2, u2, v2 = g.clone(), u.clone(), v.clone()
            g2[n // 2], v2[n // 2] = 3e38, bad  # 3e38 + 3e38 overflows; NaN and -Inf stay
            before = (u2.clone().view(torch.int32), v2.clone().view(torch.int32))
            assert sparse.momentum_update(g2, u2, v2, momentum)
            assert torch.equal(u2.view(torch.int32), before[0])
            assert torch.equal(v2.view(torch.int32), before[1])


def test_dgc_nonfinite_keeps_state_and_state_dict_roundtrip():
    c = comp("dgc", ratio=0.1)
    x = torch.randn(200)
    c.compress(x, "w")
    u, v = c.velocity.residuals["w"].clone(), c.memory.residuals["w"].clone()
    bad = x.clone()
    bad[0] = float("nan")
    payload, ctx = c.compress(bad, "w")
    assert wire.read_header(payload)[0].nonfinite and c.decompress(payload, ctx).isnan().all()
    assert torch.equal(c.velocity.residuals["w"], u) and torch.equal(c.memory.residuals["w"], v)
    d = comp("dgc", ratio=0.1)
    d.load_state_dict(c.state_dict())
    assert torch.equal(c.compress(x, "w")[0], d.compress(x, "w")[0])


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"ratio": 0.0}, r"\(0, 1\]"),
        ({"momentum": 1.0}, r"\[0, 1\)"),
        ({"momentum": -0.1}, r"\[0, 1\)"),
        ({"clip_norm": -1.0}, ">= 0"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 4, "warmup_stages": 5}, "warmup_stages"),
    ],
)
def test_dgc_parameters_out_of_range_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        comp("dgc", **kw)


def _mostly_zero(n: int, nonzero: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.zeros(n)
    keep = torch.rand(n, generator=gen) < nonzero
    g[keep] = torch.randn(int(keep.sum()), generator=gen)
    return g


@pytest.mark.parametrize(
    "params, grad",
    [
        ({"ratio": 0.01}, torch.zeros(200_000)),
        ({"ratio": 0.01, "error_feedback": True}, torch.zeros(200_000)),
        ({"ratio": 0.5, "error_feedback": True}, _mostly_zero(3591, 0.01, 1)),
        ({"ratio": 0.5}, _mostly_zero(3591, 0.01, 2)),
        ({"ratio": 0.01}, _mostly_zero(100_003, 0.0005, 3)),
        ({"ratio": 0.1}, torch.zeros(1)),
        ({"ratio": 0.1}, torch.full((4099,), 1e-40)),
        ({"ratio": 0.1, "error_feedback": True}, torch.full((4099,), -1e-40)),
    ],
    ids=[
        "zeros",
        "zeros-ef",
        "1pct-ef",
        "1pct",
        "0.05pct",
        "one-zero",
        "subnormal",
        "subnormal-ef",
    ],
)
def test_gspar_receiver_accepts_every_payload_its_encoder_emits(params, grad):
    """A gradient with fewer non-zeros than the ratio's budget keeps all of them (c = inf),
    so a GSpar payload may carry any number of elements per kept value, down to none: the
    receiver's own bound (the expected tensor, its output) is what limits a decode, not a
    kept-count estimate (docs/baselines.md, "Top-k + sign and GSpar")."""
    sender, receiver = bound("gspar", 0, 2, **params), bound("gspar", 1, 2, **params)
    for step in range(3):  # error feedback built up
        frame, ctxs = framing.compress_bucket(sender, [grad], ["w"])
        out = torch.zeros(grad.numel())
        framing.decode_frame(receiver, frame, [out], ctxs, rank=0)
        payload, ctx = sender.compress(grad, "w")
        got = receiver.decode(payload, expect=ctx)
        assert got.shape == grad.shape and bool(torch.isfinite(got).all()), step
        assert bool(torch.isfinite(out).all()), step
        # a zero of the gradient is never kept (its residual stays zero too)
        assert bool((out[grad == 0] == 0).all()) and bool((got[grad == 0] == 0).all()), step
    if grad.numel() > 1:  # the receiver's bound still holds
        with pytest.raises(PayloadError, match="numel"):
            receiver.decode(payload, max_numel=grad.numel() - 1)


def test_gspar_scale_stops_at_the_largest_float32():
    """Subnormal magnitudes would need c past float32's range to spend the budget: c stops
    at the largest float32 (fl32(c) multiplies |a_i|), fewer than the budget are kept on
    average, the values a_i / p_i stay unbiased; before, the iteration divided by zero."""
    mag = torch.full((4099,), 1e-40)
    c, rounds = sparse.gspar_scale(mag, 409.9)
    assert c == sparse.GSPAR_MAX_SCALE and rounds == 1
    p = float(np.float32(np.float32(1e-40) * np.float32(c)))
    assert 0.0 < p < 0.1
    body, idx = sparse.gspar_encode(mag, 409.9, key=5)
    assert 0 < idx.numel() < 409.9
    values = body[: 4 * idx.numel()].view(torch.float32)
    assert bool(torch.isfinite(values).all()) and bool((values > 0).all())


def test_gspar_scaled_values_that_overflow_travel_as_nonfinite():
    # a_i / p_i of values near float32's largest overflows: the payload is flagged (every
    # rank decodes NaN, as for 3LC and QSGD), never an Inf body its own receiver refuses
    big = torch.full((257,), 3e38)
    c = comp("gspar", ratio=0.1)
    payload, ctx = c.compress(big, "w")
    assert wire.read_header(payload)[0].nonfinite
    assert torch.isnan(comp("gspar", ratio=0.1).decode(payload, expect=ctx)).all()
    frame, ctxs = framing.compress_bucket(
        comp("gspar", ratio=0.1), [big, torch.ones(100)], ["w", "v"]
    )
    outs = [torch.zeros(257), torch.zeros(100)]
    framing.decode_frame(comp("gspar", ratio=0.1), frame, outs, ctxs, rank=0)
    assert torch.isnan(outs[0]).all() and torch.isfinite(outs[1]).all()
    assert outs[1].sum() > 0  # the finite tensor of the bucket still decodes
