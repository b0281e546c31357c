"""The cast compressors (none, fp16, bf16): summable payloads in the wire dtype."""

import pytest
import torch

import hvdcompress


@pytest.mark.parametrize(
    "name,wire_dtype", [("none", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)]
)
def test_cast_compressors_are_summable(name, wire_dtype):
    c = hvdcompress.get_compressor(name)
    assert c.summable
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    pa, ctx = c.compress(a, "w")
    pb, _ = c.compress(b, "w")
    assert pa.dtype == wire_dtype and pa.dim() == 1
    total = c.decompress(pa + pb, ctx)  # what an allreduce (sum) then decompress gives
    assert total.shape == a.shape and total.dtype == a.dtype
    tol = {torch.float32: 0, torch.float16: 1e-2, torch.bfloat16: 1e-1}[wire_dtype]
    assert torch.allclose(total, a + b, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="expects 30"):
        c.decompress(pa[:-1], ctx)
    assert c.bits_per_value(pa) == 8 * pa.element_size()
