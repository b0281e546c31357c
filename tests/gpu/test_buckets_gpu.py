"""A bucket on the CUDA backend as one launch sequence (kernels/threelc.cu section 7,
kernels/sign.cu section 5, kernels/quant.cu section 9), against the CPU backend byte for
byte: the segment calls of signSGD, EF-signSGD, TernGrad, QSGD, DQSG (s = 1 too) and
top-k's decode (kernels/sparse.cu), and whole
compressors' frames and ``decode_frame`` sums (3LC's own calls: test_threelc_gpu.py). The
``check_*``
functions take a ``Setup`` so that tests/host_kernels run them on the host-built kernels;
here they run on a GPU (``gpu`` fixture: skips with the reason where CUDA kernels cannot
run)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import framing, wire
from hvdcompress.compressors import registry
from hvdcompress.errors import PayloadError
from tests import bucket_of_one as one
from tests.gpu.conftest import Setup, bits
from tests.gpu.conftest import bits as bits_of
from tests.gpu.test_threelc_gpu import assert_same_bytes, gapped_frame, make_bucket, make_input
from tests.helpers import bound

# The backend call that decode_frame's fast path reaches for each compressor.
SEGMENT_DECODER = {
    "3lc": "threelc_decode_segments",
    "terngrad": "threelc_decode_segments",
    "signsgd": "sign_decode_segments",
    "efsignsgd": "sign_decode_segments",
    "qsgd": "qsgd_decode_segments",
    "dqsg": "dqsg_decode_segments",
    "topk": "topk_decode_segments",
    "dgc": "topk_decode_segments",
    "gspar": "topk_decode_segments",
    "topkq": "topkq_decode_segments",
    "randomk": "randomk_decode_segments",
}


def _corrupt(name: str, body: torch.Tensor, numel: int) -> bool:
    """Make a body its decoder refuses (in place); False when this one cannot be."""
    if name in ("topk", "dgc", "gspar", "topkq", "randomk"):  # the first value (topkq: m) NaN
        body[:4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)
        return True
    if name in ("qsgd", "dqsg"):
        body[:4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8)  # a norm / delta -1.0
        return True
    if name in ("signsgd", "efsignsgd"):
        if numel % 8 == 0:
            return False
        body[-1] |= 0x80  # a padding bit
        return True
    literal = np.flatnonzero(body.numpy() <= 242)
    if not len(literal):
        return False
    body[int(literal[0])] = 255  # a literal byte made a run of 14: too many quartic bytes
    return True


def check_bucket_frames(
    s: Setup, name: str, use_backend=contextlib.nullcontext, params: dict | None = None
) -> None:
    """A compressor's bucket on the device: ``compress_bucket`` gives the CPU's frame byte
    for byte (state carried over steps), and ``decode_frame`` of a host or device frame
    into device outputs takes the one-launch-sequence path and adds what the CPU adds; a
    corrupt body (checksum recomputed) raises for the same tensor, with the same outputs.
    ``use_backend``: a context in which the backend under test serves the device;
    ``params``: the compressor's."""
    from hvdcompress.backends import cpu

    gen = torch.Generator().manual_seed(24)
    params = params or {}
    on_dev = hvdcompress.get_compressor(name, **params)
    on_cpu = hvdcompress.get_compressor(name, **params)
    decoder = SEGMENT_DECODER[name]
    real = getattr(s.backend, decoder)
    decoded = []

    def counted(*args):
        decoded.append(1)
        return real(*args)

    for step in range(3):
        grads = make_bucket(gen)
        grads[4] = grads[4].half()
        if step == 1:
            grads[9][3] = float("nan")
        names = [f"layer{i}" for i in range(len(grads))]
        frame_cpu, ctxs = framing.compress_bucket(on_cpu, grads, names)
        with use_backend():
            frame_dev, ctxs_dev = framing.compress_bucket(
                on_dev, [g.to(s.dev, copy=True) for g in grads], names
            )
        assert_same_bytes(frame_dev, frame_cpu, f"{name} step {step}")
        bases = [torch.linspace(-1, 1, g.numel()) for g in grads]
        couts = [b.clone() for b in bases]
        framing.decode_frame(on_cpu, frame_cpu, couts, ctxs, rank=1)
        for src in (frame_cpu, frame_dev):
            outs = [b.to(s.dev, copy=True) for b in bases]
            setattr(s.backend, decoder, counted)
            try:
                with use_backend():
                    framing.decode_frame(on_dev, src, outs, ctxs_dev, rank=1)
            finally:
                setattr(s.backend, decoder, real)
            for i, (out, cout) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits(out), bits(cout), f"{name} output {i}")
    assert len(decoded) == 6, "decode_frame did not take the one-call path"
    # a corrupt body with a valid checksum: the same tensor refused, the same sums
    parsed = wire.unframe_parsed(frame_cpu, 0, names, torch.device("cpu"))
    lengths = [p.numel() for _, p in parsed]
    starts = (8 * (len(lengths) + 1) + np.cumsum([0, *lengths[:-1]])).tolist()
    bad = frame_cpu.clone()
    order = sorted(range(len(parsed)), key=lambda i: -parsed[i][0].body_len)
    for target in order:
        end = starts[target] + lengths[target]
        body = bad[end - parsed[target][0].body_len : end]
        if body.numel() and _corrupt(name, body, parsed[target][0].numel):
            break
    bad[starts[target] + wire.CHECKSUM_OFFSET :][:4] = 0
    cpu.store_checksums(bad, [starts[target]], [lengths[target]], wire.CHECKSUM_OFFSET)
    couts = [b.clone() for b in bases]
    with pytest.raises(PayloadError) as want:
        framing.decode_frame(on_cpu, bad, couts, ctxs, rank=2)
    outs = [b.to(s.dev, copy=True) for b in bases]
    with pytest.raises(PayloadError) as got, use_backend():
        framing.decode_frame(on_dev, bad, outs, ctxs_dev, rank=2)
    where = (got.value.field, got.value.rank, got.value.tensor)
    assert where == (want.value.field, want.value.rank, want.value.tensor)
    assert got.value.tensor == names[target]
    for i, (out, cout) in enumerate(zip(outs, couts, strict=True)):
        np.testing.assert_array_equal(bits(out), bits(cout), f"corrupt: output {i}")


