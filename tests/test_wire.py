"""The wire format (hvdcompress.wire): every header field validated on its own, the
element count a header may claim, and the optimizer's framing of several payloads into
one collective buffer."""

import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.wire import PayloadError
from tests.fuzz.harness import fix_checksum
from tests.helpers import comp
from tests.reference import DESIGN_X


def test_header_fields_are_validated():
    c = comp("3lc")
    payload, _ = c.compress(torch.randn(50), "h")
    bad_values = {
        "magic": 0x00, "version": 9, "codec": 77, "flags": 0x80, "dtype": 9, "ndim": 9,
        "reserved": 1, "checksum": 0,
    }  # fmt: skip
    cases = {field: (wire.HEADER_FIELDS[field][0], v) for field, v in bad_values.items()}
    for field, (offset, value) in cases.items():
        bad = payload.clone()
        bad[offset] = value if bad[offset] != value else value + 1
        with pytest.raises(hvdcompress.PayloadError) as err:
            c.decode(bad)
        assert err.value.field == field, (field, str(err.value))
    with pytest.raises(hvdcompress.PayloadError, match="truncated"):
        c.decode(payload[:20])
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decode(payload[:-1])
    assert err.value.field == "body_len"


def test_header_claiming_too_many_elements():
    c = comp("3lc")
    payload, _ = c.compress(torch.randn(50), "h")
    header, raw = wire.read_header(payload)
    huge = wire.Header("3lc", 0, torch.float32, (2**40,), header.params, header.body_len)
    forged = torch.cat(
        [torch.frombuffer(bytearray(huge.pack()), dtype=torch.uint8), payload[header.size :]]
    )
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decode(forged)
    assert err.value.field == "numel"


def _forge(c, payload, shape, flags=None, body=None) -> torch.Tensor:
    """The payload with its header's shape (and numel) replaced, optionally its flags and
    body, checksum recomputed: a self-consistent forgery."""
    header, _ = wire.read_header(payload)
    body = payload[header.size :].numpy().tobytes() if body is None else body
    flags = header.flags if flags is None else flags
    forged = wire.Header(header.codec, flags, header.dtype, shape, header.params, len(body))
    return torch.frombuffer(fix_checksum(bytearray(forged.pack() + body)), dtype=torch.uint8)


def test_nonfinite_forgery_cannot_allocate_past_the_receivers_bound():
    """The issue's 48-byte payload: non-finite flag, empty body, 2**28 elements claimed
    (1 GiB of float32). Every decode refuses it before torch.full sees the shape."""
    c = comp("3lc")
    payload, ctx = c.compress(torch.tensor([1.0, float("nan")]), "h")
    assert wire.read_header(payload)[0].nonfinite
    for numel in (2**28, 2**24 + 1, 2**40, 2**63 - 1):
        forged = _forge(c, payload, (numel,))
        assert forged.numel() == 48
        for kwargs in ({}, {"expect": ctx}, {"out": torch.zeros(2)}, {"max_numel": 2**20}):
            with pytest.raises(PayloadError) as err:
                c.decode(forged, **kwargs)
            assert err.value.field in ("numel", "shape"), (kwargs, str(err.value))
    ok = _forge(c, payload, (2**10,))
    assert torch.isnan(c.decode(ok, max_numel=2**10)).all()
    with pytest.raises(PayloadError, match="more than the 1023"):
        c.decode(ok, max_numel=2**10 - 1)


