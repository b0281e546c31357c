"""A slow, obviously-correct numpy model of docs/codecs.md, "3LC", used as the tests' oracle."""

import numpy as np

# The 3LC test vectors of docs/codecs.md, "3LC": the input, and per sparsity the scale S,
# the quartic bytes and the zero-run-encoded body (every backend must give these bytes).
DESIGN_X = [0.80, -0.05, 0.02, 0, -0.70, 0.45, 0.04, 0, 0, 0.01]
DESIGN_X += [0.30, 0.03, -0.02, 0, 0.05, 0.10, -0.01, 0, 0.02, 0]
DESIGN_VECTORS = [  # sparsity, S, quartic, zre
    (1.0, 0.8, [201, 202, 121, 121], [201, 202, 243]),
    (1.5, 1.2, [201, 121, 121, 121], [201, 244]),
    (1.9, 1.52, [202, 121, 121, 121], [202, 244]),
]


def quantize(a: np.ndarray, sparsity: float):
    a = a.astype(np.float32)
    m = np.float32(np.abs(a).max()) if a.size else np.float32(0)
    with np.errstate(over="ignore"):
        scale = np.float32(sparsity) * m
    if scale == 0:
        return np.zeros(a.size, np.int8), scale
    q = np.rint(a / scale).astype(np.int8)  # float32 / float32 -> float32, round half even
    return q, scale


def quartic(q: np.ndarray) -> np.ndarray:
    d = np.ones(-(-q.size // 5) * 5, np.int64)
    d[: q.size] = q.astype(np.int64) + 1
    d = d.reshape(-1, 5)
    return (d @ np.array([81, 27, 9, 3, 1])).astype(np.uint8)


def zre(buf: np.ndarray) -> np.ndarray:
    out, i, b = [], 0, buf.tolist()
    while i < len(b):
        if b[i] != 121:
            out.append(b[i])
            i += 1
            continue
        r = 0
        while i < len(b) and b[i] == 121:
            r += 1
            i += 1
        out += [255] * (r // 14)
        rem = r % 14
        if rem >= 2:
            out.append(241 + rem)
        elif rem == 1:
            out.append(121)
    return np.array(out, np.uint8)


def unzre(buf: np.ndarray) -> np.ndarray:
    out = []
    for b in buf.tolist():
        out += [121] * (b - 241) if b >= 243 else [b]
    return np.array(out, np.uint8)


def encode(g: np.ndarray, e: np.ndarray, sparsity: float):
    """Returns (zre bytes, scale, new residual) as the compressor computes them."""
    a = (g.astype(np.float32) + e.astype(np.float32)).astype(np.float32)
    q, scale = quantize(a, sparsity)
    new_e = (a - scale * q.astype(np.float32)).astype(np.float32)
    return zre(quartic(q)), scale, new_e
