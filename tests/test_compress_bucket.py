"""The bucket-level API of the gather compressors (hvdcompress.compressors.base):
``compress_bucket`` gives one rank's frame of a bucket, byte for byte ``wire.frame`` of the
per-tensor payloads, with the same state updates (error-feedback residuals, step counters),
and ``decode_bucket`` (and ``decode_frame``, the frame in one native scan) accumulates
like ``decode_parsed`` of each payload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hvdcompress
from hvdcompress import framing, wire
from hvdcompress.compressors import registry
from hvdcompress.errors import PayloadError

GATHER_CASES = [
    (name, params) for name, params in registry.examples() if not registry.REGISTRY[name].summable
]


def bucket_tensors(step: int) -> tuple[list[torch.Tensor], list[str]]:
    """A bucket of mixed sizes and shapes: empty, single elements, odd sizes, a matrix,
    a float16 tensor, zeros, and (at step 1) a non-finite one."""
    gen = torch.Generator().manual_seed(step)
    tensors = [
        torch.randn(0, generator=gen),
        torch.randn(1, generator=gen),
        torch.randn(7, generator=gen),
        torch.randn(33, 17, generator=gen),
        torch.zeros(100),
        torch.randn(5003, generator=gen).to(torch.float16),
        torch.randn(513, generator=gen),
    ]
    if step == 1:
        tensors[6][100] = float("nan")
    return tensors, [f"layer{i}.weight" for i in range(len(tensors))]


@pytest.mark.parametrize("name,params", GATHER_CASES, ids=[f"{n}{p}" for n, p in GATHER_CASES])
def test_compress_bucket_is_the_frame_of_per_tensor_payloads(name, params):
    one_by_one = hvdcompress.get_compressor(name, **params)
    bucketed = hvdcompress.get_compressor(name, **params)
    for step in range(3):
        tensors, names = bucket_tensors(step)
        if one_by_one.supported_dtypes is not None:
            tensors = [t if t.dtype in one_by_one.supported_dtypes else t.float() for t in tensors]
        sent = [one_by_one.compress(t, n) for t, n in zip(tensors, names, strict=True)]
        frame, ctxs = framing.compress_bucket(bucketed, [t.clone() for t in tensors], names)
        assert torch.equal(frame, wire.frame([p for p, _ in sent])), f"{name} step {step}"
        assert ctxs == [ctx for _, ctx in sent]
        # decode_bucket == decode_parsed of each, accumulated, for a rank 0 and a rank 1
        parsed = wire.unframe_parsed(frame, 0, names, torch.device("cpu"))
        for rank in (0, 1):
            outs = [torch.linspace(-1, 1, t.numel()) for t in tensors]
            wants = [out.clone() for out in outs]
            framed = [out.clone() for out in outs]
            framing.decode_bucket(bucketed, parsed, outs, ctxs, rank=rank)
            framing.decode_frame(bucketed, frame, framed, ctxs, rank=rank)  # the one-call path
            for (header, payload), want, ctx in zip(parsed, wants, ctxs, strict=True):
                side = want / rank if one_by_one.uses_side_info and rank else None
                framing.decode_parsed(one_by_one,
                    header, payload, expect=ctx, name=ctx.name, out=want, accumulate=True,
                    side_info=side,
                )  # fmt: skip
            for out, want, got in zip(outs, wants, framed, strict=True):
                assert torch.equal(out.nan_to_num(7.0), want.nan_to_num(7.0))
                assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert one_by_one.state_dict().keys() == bucketed.state_dict().keys()


@pytest.mark.parametrize("name", ["efsignsgd", "terngrad", "dqsg"])
def test_compress_bucket_with_codec_threads(monkeypatch, name):
    """With codec threads, tensors big enough to be cut into parts leave the bucket's
    one-call encoder for the threaded per-tensor path: the frame does not change."""
    from hvdcompress.backends import cpu

    monkeypatch.setenv("HVDC_NUM_THREADS", "3")
    monkeypatch.setattr(cpu._library, "_MIN_PART", 64)
    one_by_one, bucketed = hvdcompress.get_compressor(name), hvdcompress.get_compressor(name)
    for step in range(2):
        tensors, names = bucket_tensors(step)
        tensors = [t.float() for t in tensors]
        assert any(cpu.splits(t.numel()) for t in tensors)
        assert not all(cpu.splits(t.numel()) for t in tensors)
        sent = [one_by_one.compress(t, n)[0] for t, n in zip(tensors, names, strict=True)]
        frame, _ = framing.compress_bucket(bucketed, [t.clone() for t in tensors], names)
        assert torch.equal(frame, wire.frame(sent)), f"{name} step {step}"


def test_compress_bucket_checks_names_and_dtypes():
    c = hvdcompress.get_compressor("signsgd")
    with pytest.raises(ValueError, match="names"):
        framing.compress_bucket(c, [torch.ones(3)], ["a", "b"])
    with pytest.raises(TypeError, match="dtype"):
        framing.compress_bucket(c, [torch.ones(3, dtype=torch.int32)], ["a"])
    frame, ctxs = framing.compress_bucket(c, [], [])
    assert torch.equal(frame, wire.frame([])) and ctxs == []


def test_decode_bucket_names_the_rank_and_tensor_of_a_corrupt_payload():
    c = hvdcompress.get_compressor("signsgd")
    tensors, names = [torch.randn(10), torch.randn(20)], ["a", "b"]
    frame, ctxs = framing.compress_bucket(c, tensors, names)
    frame[-1] ^= 0xFF  # the body of "b": its checksum fails
    parsed = wire.unframe_parsed(frame, 3, names, torch.device("cpu"))
    outs = [torch.zeros(10), torch.zeros(20)]
    with pytest.raises(PayloadError, match="checksum") as err:
        framing.decode_bucket(c, parsed, outs, ctxs, rank=3)
    assert err.value.rank == 3 and err.value.tensor == "b"
    assert torch.equal(outs[1], torch.zeros(20))


def test_decode_frame_names_the_rank_and_tensor_of_a_corrupt_payload():
    """The one-call path finds the bad checksum in its scan and takes the per-payload way:
    the same error, the earlier tensor decoded, the bad one's output untouched."""
    c = hvdcompress.get_compressor("3lc")
    tensors, names = [torch.randn(10), torch.randn(20)], ["a", "b"]
    frame, ctxs = framing.compress_bucket(c, tensors, names)
    frame[-1] ^= 0xFF
    outs = [torch.zeros(10), torch.zeros(20)]
    with pytest.raises(PayloadError, match="checksum") as err:
        framing.decode_frame(c, frame, outs, ctxs, rank=3)
    assert err.value.rank == 3 and err.value.tensor == "b"
    assert outs[0].abs().sum() > 0 and torch.equal(outs[1], torch.zeros(20))


