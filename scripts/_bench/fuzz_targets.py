"""The coverage-guided fuzz targets of scripts/fuzz_coverage.py, importable without atheris
(tests/fuzz/test_coverage_targets.py runs them over their seed corpus).

A target takes one input (bytes) and returns when the library handled it as documented;
anything else propagates as an exception, which is a finding: the fuzzer saves the input.
The first byte of an input picks what is fuzzed and how, the next bytes pick a case, the
rest is the fuzzed data (``seeds`` writes valid inputs of every kind).

``frame_target`` (the receive path, hvdcompress.wire and the compressors' decoders; the
checks are scripts/_bench/payloads.py's, those of tests/fuzz):

    kind 0  one payload, decoded by a receiver of one of ``build_cases``' tensors:
            ``check_decode`` (a PayloadError naming a field or a tensor of exactly the
            expected shape and dtype, all finite unless flagged non-finite; allocations
            within the receiver's bound)
    kind 1  one payload of a bucket frame replaced by the data: ``frames_agree``
            (``decode_frame`` and the per-payload path raise the same PayloadError, or
            none, and leave the same sums)
    kind 2  the data as the whole frame (its length table included): ``frames_agree``

    byte 0: kind (bits 0-1), recompute the checksums (bit 2: forgeries that reach the
    body decoders); byte 1: the codec configuration; byte 2: the tensor (kind 0) or the
    payload of the bucket (kind 1).

``checkpoint_target`` (hvdcompress.checkpoint and ``DistributedOptimizer.load_state_dict``,
for one optimizer per compressor configuration of the registry plus one with a policy):

    kind 0  the data as a checkpoint file: ``decode_checkpoint``
    kind 1  the data as the payload of a file with a valid header and digest (what a forger
            can write: a torch zip for ``torch.load(weights_only=True)``)
    kind 2  the data as edits of an optimizer's state_dict()["hvdcompress"]: values built
            from the bytes (dicts, lists, scalars at their edges, tensors of any dtype,
            strided views of small storages as a crafted file can hold) put at paths of the
            state, then ``check_optimizer_state`` and ``load_state_dict``
    kind 3  as kind 2, saved with ``encode_checkpoint`` and read back first (the whole load)

    byte 0: kind; byte 1: the optimizer; the rest the data.

    A file either loads (a dict) or raises CheckpointError; a loaded or edited state either
    loads or raises CheckpointError with the optimizer's state unchanged. No load may run
    code (an audit hook watches for processes, code compilation, sockets and file
    writes), and no check may operate on a tensor of more than ``MAX_TENSOR_NUMEL``
    elements (a view of a few bytes of storage can claim 2**40: walking it is an
    unbounded allocation).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import struct
import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hvdcompress
from hvdcompress import checkpoint as ck
from hvdcompress import wire
from hvdcompress.compressors import registry
from hvdcompress.transports.simulated import SimulatedWorld

from . import payloads

FRAME, CHECKPOINT = "frame", "checkpoint"
FORGE = 4
STATE_KEY = "hvdcompress"  # state_dict()[STATE_KEY]: the optimizer's hvdcompress part


# ---- the receive path --------------------------------------------------------------------------
class _FrameCases:
    """Built once, on the first input: the receivers, payloads and frames of every codec."""

    def __init__(self) -> None:
        self.cases, self.described = payloads.build_cases(0)
        self.names = sorted(self.cases)
        self.configs = payloads.frame_configs()
        self.frames = [payloads.bucket_frame(*config) for config in self.configs]


_frame_cases: _FrameCases | None = None


def _frames() -> _FrameCases:
    global _frame_cases
    if _frame_cases is None:
        _frame_cases = _FrameCases()
    return _frame_cases


def _tensor(buf: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf) or bytearray(1), dtype=torch.uint8)[: len(buf)]


def _forge_frame(buf: bytes, count: int, rank: int) -> bytes:
    """The frame with every payload's checksum recomputed, when its length table splits it
    into ``count`` payloads (else unchanged)."""
    try:
        parts = wire.unframe(_tensor(buf), count, rank, payloads.FRAME_NAMES)
    except wire.PayloadError:
        return buf
    fixed = [_tensor(bytes(payloads.fix_checksum(bytearray(p.numpy().tobytes())))) for p in parts]
    return wire.frame(fixed).numpy().tobytes()


def frame_target(data: bytes) -> None:
    """One input of the receive path (module doc); returns, or raises a finding."""
    if len(data) < 3:
        return
    fc = _frames()
    kind, forge, body = data[0] % 3, bool(data[0] & FORGE), data[3:]
    if kind == 0:
        name = fc.names[data[1] % len(fc.names)]
        case = fc.cases[name][data[2] % len(fc.cases[name])]
        if forge:
            body = bytes(payloads.fix_checksum(bytearray(body)))
        c, payload, ctx, original = case
        same = body == payload.numpy().tobytes()
        payloads.check_decode(
            c, body, ctx, original if same else None, **payloads.side_kwargs(case)
        )
        return
    i = data[1] % len(fc.configs)
    config, (frame, ctxs) = fc.configs[i], fc.frames[i]
    count = len(payloads.FRAME_NAMES)
    if kind == 1:
        parts = wire.unframe(frame, count, config[2], payloads.FRAME_NAMES)
        if forge:
            body = bytes(payloads.fix_checksum(bytearray(body)))
        parts[data[2] % count] = _tensor(body)
        frame = wire.frame(parts)
    else:
        frame = _tensor(_forge_frame(body, count, config[2]) if forge else body)
    payloads.frames_agree(config, ctxs, frame)


def frame_seeds() -> list[bytes]:
    """Valid inputs of every kind: every payload of ``build_cases`` as it is and with the
    forging bit, every codec's frame, and each of its payloads in place."""
    fc = _frames()
    seeds = []
    for n, name in enumerate(fc.names):
        for j, (_, payload, _, _) in enumerate(fc.cases[name]):
            raw = payload.numpy().tobytes()
            seeds += [bytes([0, n, j]) + raw, bytes([FORGE, n, j]) + raw]
    for i, (config, (frame, _)) in enumerate(zip(fc.configs, fc.frames, strict=True)):
        parts = wire.unframe(frame, len(payloads.FRAME_NAMES), config[2], payloads.FRAME_NAMES)
        seeds.append(bytes([2, i, 0]) + frame.numpy().tobytes())
        seeds += [bytes([1, i, j]) + p.numpy().tobytes() for j, p in enumerate(parts)]
    return seeds


