"""Mutation-fuzzing checks for every decoder, shared by the long run scripts/fuzz_payloads.py
and tests/fuzz (through tests/fuzz/harness.py, which adds the hypothesis strategies of the
same mutations; fix_checksum also forges payloads in other tests).

The invariant: decoding a payload either raises PayloadError (a ValueError naming a
field) or returns a tensor of exactly the expected shape and dtype (the header's, within
the receiver's element bound, when nothing is expected); decoding the unchanged bytes
gives exactly the original tensor. Raw mutations are all caught (header checks +
checksum); forged ones (checksum recomputed) reach the body decoders.

Mutations (``mutate``): bit flips, byte sets, truncation, extension, zero-run bytes, and
overwrites of the header's fields (``FIELDS``: version, codec id, flags, dtype, ndim,
params_len, numel, body_len, one shape dimension) with boundary or random values; a
``resize`` rewrites one dimension and numel consistently, and ``nonfinite`` sets the flag
and drops the body (the 48-byte "all NaN, 2**28 elements" forgery), so that only the
receiver's bound stands between the header and the allocator.

What is measured (``AllocationMeter``, a TorchDispatchMode around each decode): every
aten operation the decoder runs. Factory calls (``empty``, ``full``, ``zeros``...) whose
size asks for more than ``REFUSE_BYTES`` are refused before they allocate (the check then
fails: nothing legitimate asks for that), and every operation's non-aliasing outputs are
counted: the largest single allocation, the total, and the number of operations. Checked
per decode (``alloc_bound``): the largest allocation is at most 8 bytes per element the
receiver accepts plus twice the payload plus 64 KiB, the total at most 64 bytes per
element plus 16 per payload byte plus 1 MiB, and at most MAX_OPS operations: work linear
in the bound and the body, with no per-element Python loop. The codecs' C library
allocates nothing (its decoders write into torch tensors the decoder allocated), so the
meter sees every allocation a decode makes.
"""

import math
import random
import struct
from typing import NamedTuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvdcompress
from hvdcompress import framing, wire
from hvdcompress.compressors import registry

# Header fields a mutation may overwrite: (offset, size) in the fixed header (all but
# the magic, the reserved byte and the checksum, which the harness recomputes).
FIELDS = {
    name: where
    for name, where in wire.HEADER_FIELDS.items()
    if name not in ("magic", "reserved", "checksum")
}
# Values at the edges of every size computation: counts past 2**24 (the default bound),
# 2**31 (int32 indices), 2**32, 2**63 (torch's int64), and the all-ones words.
EDGES = (
    0,
    1,
    2,
    3,
    7,
    8,
    9,
    12,
    255,
    256,
    2**16 - 1,
    2**24,
    2**24 + 1,
    2**28,
    2**31 - 1,
    2**31,
    2**32,
    2**32 + 1,
    2**40,
    2**61,
    2**62,
    2**63 - 1,
    2**63,
    2**64 - 1,
)


def random_ops(rng: random.Random) -> list[tuple]:
    """One to four mutations drawn with ``rng`` (the long run's generator; the tests draw
    the same kinds with hypothesis): half byte-level, half field overwrites."""
    ops = []
    for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
        r = rng.random()
        v = rng.choice(EDGES) if rng.random() < 0.5 else rng.getrandbits(rng.choice((8, 16, 64)))
        if r < 0.18:
            ops.append(("flip", rng.randrange(10**6), rng.randrange(8)))
        elif r < 0.30:
            ops.append(("set", rng.randrange(10**6), rng.randrange(256)))
        elif r < 0.38:
            ops.append(("truncate", rng.randrange(10**6), 0))
        elif r < 0.44:
            ops.append(("extend", rng.randbytes(rng.randint(1, 40)), 0))
        elif r < 0.50:
            ops.append(("run", rng.randrange(10**6), rng.randint(243, 255)))
        elif r < 0.80:
            ops.append(("field", rng.choice(sorted(FIELDS)), v))
        elif r < 0.94:
            ops.append(("resize", v, rng.randrange(8)))
        else:
            ops.append(("nonfinite", 0, 0))
    return ops


def _ndim(buf: bytearray) -> int:
    return min(buf[8], 8) if len(buf) > 8 else 0


def _put(buf: bytearray, offset: int, size: int, v: int) -> None:
    if len(buf) >= offset + size:
        buf[offset : offset + size] = (v & ((1 << (8 * size)) - 1)).to_bytes(size, "little")


def _header_len(buf: bytearray) -> int:
    params_len = int.from_bytes(buf[10:12], "little") if len(buf) >= 12 else 0
    return 32 + 8 * _ndim(buf) + params_len


