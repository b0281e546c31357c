"""Float32 inputs for the codec equality tests: Gaussian values over many magnitudes with
zeros, -0.0, subnormals, values near float32's largest, and (sometimes) Inf and NaN, at
sizes around the codecs' block, byte and bucket boundaries; and the valid gradient classes of
the valid-input matrix (``VALID_CLASSES``, ``valid_gradient``, ``valid_gradients``) in
float32, float16 and bfloat16."""

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


# ---- valid gradients by class (tests/test_valid_inputs.py) ---------------------------------
# Every class is a valid (finite) gradient; a class whose values a dtype cannot represent is
# not a valid input of that dtype and is left out of it by construction (``valid_gradient``
# returns None). Subnormals are the dtype's own (float16's smallest normal is 6.1e-5).
SUBNORMAL = {torch.float32: 1e-40, torch.bfloat16: 1e-40, torch.float16: 3e-6}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (shape, kind); "huge32" / "huge16": magnitudes in [0.5, 1] x 3e38 / 6e4, random signs
VALID_CLASSES = {
    "zeros": ((40, 25), "zeros"),
    "one_nonzero": ((1000,), "one_nonzero"),
    "nnz_0.1%": ((5000,), "sparse"),
    "nnz_1%": ((20, 100), "sparse"),
    "constant": ((600,), "constant"),
    "alternating": ((601,), "alternating"),
    "subnormal": ((300,), "subnormal"),
    "huge32": ((257,), "huge32"),
    "huge16": ((257,), "huge16"),
    "one_element": ((1,), "gauss"),
    "empty": ((0,), "gauss"),
    "n4": ((4,), "gauss"),
    "n5": ((5,), "gauss"),
    "n6": ((6,), "gauss"),
    "n511": ((511,), "gauss"),
    "n512": ((512,), "gauss"),
    "n513": ((513,), "gauss"),
    "gauss_64x48": ((64, 48), "gauss"),
}
# classes whose sign flips with the step and the rank, so that sums over steps (error
# feedback) and over ranks (the average) of values near the dtype's maximum stay finite
FLIPPED = {"huge32", "huge16"}


def valid_gradient(cls: str, dtype: torch.dtype, seed: int, sign: float = 1.0):
    """A seeded gradient of class ``cls`` in ``dtype`` times ``sign`` (+-1), or None where
    the class is not representable in ``dtype`` (3e38 in float16)."""
    shape, kind = VALID_CLASSES[cls]
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if kind == "zeros":
        x = np.zeros(n)
    elif kind == "one_nonzero":
        x = np.zeros(n)
        x[rng.integers(n)] = rng.uniform(0.5, 2.0) * rng.choice([-1, 1])
    elif kind == "sparse":
        x = np.zeros(n)
        nnz = max(1, round(n * (0.001 if "0.1" in cls else 0.01)))
        x[rng.choice(n, nnz, replace=False)] = rng.standard_normal(nnz)
    elif kind == "constant":
        x = np.full(n, 0.375 * (1 + seed % 3))
    elif kind == "alternating":
        x = np.where(np.arange(n) % 2 == 0, 1.0, -1.0) * rng.uniform(0.5, 1.5)
    elif kind == "subnormal":
        x = rng.uniform(1.0, 2.0, n) * rng.choice([-1.0, 1.0], n) * SUBNORMAL[dtype]
    elif kind in ("huge32", "huge16"):
        if kind == "huge32" and dtype == torch.float16:
            return None
        top = 3e38 if kind == "huge32" else 6e4
        x = rng.uniform(0.5, 1.0, n) * rng.choice([-1.0, 1.0], n) * top
    else:
        x = rng.standard_normal(n)
    t = torch.from_numpy(x * sign).to(torch.float32).to(dtype).reshape(shape)
    assert bool(t.isfinite().all()), (cls, dtype)
    return t


@st.composite
def valid_gradients(draw, dtypes=DTYPES) -> tuple[str, torch.dtype, torch.Tensor]:
    """(class, dtype, tensor): one valid gradient of one of ``VALID_CLASSES``."""
    dtype = draw(st.sampled_from(dtypes))
    names = [c for c in VALID_CLASSES if not (c == "huge32" and dtype == torch.float16)]
    cls = draw(st.sampled_from(names))
    seed = draw(st.integers(0, 2**32 - 1))
    return cls, dtype, valid_gradient(cls, dtype, seed, draw(st.sampled_from([1.0, -1.0])))
