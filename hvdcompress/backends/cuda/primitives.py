"""The shared primitives (kernels/primitives.cu; see hvdcompress.codecs.primitives)."""

from __future__ import annotations

import numpy as np
import torch

from hvdcompress.backends.cuda import _runtime as rt
from hvdcompress.errors import PayloadError


def uniform(key, n, device=None):
    out = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        with rt._Launcher(out.device) as k:
            k("primitives_uniform", n, np.uint64(key), np.int64(0), np.int64(n), out)
    return out


def bitpack(codes, bits):
    rt._check_tensor(codes, "codes", torch.uint8)
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=codes.device)
    if n:
        with rt._Launcher(codes.device) as k:
            sizes = np.int64(n), np.int32(bits)
            k("primitives_bitpack", nbytes, codes, *sizes, out, np.int64(nbytes))
    return out


def bitunpack(buf, n, bits):
    rt._check_tensor(buf, "buf", torch.uint8)
    if buf.numel() != (n * bits + 7) // 8:
        raise PayloadError("body", "the packed body does not have ceil(numel * bits / 8) bytes")
    codes = torch.empty(n, dtype=torch.uint8, device=buf.device)
    if n:
        with rt._Launcher(buf.device) as k:
            state = k.state()
            sizes = np.int64(buf.numel()), np.int64(n), np.int32(bits)
            k("primitives_bitunpack", n, buf, *sizes, codes, state)
            err = int(rt._read_state(state)[rt._ST_ERROR])
        if err & rt._PRIM_ERR_PADDING:
            raise PayloadError("body", "a padding bit after the last packed value is set")
    return codes


def chunk_sums(x, chunk, square):
    rt._check_tensor(x, "x", torch.float32)
    n = x.numel()
    chunks = (n + chunk - 1) // chunk
    out = torch.empty(chunks, dtype=torch.float64, device=x.device)
    if n:
        with rt._Launcher(x.device) as k:
            sizes = np.int64(n), np.int64(chunk), np.int32(bool(square))
            k("primitives_chunk_sums", chunks, x, *sizes, out)
    return out


def nonfinite(x):
    # one torch reduction on the device (a GPU reads at its own bandwidth); the answer,
    # not bytes, is what both backends share
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not x.is_contiguous():
        raise ValueError("nonfinite takes a contiguous float32, float16 or bfloat16 tensor")
    return bool(x.numel()) and not bool(torch.isfinite(x).all())