def mutate(buf: bytearray, ops) -> bytearray:
    for kind, a, b in ops:
        if kind == "extend":
            buf += a
        elif not buf:
            continue
        elif kind == "flip":
            buf[a % len(buf)] ^= 1 << b
        elif kind in ("set", "run"):
            buf[a % len(buf)] = b
        elif kind == "truncate":
            del buf[a % len(buf) :]
        elif kind == "field":
            offset, size = FIELDS[a]
            if a == "shape":  # dimension ``b % ndim`` (the first one)
                offset += 8 * (b % _ndim(buf) if _ndim(buf) else 0)
            _put(buf, offset, size, b)
        elif kind == "resize" and _ndim(buf) and len(buf) >= 32 + 8 * _ndim(buf):
            # one dimension set to ``a``, numel rewritten to match: a consistent header
            nd = _ndim(buf)
            dims = list(struct.unpack_from(f"<{nd}Q", buf, 32))
            dims[b % nd] = a
            _put(buf, 32 + 8 * (b % nd), 8, a)
            _put(buf, 16, 8, math.prod(dims))
        elif kind == "nonfinite" and len(buf) >= 32:
            # the flag set and the body dropped: a well-formed "all NaN" payload
            buf[6] |= 1
            del buf[min(_header_len(buf), len(buf)) :]
            _put(buf, 24, 8, 0)
    return buf


def fix_checksum(buf: bytearray) -> bytearray:
    """Recompute the checksum of a (possibly mutated) payload, if its header parses."""
    try:
        wire.parse_header(bytes(buf[: wire.MAX_HEADER]), len(buf))
    except wire.PayloadError:
        return buf
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = b"\0\0\0\0"
    csum = wire.checksum_numpy(np.frombuffer(bytes(buf), dtype=np.uint8), 0)
    buf[wire.CHECKSUM_OFFSET : wire.CHECKSUM_OFFSET + 4] = csum.to_bytes(4, "little")
    return buf


# ---- measuring a decode ---------------------------------------------------------------------
REFUSE_BYTES = 2**30  # a factory call asking for more is refused before it allocates
MAX_OPS = 400  # aten operations per decode: a fixed pipeline, no per-element Python loop
FUZZ_MAX_NUMEL = 2**16  # the explicit bound of the fuzzed decodes without an expectation


class AllocationRefused(Exception):
    """A decoder asked a torch factory function for more than REFUSE_BYTES."""


class AllocationMeter(TorchDispatchMode):
    """Counts what the aten operations run inside it allocate (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.total = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        for arg, given in zip(func._schema.arguments, args, strict=False):
            if arg.name == "size" and isinstance(given, list | tuple):
                itemsize = kwargs["dtype"].itemsize if kwargs.get("dtype") else 8
                want = math.prod(int(d) for d in given) * itemsize
                if want > REFUSE_BYTES:
                    raise AllocationRefused(f"{func} asked for {want} bytes ({list(given)})")
        result = func(*args, **kwargs)
        outs = result if isinstance(result, tuple | list) else (result,)
        for ret, out in zip(func._schema.returns, outs, strict=False):
            if ret.alias_info is None and isinstance(out, torch.Tensor):
                nbytes = out.numel() * out.element_size()
                self.largest = max(self.largest, nbytes)
                self.total += nbytes
        return result


def alloc_bound(limit: int, payload_len: int) -> tuple[int, int]:
    """(largest single allocation, total allocation) a decode may make, in bytes, when the
    receiver accepts at most ``limit`` elements of a payload of ``payload_len`` bytes."""
    return 8 * limit + 2 * payload_len + 2**16, 64 * limit + 16 * payload_len + 2**20


class Outcome(NamedTuple):
    """One payload's result over all its decode calls: ``kind`` "error" (every call raised
    PayloadError), "exact" (the unchanged payload decoded to the original tensor) or
    "valid" (some call decoded a tensor of the right shape); the largest single and total
    allocation and the most operations of any call."""

    kind: str
    largest: int
    total: int
    ops: int


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(
            a.view(-1).view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(-1).view(torch.int16 if b.element_size() == 2 else torch.int32),
        )
    )


def check_decode(c, payload_bytes: bytes, ctx, original=None, **decode_kwargs) -> Outcome:
    """Decode as the optimizer does (``expect``), without an expectation (an explicit
    ``max_numel``, and without ``decode_kwargs``: side information), and into an ``out``
    accumulator; check every result and every call's allocations. ``original``: the
    unmutated payload's decode, which unchanged bytes must reproduce bit for bit."""
    payload = (
        torch.frombuffer(bytearray(payload_bytes), dtype=torch.uint8)
        if payload_bytes
        else torch.empty(0, dtype=torch.uint8)
    )
    n = math.prod(ctx.shape)
    acc = torch.zeros(n)
    calls = [
        (n, "expect", lambda: c.decode(payload, expect=ctx, **decode_kwargs)),
        (FUZZ_MAX_NUMEL, "bound", lambda: c.decode(payload, max_numel=FUZZ_MAX_NUMEL)),
        (n, "out", lambda: c.decode(payload, out=acc, accumulate=True, **decode_kwargs)),
    ]
    if decode_kwargs:
        calls.append(
            (
                FUZZ_MAX_NUMEL,
                "bound",
                lambda: c.decode(payload, max_numel=FUZZ_MAX_NUMEL, **decode_kwargs),
            )
        )
    kind, largest, total, ops = "error", 0, 0, 0
    for limit, how, call in calls:
        meter = AllocationMeter()
        try:
            with meter:
                out = call()
        except hvdcompress.PayloadError as err:
            assert isinstance(err, ValueError) and err.field
            if how == "out":
                assert not acc.any(), "out was changed by a decode that raised"
            out = None
        most, most_total = alloc_bound(limit, len(payload_bytes))
        assert meter.largest <= most and meter.total <= most_total, (
            how,
            meter.largest,
            meter.total,
            limit,
        )
        assert meter.ops <= MAX_OPS, (how, meter.ops)
        largest, total, ops = (
            max(largest, meter.largest),
            max(total, meter.total),
            max(ops, meter.ops),
        )
        if out is None:
            continue
        kind = "exact" if kind == "exact" else "valid"
        header = wire.parse_header(payload_bytes[: wire.MAX_HEADER], len(payload_bytes))
        if how != "out":
            expect_finite(out, header)
        if how == "expect":
            assert out.shape == torch.Size(ctx.shape) and out.dtype == ctx.dtype
            if original is not None:
                assert same_bits(out, original), "unchanged bytes decode differently"
                kind = "exact"
        elif how == "out":
            assert out is acc and header.numel == n
        else:
            assert out.shape == torch.Size(header.shape) and out.dtype == header.dtype
            assert out.numel() <= limit
            if original is not None:
                assert same_bits(out, original), "unchanged bytes decode differently"
    return Outcome(kind, largest, total, ops)