def test_decode_frame_reports_a_forged_body_like_decode_parsed():
    """A body that passes every header check (checksum recomputed) but does not decode:
    the batched decoder stops at it with decode_parsed's error; the tensors before it are
    added, it is untouched."""
    c = hvdcompress.get_compressor("3lc")
    tensors, names = [torch.randn(10), torch.randn(20), torch.randn(30)], ["a", "b", "c"]
    frame, ctxs = framing.compress_bucket(c, tensors, names)
    payloads = wire.unframe(frame, 3, 0, names)
    forged = bytearray(payloads[1].numpy().tobytes())
    forged[-1] = 250  # a run byte past the end: zero-run decoding gives too many bytes
    forged[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = bytes(4)
    csum = wire.checksum_numpy(np.frombuffer(bytes(forged), np.uint8))
    forged[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = csum.to_bytes(4, "little")
    bad = wire.frame([payloads[0], torch.frombuffer(forged, dtype=torch.uint8), payloads[2]])
    outs = [torch.zeros(n) for n in (10, 20, 30)]
    with pytest.raises(PayloadError, match="zero-run") as err:
        framing.decode_frame(c, bad, outs, ctxs, rank=1)
    assert err.value.rank == 1 and err.value.tensor == "b" and err.value.field == "body"
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[1], torch.zeros(20)) and torch.equal(outs[2], torch.zeros(30))


def test_ndqsg_rank0_frame_takes_the_one_call_path(monkeypatch):
    """Rank 0's NDQSG frame gets no side information (decode_bucket gives it none), so its
    DQSG-mode bodies go through DQSG's batched decoder, with decode_bucket's sums; a nested
    frame decoded without side information raises "side_info" on both paths."""
    from hvdcompress.codecs import dqsg

    calls = []
    batched = dqsg.decode_segments
    monkeypatch.setattr(
        dqsg, "decode_segments", lambda *a, **k: calls.append(len(a[1])) or batched(*a, **k)
    )
    tensors, names = bucket_tensors(0)
    tensors = [t.float() for t in tensors]
    sender, receiver = hvdcompress.get_compressor("ndqsg"), hvdcompress.get_compressor("ndqsg")
    sender.bind(0, 2)
    receiver.bind(1, 2)
    frame, ctxs = framing.compress_bucket(sender, tensors, names)
    parsed = wire.unframe_parsed(frame, 0, names, torch.device("cpu"))
    wants = [torch.linspace(-1, 1, t.numel()) for t in tensors]
    gots = [w.clone() for w in wants]
    framing.decode_bucket(receiver, parsed, wants, ctxs, rank=0)
    assert calls == []  # the per-payload path
    framing.decode_frame(receiver, frame, gots, ctxs, rank=0)
    assert calls == [len(names)]
    assert all(torch.equal(g, w) for g, w in zip(gots, wants, strict=True))

    nested = hvdcompress.get_compressor("ndqsg")
    nested.bind(1, 2)
    frame, ctxs = framing.compress_bucket(nested, tensors, names)
    for decode in (
        lambda outs: framing.decode_frame(receiver, frame, outs, ctxs, rank=0),
        lambda outs: framing.decode_bucket(
            receiver, wire.unframe_parsed(frame, 0, names, torch.device("cpu")), outs, ctxs, rank=0
        ),
    ):
        outs = [torch.zeros(t.numel()) for t in tensors]
        with pytest.raises(PayloadError, match="side information") as err:
            decode(outs)
        assert err.value.field == "side_info" and err.value.tensor == names[0]
        assert all(not o.any() for o in outs)


@pytest.mark.parametrize("params", [{}, {"fine_levels": 8, "coarse_levels": 2}])
def test_ndqsg_gather_of_frames_equals_the_per_payload_path(params):
    """Four ranks (D = 2: ranks 0, 1 DQSG, 2, 3 nested), every frame decoded in rank order
    into running sums: decode_frame (nested frames in one native call, the side information
    out / rank formed in the same pass) gives decode_bucket's sums bit for bit and the same
    aliasing rates, the own one counted from this rank's remembered k (rank 3's tensors lie
    far from the others', so some of its values alias)."""
    tensors, names = bucket_tensors(0)
    tensors = [t.float() for t in tensors]
    gen = torch.Generator().manual_seed(9)
    per_rank = [
        [t + (4.0 if r == 3 else 0.05) * torch.randn(t.shape, generator=gen) for t in tensors]
        for r in range(4)
    ]
    senders = [hvdcompress.get_compressor("ndqsg", **params) for _ in range(4)]
    receivers = [hvdcompress.get_compressor("ndqsg", **params) for _ in range(2)]
    for r, c in enumerate(senders):
        c.bind(r, 4)
    for c in receivers:
        c.bind(3, 4)
    frames = [
        framing.compress_bucket(c, ts, names) for c, ts in zip(senders, per_rank, strict=True)
    ]
    for c in receivers:  # each remembers rank 3's k, as the sender did
        assert torch.equal(framing.compress_bucket(c, per_rank[3], names)[0], frames[3][0])
    fast = [torch.zeros(t.numel()) for t in tensors]
    slow = [torch.zeros(t.numel()) for t in tensors]
    for r, (frame, ctxs) in enumerate(frames):
        framing.decode_frame(receivers[0], frame, fast, ctxs, rank=r)
        parsed = wire.unframe_parsed(frame, r, names, torch.device("cpu"))
        framing.decode_bucket(receivers[1], parsed, slow, ctxs, rank=r)
    for got, want in zip(fast, slow, strict=True):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    got, want = receivers[0].pop_metrics(), receivers[1].pop_metrics()
    assert got == want
    assert got["aliasing_rate_own"] > 0 and got["aliasing_rate_estimate"] is not None