# ---- checkpoints ------------------------------------------------------------------------------
MAX_TENSOR_NUMEL = 2**24  # the fuzzed optimizers' largest tensor has 2304 elements


class UnboundedWork(AssertionError):
    """A check of loaded state operated on a tensor of more than MAX_TENSOR_NUMEL elements."""


class CodeRan(AssertionError):
    """Loading a checkpoint did something only code from the file would do."""


class _TensorBound(TorchDispatchMode):
    """Refuses, before it runs, any aten operation on a tensor argument of more than
    MAX_TENSOR_NUMEL elements."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, list | tuple) else (arg,):
                if isinstance(t, torch.Tensor) and t.numel() > MAX_TENSOR_NUMEL:
                    raise UnboundedWork(f"{func} on a tensor of shape {tuple(t.shape)}")
        return func(*args, **kwargs)


_AUDITED = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "subprocess.")
_AUDITED += ("socket.", "ctypes.", "compile", "exec", "os.remove", "os.rename", "shutil.")
_watching: list[str] | None = None


def _audit(event: str, args) -> None:
    if _watching is None:
        return
    if event in ("exec", "compile") and _importing():
        return  # a lazy import of an installed module (torch's), not code from the file
    if event.startswith(_AUDITED) or (
        event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+")
    ):
        _watching.append(f"{event}{args!r:.200}")
        raise CodeRan(event)


def _importing() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_hooked = False


@contextlib.contextmanager
def _no_code_runs():
    """Fails when, inside, anything raises an audit event of ``_AUDITED`` or opens a file
    for writing (the audit hook aborts the event, and it is reported even if the library
    catches the exception)."""
    global _watching, _hooked
    if not _hooked:
        sys.addaudithook(_audit)  # for the rest of the process: inert outside this block
        _hooked = True
    _watching = []
    try:
        with _TensorBound():
            yield
    finally:
        seen, _watching = _watching, None
        if seen:
            raise CodeRan(f"loading ran code: {seen}")


def _opt_configs() -> list[tuple[str, dict, str | None]]:
    """(compressor, params, policy) of every fuzzed optimizer: every example configuration
    of every compressor, and 3LC under Accordion."""
    return [(n, p, None) for n, p in registry.examples()] + [("3lc", {}, "accordion")]


class _Optimizer:
    """One optimizer on one simulated rank of one, trained two steps (its compressor and
    policy hold state), and its state_dict()."""

    def __init__(self, name: str, params: dict, policy: str | None) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 3)
        )
        pol = hvdcompress.Accordion(low=1.0, high=1.9, interval_steps=1) if policy else None
        self.opt = hvdcompress.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=0.1),
            self.model.named_parameters(),
            compression=hvdcompress.get_compressor(name, **params),
            backend=SimulatedWorld(1).transport(0),
            policy=pol,
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(16, 48, generator=gen)
            self.opt.zero_grad()
            self.model(x).square().mean().backward()
            self.opt.step()
        self.good = copy.deepcopy(self.opt.state_dict())
        self.shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}

    def snapshot(self) -> str:
        """The optimizer's whole state (inner and hvdcompress), bit for bit."""
        h = hashlib.sha256()
        _digest(self.opt.state_dict(), h)
        return h.hexdigest()


