"""HorovodTransport's allgather framing (transports/horovod.py): each rank's bytes after
their 8-byte length, stripped again after the gather, on the host here (the device's
kernel is checked against this host verdict in tests/gpu/test_buckets_gpu.py and, without
a GPU, in tests/host_kernels). No Horovod process is needed: the framing is pure."""

import pytest
import torch

from hvdcompress.transports.horovod import _LEN, _strip_length_prefixes
from tests.gpu.test_buckets_gpu import length_prefix_cases

CASES = {what: (buf, size) for what, buf, size in length_prefix_cases()}
ERRORS = {
    "a prefix missing": "allgather: rank 3's length prefix is missing",
    "a short part": "allgather: rank 2 announced 300 bytes, fewer arrived",
    "trailing bytes": "allgather: 308 unexpected trailing bytes",
    "nothing, one rank": "allgather: rank 0's length prefix is missing",
    "a prefix past 2^63": f"allgather: rank 0 announced {2**63 + 1} bytes, fewer arrived",
}


def test_framing_round_trips_each_ranks_bytes():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (9, 0, 1, 70)]
    framed = [
        torch.cat([torch.frombuffer(bytearray(_LEN.pack(p.numel())), dtype=torch.uint8), p])
        for p in parts
    ]
    data, sizes = _strip_length_prefixes(torch.cat(framed), len(parts))
    assert sizes == [9, 0, 1, 70]
    assert torch.equal(data, torch.cat(parts))


@pytest.mark.parametrize("what", sorted(CASES))
def test_broken_framing_is_refused_with_its_cause(what):
    buf, size = CASES[what]
    if what not in ERRORS:
        data, sizes = _strip_length_prefixes(buf, size)
        assert sum(sizes) == data.numel() == buf.numel() - 8 * size
        return
    with pytest.raises(RuntimeError) as err:
        _strip_length_prefixes(buf, size)
    assert str(err.value) == ERRORS[what]