def check_sign_segments(s: Setup) -> None:
    """signSGD's and EF-signSGD's bucket calls (encode, chunk sums, EF encode, decode)
    give the CPU backend's bodies, flags, sums, residuals and sums of outputs; a set
    padding bit stops the decode at its body, the ones before it added."""
    gen = torch.Generator().manual_seed(25)
    xs = make_bucket(gen)
    xs[6][1] = float("-inf")
    want = s.cpu.sign_encode_segments(xs)
    got = s.backend.sign_encode_segments([x.to(s.dev, copy=True) for x in xs])
    assert [b is None for b in got] == [b is None for b in want]
    assert sum(b is None for b in want) == 2
    for i, (b, w) in enumerate(zip(got, want, strict=True)):
        if w is not None:
            assert_same_bytes(b, w, f"sign body {i}")
    es = [make_input(x.numel(), "dense", gen) * 0.1 for x in xs]
    es_dev = [e.to(s.dev, copy=True) for e in es]
    xs_dev = [x.to(s.dev, copy=True) for x in xs]
    sums, bad = s.cpu.efsign_sums_segments(xs, es)
    sums_dev, bad_dev = s.backend.efsign_sums_segments(xs_dev, es_dev)
    assert bad_dev == bad and sum(bad) == 2
    for i, (a, b) in enumerate(zip(sums_dev, sums, strict=True)):
        if bad[i]:
            continue  # a non-finite tensor's sums are not used
        np.testing.assert_array_equal(
            np.asarray(a, np.float64).view(np.uint64),
            np.asarray(b, np.float64).view(np.uint64),
            f"chunk sums {i}",
        )
    scales = [0.0 if b else 0.25 + i / 64 for i, b in enumerate(bad)]
    bodies = s.cpu.efsign_encode_segments(xs, es, scales, bad)
    bodies_dev = s.backend.efsign_encode_segments(xs_dev, es_dev, scales, bad)
    for i, (b, w) in enumerate(zip(bodies_dev, bodies, strict=True)):
        assert_same_bytes(b, w, f"EF body {i}")
        np.testing.assert_array_equal(bits(es_dev[i]), bits(es[i]), f"residual {i}")
    # decode: the EF bodies at gaps in a frame, one of them with a padding bit set
    keep = [i for i, b in enumerate(bad) if not b]
    frame, starts = gapped_frame([bodies[i] for i in keep], 25, 9)
    ns = np.array([xs[i].numel() for i in keep], np.int64)
    sc = np.array([scales[i] for i in keep], np.float32)
    bases = [make_input(int(n), "dense", gen) for n in ns]
    padded = int(np.flatnonzero((ns % 8 != 0) & (ns > 100))[0])
    for corrupt in (False, True):
        src = frame.clone()
        if corrupt:
            src[int(starts[padded] + (ns[padded] + 7) // 8 - 1)] |= 0x80
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            failed = s.backend.sign_decode_segments(where, starts, ns, sc, outs)
            cfailed = s.cpu.sign_decode_segments(src, starts, ns, sc, couts)
            assert (failed is None) == (cfailed is None) == (not corrupt)
            if corrupt:
                assert failed[0] == cfailed[0] == padded and "padding" in failed[1]
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits(o), bits(c), f"decode output {p}")


def check_terngrad_segments(s: Setup) -> None:
    """TernGrad's bucket encode (one launch sequence) gives the CPU backend's bodies and
    scales, None for the non-finite tensors, over a bucket with runs at tensor ends."""
    gen = torch.Generator().manual_seed(26)
    xs = make_bucket(gen)
    xs[8][0] = float("inf")
    keys = [(2**64 - 1 - 977 * i) % 2**64 for i in range(len(xs))]
    want = s.cpu.terngrad_encode_segments(xs, keys)
    got = s.backend.terngrad_encode_segments([x.to(s.dev, copy=True) for x in xs], keys)
    assert [g is None for g in got] == [w is None for w in want]
    assert sum(w is None for w in want) == 2
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is not None:
            assert g[1] == w[1], f"scale {i}"
            assert_same_bytes(g[0], w[0], f"body {i}")


def check_qsgd_segments(s: Setup, levels: int = 16, bucket: int = 64) -> None:
    """QSGD's bucket calls give the CPU backend's bodies (None for non-finite tensors) and
    sums; a refused body (a negative norm, a set padding bit, a level above the levels)
    stops the decode at its index with ``qsgd_decode``'s message, the ones before it
    added, it and the ones after it untouched."""
    from hvdcompress.codecs import quant

    bits = quant.qsgd_bits(levels)
    gen = torch.Generator().manual_seed(27)
    xs = make_bucket(gen)
    keys = [(12345 + 7919 * i) % 2**64 for i in range(len(xs))]
    want = s.cpu.qsgd_encode_segments(xs, levels, bits, bucket, keys)
    got = s.backend.qsgd_encode_segments(
        [x.to(s.dev, copy=True) for x in xs], levels, bits, bucket, keys
    )
    assert [g is None for g in got] == [w is None for w in want]
    assert sum(w is None for w in want) == 1
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is not None:
            assert_same_bytes(g, w, f"QSGD body {i}")
    keep = [i for i, w in enumerate(want) if w is not None and xs[i].numel()]
    frame, starts = gapped_frame([want[i] for i in keep], 27, 9)
    ns = np.array([xs[i].numel() for i in keep], np.int64)
    bases = [make_input(int(n), "dense", gen) for n in ns]
    padded = np.flatnonzero((ns * bits) % 8 != 0)  # none when bits == 8
    target = int(padded[-1]) if len(padded) else int(np.argmax(ns))
    nb = (int(ns[target]) + bucket - 1) // bucket
    cases = ("none", "norm", "padding", "code") if len(padded) else ("none", "norm", "code")
    for what in cases:
        src = frame.clone()
        at = int(starts[target])
        if what == "norm":  # the last norm -1.0 (past the groups when bucket < 8)
            last = at + 4 * (nb - 1)
            src[last : last + 4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8)
        elif what == "padding":
            src[at + len(want[keep[target]]) - 1] |= 0x80
        elif what == "code":  # a zero level with the sign bit: code 1
            src[at + 4 * nb] = (int(src[at + 4 * nb]) & ~((1 << bits) - 1)) | 1
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            failed = s.backend.qsgd_decode_segments(where, starts, ns, levels, bits, bucket, outs)
            cfailed = s.cpu.qsgd_decode_segments(src, starts, ns, levels, bits, bucket, couts)
            assert (failed is None) == (cfailed is None) == (what == "none"), what
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits_of(o), bits_of(c), f"{what} output {p}")
            if failed is None:
                continue
            assert failed[0] == cfailed[0] == target, what
            body = src[at:][: len(want[keep[target]])]
            out = torch.zeros(int(ns[target]), device=s.dev)
            with pytest.raises(PayloadError) as exc:  # the per-payload decoder's message
                one.qsgd_decode(
                    s.backend,
                    body.to(s.dev, copy=True),
                    int(ns[target]),
                    levels,
                    bits,
                    bucket,
                    out,
                    True,
                )
            assert failed[1] == exc.value.detail, what


