"""The wire format (hvdcompress.wire): every header field validated on its own, the
element count a header may claim, and the optimizer's framing of several payloads into
one collective buffer."""

import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.wire import PayloadError
from tests.helpers import comp
from tests.reference import DESIGN_X


def test_header_fields_are_validated():
    c = comp("3lc")
    payload, _ = c.compress(torch.randn(50), "h")
    cases = {
        "magic": (0, 0x00),
        "version": (4, 9),
        "codec": (5, 77),
        "flags": (6, 0x80),
        "dtype": (7, 9),
        "ndim": (8, 9),
        "reserved": (9, 1),
        "checksum": (12, 0),
    }
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
    header, raw = c.read_header(payload)
    huge = wire.Header("3lc", 0, torch.float32, (2**40,), header.params, header.body_len)
    forged = torch.cat(
        [torch.frombuffer(bytearray(huge.pack()), dtype=torch.uint8), payload[header.size :]]
    )
    with pytest.raises(hvdcompress.PayloadError) as err:
        c.decode(forged)
    assert err.value.field == "numel"


def test_frame_roundtrip_and_malformed_frame_names_the_rank():
    parts = [torch.arange(n, dtype=torch.uint8) for n in (3, 0, 7)]
    frame = wire.frame(parts)
    back = wire.unframe(frame, 3, 0, ["a", "b", "c"])
    assert [torch.equal(a, b) for a, b in zip(parts, back, strict=True)] == [True] * 3
    with pytest.raises(PayloadError, match="from rank 2"):
        wire.unframe(frame[:-1], 3, 2, ["a", "b", "c"])
    with pytest.raises(PayloadError, match="expected 4"):
        wire.unframe(frame, 4, 1, ["a", "b", "c", "d"])


# Whole payloads, byte for byte (docs/design.md section 8.9): header, codec parameters,
# checksum and body together pin the format.
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
        {"ratio": 0.5},
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