def raw_mutation_case(case, ops, **decode_kwargs) -> Outcome:
    """Without a recomputed checksum every change to the bytes is caught."""
    c, payload, ctx, original = case
    before = payload.numpy().tobytes()
    mutated = bytes(mutate(bytearray(before), ops))
    unchanged = mutated == before
    out = check_decode(c, mutated, ctx, original if unchanged else None, **decode_kwargs)
    if not unchanged:
        assert out.kind == "error"
    return out


def forged_mutation_case(case, ops, **decode_kwargs) -> Outcome:
    c, payload, ctx, original = case
    before = payload.numpy().tobytes()
    mutated = bytes(fix_checksum(mutate(bytearray(before), ops)))
    unchanged = mutated == before
    return check_decode(c, mutated, ctx, original if unchanged else None, **decode_kwargs)


def random_body_case(case, body: bytes, **decode_kwargs) -> Outcome:
    """A valid header with an arbitrary body (checksum fixed) reaches the body decoder."""
    c, payload, ctx, _ = case
    header, _ = wire.read_header(payload)
    raw = bytearray(payload.numpy().tobytes()[: header.size]) + body
    raw[24:32] = len(body).to_bytes(8, "little")  # body_len
    return check_decode(c, bytes(fix_checksum(raw)), ctx, **decode_kwargs)


def expect_finite(out: torch.Tensor, header: wire.Header) -> None:
    """A decode into a new tensor is all NaN for a non-finite payload, else all finite
    (values that overflow are a DecodeOverflowError, never infinities)."""
    if header.nonfinite:
        assert bool(torch.isnan(out).all()), "a non-finite payload decoded to non-NaN values"
    else:
        assert bool(torch.isfinite(out).all()), "a finite payload decoded to NaN or infinities"


# ---- the fuzzed payloads ----------------------------------------------------------------------
def bound(name: str, rank: int, size: int, **params):
    """A compressor bound to ``rank`` of ``size`` ranks, as the optimizer binds it."""
    c = hvdcompress.get_compressor(name, **params)
    c.bind(rank, size)
    return c


SHAPES = [
    ((), torch.float32),
    ((0,), torch.float32),
    ((1,), torch.float32),
    ((7,), torch.float16),
    ((13, 11), torch.bfloat16),
    ((3, 3, 3), torch.float32),
    ((1500,), torch.float32),
    ((4000,), torch.float32),
]


def fuzz_configs() -> list[tuple[str, dict, int]]:
    """Every fuzzed configuration, from the registry: (compressor name, params, sender
    rank) for every example of every gather-only compressor. The sender is bound to that
    rank of 2 and a fresh receiver to rank 0, as the optimizer binds them; compressors
    that decode with side information (NDQSG) send from both ranks (rank 0 sends DQSG,
    rank 1 the nested code)."""
    configs = []
    for name, params in registry.examples():
        cls = registry.REGISTRY[name]
        if not cls.summable:
            configs += [(name, params, r) for r in ((0, 1) if cls.uses_side_info else (0,))]
    return configs