def _dqsg_bodies(got, want, xs, keys, gen, seed: int):
    """The device's DQSG bodies equal the CPU's (None for the one non-finite tensor); the
    finite ones in a gapped frame: (frame, starts, lens, ns, keys, bases to add into)."""
    assert [g is None for g in got] == [w is None for w in want]
    assert sum(w is None for w in want) == 1
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is not None:
            assert_same_bytes(g, w, f"DQSG body {i}")
    keep = [i for i, w in enumerate(want) if w is not None]
    frame, starts = gapped_frame([want[i] for i in keep], seed, 9)
    lens = np.array([want[i].numel() for i in keep], np.int64)
    ns = np.array([xs[i].numel() for i in keep], np.int64)
    bases = [make_input(int(n), "dense", gen) for n in ns]
    return frame, starts, lens, ns, [keys[i] for i in keep], bases


def _dqsg_break(what: str, src, src_lens, target: int, at: int, nb: int) -> None:
    """The breaks of both DQSG body forms (in place): a body one byte short of its deltas
    ("short") or one byte long ("long"), its last delta -1.0 ("delta")."""
    if what == "short":
        src_lens[target] = 4 * nb - 1
    elif what == "long":
        src_lens[target] += 1
    elif what == "delta":
        last = at + 4 * (nb - 1)
        src[last : last + 4] = torch.tensor([0, 0, 128, 191], dtype=torch.uint8)


def check_dqsg_segments(s: Setup, levels: int = 3, bucket: int = 64) -> None:
    """DQSG's bucket calls (s > 1) give the CPU backend's bodies and sums; a refused body
    (a short or long body, a negative delta, a set padding bit, a code above 2 s) stops
    the decode at its index with the CPU backend's error code, the ones before it added."""
    from hvdcompress.codecs import dqsg

    bits = dqsg.dqsg_bits(levels)
    gen = torch.Generator().manual_seed(28)
    xs = make_bucket(gen)
    keys = [(99991 * i + 5) % 2**64 for i in range(len(xs))]
    want = s.cpu.dqsg_encode_segments(xs, keys, levels, bits, bucket)
    got = s.backend.dqsg_encode_segments(
        [x.to(s.dev, copy=True) for x in xs], keys, levels, bits, bucket
    )
    frame, starts, lens, ns, ks, bases = _dqsg_bodies(got, want, xs, keys, gen, 28)
    padded = np.flatnonzero((ns * bits) % 8 != 0)
    target = int(padded[-1]) if len(padded) else int(np.argmax(ns))
    nb = (int(ns[target]) + bucket - 1) // bucket
    cases = ["none", "short", "long", "delta", "code"] + (["padding"] if len(padded) else [])
    for what in cases:
        src, src_lens = frame.clone(), lens.copy()
        at = int(starts[target])
        _dqsg_break(what, src, src_lens, target, at, nb)
        if what == "padding":
            src[at + int(lens[target]) - 1] |= 0x80
        elif what == "code":  # the first code all ones: above 2 s unless 2 s + 1 = 2^bits
            src[at + 4 * nb] |= (1 << bits) - 1
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            args = (starts, src_lens, ns, ks, levels, bits, bucket)
            failed = s.backend.dqsg_decode_segments(where, *args, outs)
            cfailed = s.cpu.dqsg_decode_segments(src, *args, couts)
            assert failed == cfailed, (what, failed, cfailed)
            if what != "none" and (what != "code" or 2 * levels + 1 < 1 << bits):
                assert failed is not None and failed[0] == target, (what, failed)
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits_of(o), bits_of(c), f"{what} output {p}")


