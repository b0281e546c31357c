"""The wire format (hvdcompress.wire): every header field validated on its own, the
element count a header may claim, and the optimizer's framing of several payloads into
one collective buffer."""

import pytest
import torch

import hvdcompress
from hvdcompress import wire
from hvdcompress.wire import PayloadError
from tests.helpers import comp


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
