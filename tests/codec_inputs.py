"""Float32 inputs for the codec equality tests: Gaussian values over many magnitudes with
zeros, -0.0, subnormals, values near float32's largest, and (sometimes) Inf and NaN, at
sizes around the codecs' block, byte and bucket boundaries."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

SPECIALS = {
    "zero": 0.0,
    "negzero": -0.0,
    "subnormal": 1e-40,
    "negsubnormal": -3e-42,
    "huge": 3e38,
    "neghuge": -3e38,
    "inf": float("inf"),
    "neginf": float("-inf"),
    "nan": float("nan"),
}
SIZES = st.one_of(st.integers(0, 20), st.integers(0, 3000), st.sampled_from([511, 512, 513, 4096]))


@st.composite
def gradients(draw, allow_nonfinite: bool = True) -> torch.Tensor:
    """One flat float32 tensor (see the module docstring)."""
    n = draw(SIZES)
    seed = draw(st.integers(0, 2**32 - 1))
    exponent = draw(st.integers(-40, 30))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0**exponent).astype(np.float32)
    names = [k for k in SPECIALS if allow_nonfinite or k not in ("inf", "neginf", "nan")]
    chosen = draw(st.lists(st.sampled_from(names), max_size=3))
    for name in chosen:
        if n:
            idx = rng.integers(0, n, size=rng.integers(1, max(2, n // 4)))
            x[idx] = np.float32(SPECIALS[name])
    return torch.from_numpy(x)


def special_tensor(n: int, kind: str) -> torch.Tensor:
    """A seeded tensor of n values of one kind: zeros, negzeros, subnormal, huge, inf, nan or
    mixed (all of them among Gaussians)."""
    rng = np.random.default_rng(n)
    if kind == "zeros":
        x = np.zeros(n, np.float32)
    elif kind == "negzeros":
        x = np.full(n, -0.0, np.float32)
    elif kind == "subnormal":
        x = (rng.standard_normal(n) * 1e-41).astype(np.float32)
    elif kind == "huge":
        x = (np.sign(rng.standard_normal(n)) * 3.3e38).astype(np.float32)
    elif kind in ("inf", "nan"):
        x = rng.standard_normal(n).astype(np.float32)
        if n:
            x[n // 2] = np.float32(kind)
    elif kind == "mixed":
        x = rng.standard_normal(n).astype(np.float32)
        values = np.array([0.0, -0.0, 1e-40, -1e-42, 3e38, -3e38], np.float32)
        x[::3] = values[np.arange(len(x[::3])) % len(values)]
    else:
        raise ValueError(kind)
    return torch.from_numpy(x)