def check_dqsg_ternary_segments(s: Setup, bucket: int = 64) -> None:
    """DQSG's bucket calls with s = 1 (deltas, then quartic + zero-run coded digits) give
    the CPU's digit coder's bodies and sums; a refused body (short, long, a negative delta,
    a literal byte made a run code, a run code past the end) stops the decode at the same
    index as the CPU's, the ones before it added, alike."""
    from hvdcompress.codecs import dqsg

    gen = torch.Generator().manual_seed(29)
    xs = make_bucket(gen)
    keys = [(7919 * i + 3) % 2**64 for i in range(len(xs))]
    want = s.cpu.digits_encode_segments(xs, keys, 1, 0, 0, bucket)[0]
    got = s.backend.dqsg_encode_segments(
        [x.to(s.dev, copy=True) for x in xs], keys, 1, dqsg.dqsg_bits(1), bucket
    )
    frame, starts, lens, ns, ks, bases = _dqsg_bodies(got, want, xs, keys, gen, 29)
    target = int(np.argmax(ns))
    nb = (int(ns[target]) + bucket - 1) // bucket
    at, zre_at = int(starts[target]), int(starts[target]) + 4 * nb
    coded = frame[zre_at : at + int(lens[target])].numpy()
    literal = zre_at + int(np.flatnonzero(coded <= 242)[0])
    cases = ["none", "short", "long", "delta", "run", "last run"]
    for what in cases:
        src, src_lens = frame.clone(), lens.copy()
        _dqsg_break(what, src, src_lens, target, at, nb)
        if what == "run":  # a literal made a run of 14 zero groups: too many bytes
            src[literal] = 255
        elif what == "last run":
            src[at + int(lens[target]) - 1] = 255
        args = (starts, src_lens, ns, ks)
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            failed = s.backend.dqsg_decode_segments(where, *args, 1, 2, bucket, outs)
            cfailed = s.cpu.digits_decode_segments(src, *args, bucket, couts)[1]
            assert (failed is None) == (cfailed is None), (what, failed, cfailed)
            if what != "none":
                assert failed[0] == cfailed[0] == target, (what, failed, cfailed)
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits_of(o), bits_of(c), f"{what} output {p}")


def check_nested_segments(s: Setup, fine: int = 3, rho: int = 3, bucket: int = 64) -> None:
    """NDQSG's nested code as bucket calls: the encode (DQSG's q at s = ``fine``, their
    cosets in rho Z, quartic + zero-run coded for rho <= 3, else packed codes) gives the
    CPU's bodies and fine indices; the decode with the gather path's side information
    (outs / 2) adds what the CPU's adds and counts the same aliased indices against the
    bodies' own k (given for every other body); a refused body (short, long, a negative
    delta, and a code above 2 (rho // 2) for packed codes) stops the decode at the same
    index, the ones before it added, alike."""
    from hvdcompress.codecs import ndqsg

    gen = torch.Generator().manual_seed(39)
    xs = make_bucket(gen)
    keys = [(7927 * i + 5) % 2**64 for i in range(len(xs))]
    bits = ndqsg.m_bits(rho)
    want, wks = s.cpu.digits_encode_segments(xs, keys, fine, rho, bits, bucket)
    got, gks = s.backend.digits_encode_segments(
        [x.to(s.dev, copy=True) for x in xs], keys, fine, rho, bits, bucket
    )
    frame, starts, lens, ns, ks, bases = _dqsg_bodies(got, want, xs, keys, gen, 39)
    finite = [i for i, w in enumerate(want) if w is not None]
    firsts = np.cumsum([x.numel() for x in xs]) - np.array([x.numel() for x in xs])
    for i in finite:  # the fine indices of the finite tensors (the NaN one's are unused)
        a, n = int(firsts[i]), xs[i].numel()
        np.testing.assert_array_equal(gks[a : a + n].cpu().numpy(), wks[a : a + n].numpy())
    own = [wks[int(firsts[i]) :][: xs[i].numel()] for i in finite]
    k_trues = [k if p % 2 == 0 else None for p, k in enumerate(own)]
    dk_trues = [None if k is None else k.to(s.dev, copy=True) for k in k_trues]
    target = int(np.argmax(ns))
    nb = (int(ns[target]) + bucket - 1) // bucket
    at = int(starts[target])
    cases = ["none", "short", "long", "delta"] + (["code"] if rho > 3 else [])
    for what in cases:
        src, src_lens = frame.clone(), lens.copy()
        _dqsg_break(what, src, src_lens, target, at, nb)
        if what == "code":  # the first code all ones: above 2 (rho // 2)
            src[at + 4 * nb] |= (1 << bits) - 1
        args = (starts, src_lens, ns, ks, bucket)
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            aliased, failed = s.backend.digits_decode_segments(
                where, *args, outs, rho, bits, 2, dk_trues
            )
            caliased, cfailed = s.cpu.digits_decode_segments(
                src, *args, couts, rho, bits, 2, k_trues
            )
            assert (failed is None) == (cfailed is None), (what, failed, cfailed)
            if what != "none":
                assert failed[0] == cfailed[0] == target, (what, failed, cfailed)
            else:
                assert caliased.sum() > 0  # the side information is far: indices alias
            np.testing.assert_array_equal(aliased, caliased, f"{what} aliasing counts")
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits_of(o), bits_of(c), f"{what} output {p}")