def _digest(value, h) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _digest(value[k], h)
        h.update(b"}")
    elif isinstance(value, list | tuple):
        h.update(b"[")
        for v in value:
            _digest(v, h)
        h.update(b"]")
    else:
        h.update(repr(value).encode())


_optimizers: dict[int, _Optimizer] = {}


def _optimizer(i: int) -> _Optimizer:
    configs = _opt_configs()
    i %= len(configs)
    if i not in _optimizers:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _optimizers[i] = _Optimizer(*configs[i])
    return _optimizers[i]


class _Bytes:
    """The fuzzer's bytes read front to back; zeros once used up."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        b = self.data[self.at] if self.at < len(self.data) else 0
        self.at += 1
        return b

    def pick(self, seq):
        return seq[self.byte() % len(seq)]

    def word(self) -> int:
        return int.from_bytes(bytes(self.byte() for _ in range(8)), "little")

    @property
    def left(self) -> bool:
        return self.at < len(self.data)


# what a loaded state's values may be: the keys the checks look up, edge numbers, dtypes
_KEYS = ("rank", "size", "compressor", "compressor_state", "policy", "residuals", "velocity")
_KEYS += ("steps", "qs", "current", "sums", "budgets", "levels", "numel", "sparsity", "step")
_KEYS += ("0.weight", "0.bias", "2.weight", "2.bias", "ghost", "", "state", "param_groups")
_INTS = (0, 1, 2, -1, 3, 48, 144, 2304, 2**31, 2**63 - 1, -(2**63), 2**64, 10**30)
_FLOATS = (0.0, -0.0, 1.0, 0.5, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)
_DTYPES += (torch.int32, torch.uint8, torch.bool, torch.complex64, torch.int8)
_DIMS = (0, 1, 2, 3, 48, 144, 2304, 2**20, 2**31, 2**40)


def _build_tensor(b: _Bytes) -> torch.Tensor:
    """A tensor as a torch zip can hold one: a small storage (values from the bytes) and a
    view of it of any size, stride and offset that fits it (stride 0: any size)."""
    dtype = b.pick(_DTYPES)
    n = b.byte() % 64
    raw = bytes(b.byte() for _ in range(n * dtype.itemsize))
    base = torch.frombuffer(bytearray(raw) or bytearray(dtype.itemsize), dtype=dtype)[:n]
    base = base.clone()
    mode = b.byte() % 4
    if mode == 0:
        return base
    sizes = [b.pick(_DIMS) for _ in range(1 + b.byte() % 3)]
    strides = [b.pick((0, 0, 1, 2, 48)) for _ in sizes]
    try:
        return base.as_strided(sizes, strides, b.byte() % 4)
    except RuntimeError:  # does not fit the storage: as a file could not either
        return base


def _build(b: _Bytes, depth: int = 0):
    op = b.byte() % (12 if depth < 4 else 8)
    if op == 0:
        return None
    if op == 1:
        return bool(b.byte() & 1)
    if op == 2:
        return b.pick(_INTS)
    if op == 3:
        return b.word() - 2**63
    if op == 4:
        return b.pick(_FLOATS)
    if op == 5:
        return struct.unpack("<d", b.word().to_bytes(8, "little"))[0]
    if op == 6:
        return b.pick(_KEYS)
    if op == 7:
        return _build_tensor(b)
    if op in (8, 9):
        return {_key(b): _build(b, depth + 1) for _ in range(b.byte() % 4)}
    items = [_build(b, depth + 1) for _ in range(b.byte() % 4)]
    return items if op == 10 else tuple(items)


def _key(b: _Bytes):
    k = b.byte()
    return b.pick(_KEYS) if k < 200 else (k - 200 if k < 230 else repr(b.pick(_FLOATS)))


def _edit(state: dict, b: _Bytes) -> None:
    """Put a built value at a path of ``state`` chosen by the bytes (down existing keys or
    to a new one), or delete the entry there."""
    node = state
    while True:
        keys = sorted(node, key=repr) if isinstance(node, dict) else []
        choice = b.byte()
        if not keys or choice >= 192:
            key = _key(b) if not keys or choice >= 224 else keys[choice % len(keys)]
            break
        key = keys[choice % len(keys)]
        if not isinstance(node[key], dict) or b.byte() < 64:
            break
        node = node[key]
    if b.byte() < 16:
        node.pop(key, None)
    else:
        node[key] = _build(b)


def _expect_load(o: _Optimizer, state) -> None:
    """``check_optimizer_state`` of the state's hvdcompress part and ``load_state_dict`` of
    the state either pass or raise CheckpointError, the optimizer unchanged then; the
    optimizer is put back to its own state afterwards."""
    t = o.opt._transport
    ours = state.get(STATE_KEY) if isinstance(state, dict) else None
    with _no_code_runs(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ours is not None:
            with contextlib.suppress(ck.CheckpointError):
                ck.check_optimizer_state(
                    ours,
                    rank=t.rank,
                    size=t.size,
                    compressor=repr(o.opt.compressor),
                    shapes=o.shapes,
                )
        before = o.snapshot()
        try:
            o.opt.load_state_dict(state)
        except ck.CheckpointError:
            assert o.snapshot() == before, "a refused load changed the optimizer"
    o.opt.load_state_dict(copy.deepcopy(o.good))


def checkpoint_target(data: bytes) -> None:
    """One input of the checkpoint load paths (module doc); returns, or raises a finding."""
    if len(data) < 2:
        return
    kind, rest = data[0] % 4, data[2:]
    o = _optimizer(data[1])
    if kind in (0, 1):
        blob = rest if kind == 0 else _wrap(rest)
        with _no_code_runs():
            try:
                state = ck.decode_checkpoint(blob, "fuzzed")
            except ck.CheckpointError:
                return
        assert isinstance(state, dict)
        if isinstance(state.get(STATE_KEY), dict):  # a loaded optimizer state
            full = copy.deepcopy(o.good)
            full[STATE_KEY] = state[STATE_KEY]
            _expect_load(o, full)
        return
    state = copy.deepcopy(o.good)
    b = _Bytes(rest)
    _edit(state[STATE_KEY], b)
    while b.left and b.byte() & 1:
        _edit(state[STATE_KEY], b)
    if kind == 3:
        try:
            blob = ck.encode_checkpoint(state)
        except ck.CheckpointError:
            return  # not plain values: refused on saving
        with _no_code_runs():
            state = ck.decode_checkpoint(blob, "fuzzed")
    _expect_load(o, state)


def _wrap(payload: bytes) -> bytes:
    """A checkpoint file with a valid header and digest around ``payload``."""
    digest = hashlib.sha256(payload).digest()
    return ck._HEADER.pack(ck.MAGIC, ck.VERSION, len(payload), digest) + payload


def checkpoint_seeds() -> list[bytes]:
    """Valid inputs of every kind for every optimizer: its checkpoint file, that file's
    payload, and a few edits."""
    seeds = []
    for i in range(len(_opt_configs())):
        o = _optimizer(i)
        blob = ck.encode_checkpoint(o.good)
        seeds += [bytes([0, i]) + blob, bytes([1, i]) + blob[ck._HEADER.size :]]
        seeds += [bytes([2, i, 0, 0, 2, 1]), bytes([3, i, 3, 7, 0, 1]), bytes([2, i, 9, 9, 7])]
    return seeds


TARGETS = {FRAME: frame_target, CHECKPOINT: checkpoint_target}
SEEDS = {FRAME: frame_seeds, CHECKPOINT: checkpoint_seeds}


def seed_corpus(target: str) -> list[bytes]:
    """The seed inputs of ``target``."""
    return SEEDS[target]()


__all__ = ["CHECKPOINT", "FRAME", "MAX_TENSOR_NUMEL", "TARGETS", "seed_corpus"]