def test_default_bound_and_its_environment_override(monkeypatch):
    c = comp("signsgd")
    payload, _ = c.compress(torch.randn(40), "s")
    at_default = _forge(c, payload, (wire.DEFAULT_MAX_DECODE_NUMEL,), flags=1, body=b"")
    over = _forge(c, payload, (wire.DEFAULT_MAX_DECODE_NUMEL + 1,), flags=1, body=b"")
    with pytest.raises(PayloadError, match="default bound") as err:
        c.decode(over)
    assert err.value.field == "numel"
    assert c.decode(at_default).numel() == wire.DEFAULT_MAX_DECODE_NUMEL
    monkeypatch.setenv(wire.MAX_DECODE_NUMEL_ENV, "39")
    with pytest.raises(PayloadError, match="more than the 39"):
        c.decode(payload)
    assert c.decode(payload, max_numel=40).shape == (40,)  # an explicit bound wins
    monkeypatch.setenv(wire.MAX_DECODE_NUMEL_ENV, "40")
    assert c.decode(payload).shape == (40,)
    monkeypatch.setenv(wire.MAX_DECODE_NUMEL_ENV, "lots")
    with pytest.raises(ValueError, match="must be an integer"):
        c.decode(payload)
    for bad, exc in ((-1, ValueError), (2**61, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(exc):
            c.decode(payload, max_numel=bad)


def test_shapes_torch_cannot_hold_are_payload_errors():
    """Empty shapes whose other dimensions multiply past int64 (torch's sizes) fail at
    the header, not in torch with a RuntimeError or an overflow TypeError."""
    c = comp("3lc")
    payload, _ = c.compress(torch.tensor([1.0, float("nan")]), "h")
    for shape in ((0, 2**63), (2**62, 4, 0), (0, 2**64 - 1), (2**32, 2**32, 0)):
        with pytest.raises(PayloadError) as err:
            c.decode(_forge(c, payload, shape))
        assert err.value.field == "shape"
    empty = c.decode(_forge(c, payload, (2**31, 0, 2**31)))  # holds: an empty tensor
    assert empty.shape == (2**31, 0, 2**31) and empty.numel() == 0


def test_out_of_another_size_is_a_payload_error_and_stays_untouched():
    c = comp("topk", ratio=0.5)
    payload, _ = c.compress(torch.randn(6), "t")
    out = torch.full((7,), 3.0)
    with pytest.raises(PayloadError) as err:
        c.decode(payload, out=out, accumulate=True)
    assert err.value.field == "numel" and bool((out == 3.0).all())
    with pytest.raises(ValueError, match="contiguous float32"):  # the caller's mistake
        c.decode(payload, out=torch.zeros(6, dtype=torch.float64))


def test_frame_roundtrip_and_malformed_frame_names_the_rank():
    parts = [torch.arange(n, dtype=torch.uint8) for n in (3, 0, 7)]
    frame = wire.frame(parts)
    back = wire.unframe(frame, 3, 0, ["a", "b", "c"])
    assert [torch.equal(a, b) for a, b in zip(parts, back, strict=True)] == [True] * 3
    with pytest.raises(PayloadError, match="from rank 2"):
        wire.unframe(frame[:-1], 3, 2, ["a", "b", "c"])
    with pytest.raises(PayloadError, match="expected 4"):
        wire.unframe(frame, 4, 1, ["a", "b", "c", "d"])


# Whole payloads, byte for byte (docs/wire-format.md, "Reference payloads"): header, codec
# parameters, checksum and body together pin the format.
RNG_FIELDS = "0000000000000000 0000000000000000 9e6b28a282509220 00000000"
W = [0.5, -1.0, 0.25, 0.0, 0.9]
TOPK_X = [0.5, -4.0, 1.0, 3.0, -0.25, 2.0]
REFERENCE_PAYLOADS = [
    (
        "3lc",
        {"sparsity": 1.0},
        DESIGN_X,
        (20,),
        "48564443 01 01 00 00 01 00 0800 bd9b660e 1400000000000000 0300000000000000"
        " 1400000000000000 0000803f cdcc4c3f c9 ca f3",
    ),
    (
        "3lc",
        {"sparsity": 1.5},
        DESIGN_X,
        (4, 5),
        "4856444301010000020008005bfbeeb2 1400000000000000 0200000000000000"
        " 0400000000000000 0500000000000000 0000c03f 9a99993f c9f4",
    ),
    (
        "3lc",
        {"sparsity": 1.0},
        [1.0, float("nan")],
        (2,),
        "485644430101010001000800d669415d 0200000000000000 0000000000000000"
        " 0200000000000000 0000803f 00000000",
    ),
    (
        "topk",
        {"ratio": 0.5},
        TOPK_X,
        (6,),
        "4856444301040000010008005be3acba 0600000000000000 1800000000000000"
        " 0600000000000000 000000000000e03f"
        " 000080c0 00004040 00000040 01000000 03000000 05000000",
    ),
    (
        "topkq",
        {"ratio": 0.5},
        TOPK_X,
        (6,),
        "48564443010b000001000800c98aee10 0600000000000000 1100000000000000"
        " 0600000000000000 000000000000e03f 00004040 01000000 03000000 05000000 01",
    ),
    (
        "terngrad",
        {},
        W,
        (5,),
        "4856444301080000010020002e9a9bc9 0500000000000000 0100000000000000"
        f" 0500000000000000 {RNG_FIELDS} 0000803f b9",
    ),
    (
        "qsgd",
        {"levels": 4, "bucket_size": 512},
        W,
        (5,),
        "48564443010700000100240074a0586b 0500000000000000 0700000000000000"
        f" 0500000000000000 {RNG_FIELDS} 04000000 00020000 0d7bba3f 720006",
    ),
    (
        "dqsg",
        {"levels": 1, "bucket_size": 512},
        W,
        (5,),
        "485644430102000001002400498429ff 0500000000000000 0500000000000000"
        f" 0500000000000000 {RNG_FIELDS} 01000000 00020000 0000803f 5f",
    ),
    (
        "dqsg",
        {"levels": 3, "bucket_size": 512},
        W,
        (5,),
        "4856444301020000010024009c2f60be 0500000000000000 0600000000000000"
        f" 0500000000000000 {RNG_FIELDS} 03000000 00020000 abaaaa3e c466",
    ),
    (
        "randomk",
        {"ratio": 0.5, "unbiased": True},
        W,
        (5,),
        "48564443010500000100250033fe3019 0500000000000000 0c00000000000000"
        f" 0500000000000000 {RNG_FIELDS} 000000000000e03f 01 0000003f 000080bf 0000803e",
    ),
]


@pytest.mark.parametrize(
    "name,params,values,shape,expected",
    REFERENCE_PAYLOADS,
    ids=[f"{n}-{'-'.join(map(str, p.values()))}-{s}" for n, p, _, s, _ in REFERENCE_PAYLOADS],
)
def test_reference_payloads_are_byte_exact(name, params, values, shape, expected):
    c = comp(name, **params)
    payload, ctx = c.compress(torch.tensor(values, dtype=torch.float32).view(shape), "w")
    assert payload.numpy().tobytes().hex() == expected.replace(" ", "")
    decoded = comp(name, **params).decode(payload, expect=ctx)
    assert decoded.shape == shape