def check_topk_segments(s: Setup, ratio: float = 0.05, reference=None, signs: bool = False) -> None:
    """Top-k bodies (top-k's, DGC's and GSpar's layout; with ``signs`` top-k + sign's)
    decoded as one launch sequence add what the CPU's bucket decoder adds; a refused body
    (an index outside [0, n), one out of order, one with a high byte set, a value or m
    not finite, m negative, a sign padding bit) stops the decode at the same index, the
    ones before it added, alike. ``reference(frame, starts, ks, ns, outs)``: the decoder
    to compare with (the CPU backend's by default)."""
    from hvdcompress.codecs import sparse

    gen = torch.Generator().manual_seed(33)
    xs = [x.nan_to_num(0.0) for x in make_bucket(gen)]
    ns = np.array([x.numel() for x in xs], np.int64)
    ks = np.array([sparse.topk_count(int(n), ratio) for n in ns], np.int64)
    encode = sparse.topk_sign_encode if signs else sparse.topk_encode
    bodies = [encode(x, int(k))[0] for x, k in zip(xs, ks, strict=True)]
    frame, starts = gapped_frame(bodies, 33, 9)
    decoder = "topkq_decode_segments" if signs else "topk_decode_segments"
    reference = reference or getattr(s.cpu, decoder)
    bases = [make_input(int(n), "dense", gen) for n in ns]
    target = int(np.argmax(ks * (ks % 8 != 0)))  # the most values, with sign padding
    k, n = int(ks[target]), int(ns[target])
    isz = sparse.index_dtype(n).itemsize
    at = int(starts[target])
    idx_at = at + (4 if signs else 4 * k)
    nan = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)
    cases = ["none", "index", "high", "negative", "order", "value"]
    cases += ["negative m", "padding", "m of no values"] if signs else []
    for what in cases:
        src, expect = frame.clone(), target
        if what == "m of no values":  # checked even where k = 0
            expect = int(np.flatnonzero(ks == 0)[0])
            src[int(starts[expect]) :][:4] = nan
        elif what == "high":  # the first index plus 2^32 (int64) or 2^24 (int32): outside
            src[idx_at + (4 if isz == 8 else 3)] += 1
        elif what == "index":  # the last index n
            src[idx_at + isz * (k - 1) :][:isz] = torch.tensor(
                list(n.to_bytes(isz, "little")), dtype=torch.uint8
            )
        elif what == "negative":  # the first index -1
            src[idx_at:][:isz] = 255
        elif what == "order":  # the second index the first's
            src[idx_at + isz :][:isz] = src[idx_at:][:isz].clone()
        elif what == "value":  # a value NaN (top-k + sign: m)
            src[at + (0 if signs else 4 * (k // 2)) :][:4] = nan
        elif what == "negative m":
            src[at + 3] |= 0x80
        elif what == "padding":  # the last sign byte's top bit
            src[at + int(bodies[target].numel()) - 1] |= 0x80
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            failed = getattr(s.backend, decoder)(where, starts, ks, ns, outs)
            cfailed = reference(src, starts, ks, ns, couts)
            assert (failed is None) == (cfailed is None), (what, failed, cfailed)
            if what != "none":
                assert failed[0] == cfailed[0] == expect, (what, failed, cfailed)
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits_of(o), bits_of(c), f"{what} output {p}")


def topk_encode_per_tensor(gs, es, ks, us=None, momentum: float = 0.0, signs: bool = False):
    """``topk_encode_segments``' reference: ``TopK.encode``'s (``DGC.encode``'s with the
    velocities ``us``, ``TopKSign.encode``'s with ``signs``) steps on each tensor, the
    codec's per-tensor calls."""
    from hvdcompress.codecs import primitives as prim
    from hvdcompress.codecs import sparse

    bodies, nonfinite = [], []
    for i, (g, e, k) in enumerate(zip(gs, es, ks, strict=True)):
        u = None if us is None else us[i]
        if u is not None:
            bad = sparse.momentum_update(g, u, e, momentum)
        else:
            bad = g.numel() > 0 and not prim.sum_finite(g, e)
            if not bad:
                e.add_(g)
        nonfinite.append(bool(bad))
        if bad:
            bodies.append(torch.empty(0, dtype=torch.uint8))
        elif signs:
            body, idx, m = sparse.topk_sign_encode(e, k)
            e[idx] -= sparse.topk_sign_values(m, e[idx] < 0)
            bodies.append(body)
        else:
            body, idx = sparse.topk_encode(e, k)
            e[idx] = 0.0
            if u is not None:
                u[idx] = 0.0
            bodies.append(body)
    return bodies, nonfinite


def topk_sign_encode_on(backend, device_type: str):
    """The codec's ``topk_sign_encode_segments`` (two launch sequences or native calls,
    the magnitudes rounded between on the host) with ``backend`` serving ``device_type``."""
    from unittest import mock

    from hvdcompress import backends
    from hvdcompress.codecs import sparse

    def encode(gs, es, ks, us=None, momentum=0.0):
        assert us is None
        with mock.patch.dict(backends._BACKENDS, {device_type: backend}):
            return sparse.topk_sign_encode_segments(gs, es, ks)

    return encode


def check_topk_encode_segments(
    s: Setup,
    ratio: float = 0.05,
    momentum: float | None = None,
    reference=None,
    signs: bool = False,
) -> None:
    """Top-k's bucket encode as one launch sequence (kernels/sparse.cu: every segment's
    radix select at once, no read before the last launch) gives the CPU's bodies,
    non-finite flags and residuals (DGC, ``momentum`` set: and velocities; top-k + sign
    with ``signs``: two launch sequences, one read between), step after step with error
    feedback built up. The bucket has empty tensors, a NaN, all-zero tensors and repeated
    values (ties at the threshold), a tensor with k = 0, and k = n at ratio 1.
    ``reference(gs, es, ks, us, momentum)``: the encoder to compare with (the CPU
    backend's by default)."""
    from hvdcompress.codecs import sparse

    gen = torch.Generator().manual_seed(37)
    xs = make_bucket(gen)
    ks = [sparse.topk_count(x.numel(), ratio) for x in xs]
    ks[6] = 0  # a tensor of 7 elements that sends nothing: its a still becomes g + e
    if signs:
        reference = reference or topk_sign_encode_on(s.cpu, "cpu")
        encode = topk_sign_encode_on(s.backend, s.dev.type)
    else:
        reference = reference or s.cpu.topk_encode_segments
        encode = s.backend.topk_encode_segments
    es = [torch.zeros_like(x) for x in xs]
    us = None if momentum is None else [torch.zeros_like(x) for x in xs]
    des = [e.to(s.dev, copy=True) for e in es]
    dus = None if us is None else [u.to(s.dev, copy=True) for u in us]
    m = 0.0 if momentum is None else momentum
    for step in range(3):
        gs = [x * (step + 1) for x in xs]
        want, wbad = reference(gs, es, ks, us, m)
        got, gbad = encode([g.to(s.dev, copy=True) for g in gs], des, ks, dus, m)
        assert gbad == wbad and sum(wbad) == 1, (gbad, wbad)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(g, w, f"step {step} body {i}")
        for what, dev_side, host_side in (("residual", des, es), ("velocity", dus, us)):
            for i, (d, h) in enumerate(zip(dev_side or [], host_side or [], strict=True)):
                np.testing.assert_array_equal(bits(d), bits(h), f"step {step} {what} {i}")


def check_randomk_encode_segments(s: Setup, ratio: float = 0.1, ef: bool = True) -> None:
    """Random-k's bucket encode as one launch sequence gives the CPU's bodies and
    non-finite flags and, with error feedback, its residuals, step after step."""
    from hvdcompress.codecs import sparse

    gen = torch.Generator().manual_seed(36)
    threshold = sparse.randomk_threshold(ratio)
    xs = make_bucket(gen)
    es = [torch.zeros_like(x) for x in xs] if ef else None
    des = [e.to(s.dev, copy=True) for e in es] if ef else None
    for step in range(3):
        gs = [x * (step + 1) for x in xs]
        keys = [(7 * step + 104723 * i) % 2**64 for i in range(len(gs))]
        want, wbad = s.cpu.randomk_encode_segments(gs, keys, threshold, es)
        got, gbad = s.backend.randomk_encode_segments(
            [g.to(s.dev, copy=True) for g in gs], keys, threshold, des
        )
        assert gbad == wbad and sum(wbad) == 1, (gbad, wbad)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(g, w, f"step {step} body {i}")
        for i, (de, e) in enumerate(zip(des or [], es or [], strict=True)):
            np.testing.assert_array_equal(bits(de), bits(e), f"step {step} residual {i}")


def check_gspar_encode_segments(s: Setup, ratio: float = 0.1, ef: bool = True) -> None:
    """GSpar's bucket encode (kernels/sparse.cu, "GSpar's buckets": every tensor's scale iteration
    at once, a read a round) gives the CPU's bodies, non-finite flags and, with error
    feedback, residuals, step after step; at ratio 1 a tensor's budget reaches its
    non-zero count and every non-zero entry is kept. Spikes (every 37th entry of the big
    tensors times 1000) saturate at the first scale, so the iteration takes rounds."""
    from hvdcompress.codecs import sparse

    gen = torch.Generator().manual_seed(38)
    xs = make_bucket(gen)
    for x in xs[-5:-3]:
        x[::37] *= 1000.0
    budgets = [ratio * x.numel() for x in xs]
    es = [torch.zeros_like(x) for x in xs] if ef else None
    des = [e.to(s.dev, copy=True) for e in es] if ef else None
    for step in range(3):
        gs = [x * (step + 1) for x in xs]
        keys = [(11 * step + 104729 * i) % 2**64 for i in range(len(gs))]
        want, wbad = s.cpu.gspar_encode_segments(gs, keys, budgets, sparse.GSPAR_CHUNK, es)
        got, gbad = s.backend.gspar_encode_segments(
            [g.to(s.dev, copy=True) for g in gs], keys, budgets, sparse.GSPAR_CHUNK, des
        )
        assert gbad == wbad and sum(wbad) == 1, (gbad, wbad)
        assert all(w is not None for w in want)  # no tensor left to the per-tensor path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(g, w, f"step {step} body {i}")
        for i, (de, e) in enumerate(zip(des or [], es or [], strict=True)):
            np.testing.assert_array_equal(bits(de), bits(e), f"step {step} residual {i}")


def check_randomk_segments(s: Setup, ratio: float = 0.1, scale: float = 1.0) -> None:
    """Random-k bodies decoded as one launch sequence (kept flags regenerated, one scan,
    counts and values checked, one read, one add) add what the CPU's bucket decoder adds;
    a refused body (one value short or long, a NaN value, a body of an empty tensor)
    stops the decode at the same index with the same code, the ones before it added."""
    from hvdcompress.codecs import sparse

    gen = torch.Generator().manual_seed(35)
    xs = [x.nan_to_num(0.0) for x in make_bucket(gen)]
    ns = np.array([x.numel() for x in xs], np.int64)
    keys = [(104729 * i + 11) % 2**64 for i in range(len(xs))]
    threshold = sparse.randomk_threshold(ratio)
    bodies = [
        one.randomk_encode(s.cpu, x, key, threshold, None).view(torch.uint8)
        for x, key in zip(xs, keys, strict=True)
    ]
    frame, starts = gapped_frame(bodies, 35, 9)
    lens = np.array([b.numel() for b in bodies], np.int64)
    bases = [make_input(int(n), "dense", gen) for n in ns]
    target = int(np.argmax(lens))
    empty = int(np.flatnonzero(ns == 0)[0])
    for what in ["none", "short", "long", "value", "empty"]:
        src, src_lens, expect = frame.clone(), lens.copy(), target
        if what == "short":
            src_lens[target] -= 4
        elif what == "long":
            src_lens[target] += 4
        elif what == "value":
            at = int(starts[target]) + 4 * (int(lens[target]) // 8)
            src[at : at + 4] = torch.tensor([0, 0, 192, 127], dtype=torch.uint8)
        elif what == "empty":  # four bytes for a tensor of no elements
            src_lens[empty], expect = 4, empty
        for on_device in (False, True):
            outs = [b.to(s.dev, copy=True) for b in bases]
            couts = [b.clone() for b in bases]
            where = src.to(s.dev, copy=True) if on_device else src
            args = (starts, src_lens, ns, keys, threshold, scale)
            failed = s.backend.randomk_decode_segments(where, *args, outs)
            cfailed = s.cpu.randomk_decode_segments(src, *args, couts)
            assert failed == cfailed, (what, failed, cfailed)
            if what != "none":
                assert failed[0] == expect, (what, failed)
            for p, (o, c) in enumerate(zip(outs, couts, strict=True)):
                np.testing.assert_array_equal(bits_of(o), bits_of(c), f"{what} output {p}")


def _with_checksum(buf: bytearray) -> bytearray:
    """``buf`` with its checksum field recomputed whatever its header says: a layout the
    scan must refuse on its own, not for the checksum."""
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = bytes(4)
    csum = wire.checksum_numpy(np.frombuffer(bytes(buf), dtype=np.uint8), 0)
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = csum.to_bytes(4, "little")
    return buf


_WRAPS = (6148914591020613667, 8589934595, 1)  # product = 2863311485 * 2^64 + 105
# Header edits (offset, little-endian bytes) that each break one rule of the layout (of a
# payload of shape (3, 5, 7)).
_LAYOUT_BREAKS = {
    "magic": (0, b"HVDX"),
    "version": (4, b"\x02"),
    "reserved": (9, b"\x01"),
    "ndim 9": (8, b"\x09"),
    "params_len 257": (10, (257).to_bytes(2, "little")),
    "params past the end": (10, (60000).to_bytes(2, "little")),
    "numel": (16, (12345).to_bytes(8, "little")),
    "body_len": (24, (2**64 - 1).to_bytes(8, "little")),
    "shape past 2^63": (32, (2**63).to_bytes(8, "little")),
    # dimensions whose product passes 2^64 and wraps to the payload's numel, 3 * 5 * 7
    "shape wraps 2^64": (32, b"".join(d.to_bytes(8, "little") for d in _WRAPS)),
}


def frame_scan_cases() -> list[tuple[str, torch.Tensor, int]]:
    """(what, frame, count): a 3LC bucket's frame and frames each broken in one way the
    scan must see (a payload's body byte or checksum, each header rule, the length table),
    among payloads of one, two and three dimensions."""
    gen = torch.Generator().manual_seed(31)
    grads = make_bucket(gen) + [torch.randn(3, 5, 7, generator=gen), torch.zeros(0)]
    names = [f"layer{i}" for i in range(len(grads))]
    comp = hvdcompress.get_compressor("3lc")
    framing.compress_bucket(comp, grads, names)  # a second step: error feedback built up
    frame, _ = framing.compress_bucket(comp, grads, names)
    count = len(grads)
    payloads = wire.unframe(frame, count, 0, names)
    cases = [("good", frame, count)]

    def remade(i: int, buf: bytearray) -> torch.Tensor:
        parts = list(payloads)
        parts[i] = torch.frombuffer(bytearray(buf) or bytearray(1), dtype=torch.uint8)[: len(buf)]
        return wire.frame(parts)

    last = count - 2  # the payload of shape (3, 5, 7)
    body = bytearray(payloads[1].numpy().tobytes())
    body[-1] ^= 0x10
    cases.append(("a body byte", remade(1, body), count))
    stored = bytearray(payloads[2].numpy().tobytes())
    stored[wire.CHECKSUM_OFFSET + 3] ^= 0x80
    cases.append(("the checksum field", remade(2, stored), count))
    for what, (offset, value) in _LAYOUT_BREAKS.items():
        buf = bytearray(payloads[last].numpy().tobytes())
        buf[offset : offset + len(value)] = value
        cases.append((what, remade(last, _with_checksum(buf)), count))
    short = bytearray(payloads[0].numpy().tobytes()[:20])
    cases.append(("a 20-byte payload", remade(0, short), count))
    cases.append(("an empty payload", remade(0, bytearray()), count))
    raw = frame.numpy().tobytes()
    cases.append(("count word", frame, count - 1))
    cases.append(
        ("a trailing byte", torch.frombuffer(bytearray(raw + b"\0"), dtype=torch.uint8), count)
    )
    cases.append(("truncated", frame[:-1].clone(), count))
    long_len = bytearray(raw)
    long_len[8:16] = (2**63 + 5).to_bytes(8, "little")
    cases.append(("a length past the frame", torch.frombuffer(long_len, dtype=torch.uint8), count))
    cases.append(("empty frame", torch.zeros(0, dtype=torch.uint8), 0))
    cases.append(("no payloads", torch.zeros(8, dtype=torch.uint8), 0))
    return cases


def check_frame_scan(s: Setup, cases=None) -> None:
    """The backend's ``frame_scan`` of a frame on its device, at an aligned address and at
    an odd one (a rank's frame is a slice of the gathered bytes), reports what the CPU's
    reports of the same bytes: None for a refused length table, else every payload's
    fields, shape and (where accepted) codec parameters."""
    for what, frame, count in cases if cases is not None else frame_scan_cases():
        want = s.cpu.frame_scan(frame, count)
        if what == "good":
            assert bool(want.fields[:, wire.SCAN["ok"]].all())
        elif what not in ("no payloads", "fuzzed"):  # each named break is refused
            assert want is None or not bool(want.fields[:, wire.SCAN["ok"]].all()), what
        lead = torch.full((3,), 0x55, dtype=torch.uint8)
        odd = torch.cat([lead, frame]).to(s.dev)[3:]
        for where in (frame.to(s.dev, copy=True), odd):
            got = s.backend.frame_scan(where, count)
            assert (got is None) == (want is None), what
            if want is None:
                continue
            np.testing.assert_array_equal(got.fields, want.fields, what)
            np.testing.assert_array_equal(got.shapes, want.shapes, what)
            assert got.params == want.params, what


def length_prefix_cases() -> list[tuple[str, torch.Tensor, int]]:
    """(what, gathered bytes, ranks): HorovodTransport's allgather framing, whole and
    broken (a missing prefix, a short part, trailing bytes, a prefix past 2^63)."""
    from hvdcompress.transports.horovod import _LEN

    gen = torch.Generator().manual_seed(3)
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (5, 0, 300)]
    good = torch.cat(
        [
            torch.cat([torch.frombuffer(bytearray(_LEN.pack(p.numel())), dtype=torch.uint8), p])
            for p in parts
        ]
    )
    huge = good.clone()
    huge[:8] = torch.frombuffer(bytearray(_LEN.pack(2**63 + 1)), dtype=torch.uint8)
    return [
        ("good", good, 3),
        ("one rank", good[:13].clone(), 1),
        ("a prefix missing", good, 4),
        ("a short part", good[:-1].clone(), 3),
        ("trailing bytes", good, 2),
        ("a prefix past 2^63", huge, 3),
        ("nothing", good[:0].clone(), 0),
        ("nothing, one rank", good[:0].clone(), 1),
    ]


def check_length_prefixes(s: Setup) -> None:
    """The backend's ``length_prefixes`` of gathered bytes on its device gives the host's
    verdict (``length_prefix_verdict``) on the same bytes."""
    from hvdcompress.transports.horovod import length_prefix_verdict

    for what, buf, size in length_prefix_cases():
        want = length_prefix_verdict(buf.numpy(), size)
        got = s.backend.length_prefixes(buf.to(s.dev, copy=True), size)
        np.testing.assert_array_equal(got, want, what)
        assert (want[0] == 1) == (what in ("good", "one rank", "nothing")), what


@pytest.mark.gpu
def test_sign_segments_match_cpu(gpu):
    check_sign_segments(gpu)


# (compressor, params) of the bucket frame checks: each of SEGMENT_DECODER, and DQSG
# with s = 1 (its digit coder).
BUCKET_FRAME_CASES = [(name, {}) for name in sorted(SEGMENT_DECODER)] + [("dqsg", {"levels": 1})]
BUCKET_FRAME_IDS = [f"{n}{p}" for n, p in BUCKET_FRAME_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("name,params", BUCKET_FRAME_CASES, ids=BUCKET_FRAME_IDS)
def test_bucket_frames_match_cpu(gpu, name, params):
    check_bucket_frames(gpu, name, params=params)


@pytest.mark.gpu
def test_terngrad_segments_match_cpu(gpu):
    check_terngrad_segments(gpu)


@pytest.mark.gpu
def test_qsgd_segments_match_cpu(gpu):
    check_qsgd_segments(gpu)


@pytest.mark.gpu
def test_dqsg_segments_match_cpu(gpu):
    check_dqsg_segments(gpu)


@pytest.mark.gpu
def test_dqsg_ternary_segments_match_cpu(gpu):
    check_dqsg_ternary_segments(gpu)


@pytest.mark.gpu
def test_randomk_segments_match_cpu(gpu):
    check_randomk_segments(gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error_feedback"])
def test_randomk_encode_segments_match_cpu(gpu, ef):
    check_randomk_encode_segments(gpu, ef=ef)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [0.05, 1.0])
@pytest.mark.parametrize("momentum", [None, 0.9, 0.0], ids=["topk", "dgc", "dgc_no_momentum"])
def test_topk_encode_segments_match_cpu(gpu, ratio, momentum):
    check_topk_encode_segments(gpu, ratio, momentum)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [0.05, 1.0])
def test_topkq_encode_segments_match_cpu(gpu, ratio):
    check_topk_encode_segments(gpu, ratio, signs=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fine,rho", [(3, 3), (2, 2), (8, 8)])
def test_nested_segments_match_cpu(gpu, fine, rho):
    check_nested_segments(gpu, fine, rho)


@pytest.mark.gpu
@pytest.mark.parametrize("ef", [False, True], ids=["plain", "error_feedback"])
def test_gspar_encode_segments_match_cpu(gpu, ef):
    check_gspar_encode_segments(gpu, ef=ef)


@pytest.mark.gpu
@pytest.mark.parametrize("signs", [False, True], ids=["topk", "topkq"])
def test_topk_segments_match_cpu(gpu, signs):
    check_topk_segments(gpu, signs=signs)


@pytest.mark.gpu
def test_frame_of_device_payloads(gpu):
    """``wire.frame`` of payloads on the device (what ``bench_codec.py --overhead --device
    cuda`` builds one by one) is the host frame's bytes, on the device."""
    gen = torch.Generator().manual_seed(29)
    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (3, 0, 70)]
    framed = wire.frame([p.to(gpu.dev) for p in payloads])
    assert framed.device == gpu.dev
    assert_same_bytes(framed, wire.frame(payloads))


@pytest.mark.gpu
def test_frame_scan_matches_cpu(gpu):
    check_frame_scan(gpu)


@pytest.mark.gpu
def test_length_prefixes_match_host(gpu):
    check_length_prefixes(gpu)


_GATHER_EXAMPLES = [(n, p) for n, p in registry.examples() if not registry.REGISTRY[n].summable]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,params", _GATHER_EXAMPLES, ids=[f"{n}{p}" for n, p in _GATHER_EXAMPLES]
)
def test_frames_gathered_on_the_device_decode_as_on_the_host(gpu, name, params):
    """What a rank receives when the transport gathers on the GPU: a frame on the device,
    decoded into device outputs (on the device scan and the one-call decode where the
    compressor has them, else payload by payload), adds what the same bytes add on the
    host, for every gather-only compressor (rank 1's frame: side information too)."""
    gen = torch.Generator().manual_seed(41)
    shapes = [(5,), (33, 17), (0,), (513,), (4, 4, 4)]
    grads = [torch.randn(sh, generator=gen) for sh in shapes]
    names = [f"layer{i}" for i in range(len(grads))]
    sender = bound(name, 1, 2, **params)
    frame, ctxs = framing.compress_bucket(sender, [g.to(gpu.dev) for g in grads], names)
    assert frame.device == gpu.dev
    bases = [torch.linspace(-1, 1, g.numel()) for g in grads]
    want = [b.clone() for b in bases]
    host_ctxs = [c._replace(device=torch.device("cpu")) for c in ctxs]
    framing.decode_frame(bound(name, 0, 2, **params), frame.cpu(), want, host_ctxs, rank=1)
    outs = [b.to(gpu.dev) for b in bases]
    framing.decode_frame(bound(name, 0, 2, **params), frame, outs, ctxs, rank=1)
    for i, (out, ref) in enumerate(zip(outs, want, strict=True)):
        np.testing.assert_array_equal(bits(out), bits(ref), f"{name} output {i}")