def _input(shape, dtype) -> torch.Tensor:
    x = torch.randn(shape)
    if x.numel() > 100:  # a long zero run: run bytes in quartic and zero-run bodies
        x[100 : min(x.numel() - 500, 3000)] = 0
    return x.to(dtype)


def side_kwargs(case) -> dict:
    """Side information of the receiver's tensor size for decoders that take it (NDQSG),
    as the gather path passes it; the checks also decode without it."""
    c, _, ctx, _ = case
    if not c.uses_side_info:
        return {}
    return {"side_info": torch.linspace(-1, 1, math.prod(ctx.shape))}


def build_cases(seed: int = 0) -> tuple[dict[str, list], dict[str, list[str]]]:
    """name -> [(receiver, payload, ctx, original decode)] for every gather-only compressor
    (every example configuration at every shape and dtype of SHAPES, plus a tensor with a
    NaN), and name -> a description of each."""
    torch.manual_seed(seed)
    configs = fuzz_configs()
    cases: dict[str, list] = {name: [] for name, _, _ in configs}
    described: dict[str, list[str]] = {name: [] for name, _, _ in configs}
    for name, params, rank in configs:
        inputs = [(_input(shape, dtype), "fuzz") for shape, dtype in SHAPES]
        inputs.append((torch.tensor([1.0, float("nan")]), "nan"))
        for x, tensor_name in inputs:
            payload, ctx = bound(name, rank, 2, **params).compress(x, tensor_name)
            receiver = bound(name, 0, 2, **params)
            case = (receiver, payload, ctx, None)
            original = receiver.decode(payload, expect=ctx, **side_kwargs(case))
            cases[name].append((receiver, payload, ctx, original))
            described[name].append(
                f"{name} {params} rank {rank}: {tuple(x.shape)} {x.dtype} {tensor_name}"
            )
    return cases, described


# ---- frames: the one-call receive path against the per-payload one ---------------------------
FRAME_SIZES = [(0,), (1,), (7,), (33, 17), (100,), (513,)]
FRAME_NAMES = [f"layer{i}" for i in range(len(FRAME_SIZES))]


def frame_configs() -> list[tuple[str, dict, int]]:
    """(compressor, params, the sender's rank of 2) of the frame checks: every example of
    every gather-only compressor sent by rank 1, so that rank 1's payloads decode with the
    side information of the ranks before it where the compressor has any (NDQSG: the
    per-payload path only); and rank 0's frames of those (no side information, the one-call
    path too)."""
    gather = [(n, p) for n, p in registry.examples() if not registry.REGISTRY[n].summable]
    return [(n, p, 1) for n, p in gather] + [
        (n, p, 0) for n, p in gather if registry.REGISTRY[n].uses_side_info
    ]


def bucket_frame(name: str, params: dict, sender: int):
    """A sender's frame of a mixed bucket of FRAME_SIZES (one tensor non-finite) and its
    contexts."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen) for shape in FRAME_SIZES]
    tensors[4][3] = float("inf")
    return framing.compress_bucket(bound(name, sender, 2, **params), tensors, FRAME_NAMES)


def _frame_outcome(decode):
    outs = [torch.linspace(-1, 1, torch.Size(s).numel()) for s in FRAME_SIZES]
    try:
        decode(outs)
    except Exception as err:  # noqa: BLE001 - compared by the caller, whatever it is
        return outs, err
    return outs, None


def _described(err):
    return None if err is None else (type(err), str(err), getattr(err, "field", None))


def frames_agree(config: tuple[str, dict, int], ctxs, frame: torch.Tensor) -> None:
    """``decode_frame`` of ``frame`` (from rank ``config[2]``, a bucket of FRAME_SIZES with
    contexts ``ctxs``) and ``decode_bucket`` of ``wire.unframe_parsed`` give the same
    exception (type, field, message), or none, and the same accumulators bit for bit; an
    exception is a PayloadError naming a field."""
    name, params, sender = config
    ref, fast = bound(name, 1 - sender, 2, **params), bound(name, 1 - sender, 2, **params)
    want_outs, want = _frame_outcome(
        lambda outs: framing.decode_bucket(
            ref,
            wire.unframe_parsed(frame, sender, FRAME_NAMES, torch.device("cpu")),
            outs,
            ctxs,
            rank=sender,
        )
    )
    got_outs, got = _frame_outcome(
        lambda outs: framing.decode_frame(fast, frame, outs, ctxs, rank=sender)
    )
    assert _described(got) == _described(want), f"per-payload: {want!r}; one call: {got!r}"
    if got is not None and not (isinstance(got, hvdcompress.PayloadError) and got.field):
        raise got
    for a, b in zip(got_outs, want_outs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
