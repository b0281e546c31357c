"""Safe checkpoint files: verified, never unpickled into code, written atomically
(docs/checkpoints-and-faults.md, "Checkpoints", for the file layout and the resume).

    MAGIC (8 bytes, b"HVDCCKPT") | version (uint32 LE) | payload length (uint64 LE)
    | sha256 of the payload (32 bytes) | payload (``torch.save`` of a dict of plain values)

``save_checkpoint`` refuses anything but plain values, so what is saved can always be
loaded, and replaces the file atomically (temporary file, fsync, ``os.replace``, fsync of
the directory): a crash leaves the old file or the new one, never half of one.
``load_checkpoint`` checks header, length and digest before it reads anything, then loads
with ``weights_only=True``: no code in a crafted file runs, and a flipped bit is a
``CheckpointError`` naming the file. The digest detects corruption, not forgery.

The ``check_*`` helpers validate loaded state (``CheckpointError`` naming the entry);
loaders call them before they change anything.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import math
import os
import re
import struct
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

MAGIC = b"HVDCCKPT"
VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256
DEFAULT_KEEP = 3
PER_RANK_STATE = ("residuals", "velocity")  # compressor state that belongs to one rank


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded: corrupt, modified, of the wrong
    format, or holding state that does not fit (non-finite, wrong dtype or shape, unknown
    tensor names). The message names the file or the entry and what is wrong."""


# ---- plain values --------------------------------------------------------------------------
_SCALARS = (str, int, float, bool, type(None))


def _check_plain(value, where: str) -> None:
    """Refuse anything ``torch.load(weights_only=True)`` would refuse or that is not ours."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise CheckpointError(f"{where}: {type(value).__name__} is not a plain tensor")
        return
    if type(value) in _SCALARS:
        return
    if type(value) in (dict, collections.OrderedDict):
        for k, v in value.items():
            if type(k) not in (str, int):
                raise CheckpointError(f"{where}: key {k!r} is not a str or int")
            _check_plain(v, f"{where}.{k}")
        return
    if type(value) in (list, tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where}: {type(value).__module__}.{type(value).__qualname__} is not a plain value "
        "(dict, list, tuple, str, int, float, bool, None or a tensor)"
    )


# ---- one file --------------------------------------------------------------------------------
def encode_checkpoint(state: Mapping) -> bytes:
    """The bytes of a checkpoint file holding ``state`` (see module doc)."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"a checkpoint holds a dict, got {type(state).__name__}")
    state = dict(state)
    _check_plain(state, "checkpoint")
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    header = _HEADER.pack(MAGIC, VERSION, len(payload), hashlib.sha256(payload).digest())
    return header + payload


def decode_checkpoint(data: bytes, name: str = "checkpoint", map_location="cpu") -> dict:
    """The dict of a checkpoint file's bytes; ``CheckpointError`` naming ``name`` if the
    header, length or digest is wrong or the payload holds anything but plain values."""
    if len(data) < _HEADER.size or data[: len(MAGIC)] != MAGIC:
        raise CheckpointError(
            f"{name}: not an hvdcompress checkpoint (no {MAGIC.decode()} header; an old "
            "pickled checkpoint is not loaded because unpickling it could run code)"
        )
    _, version, length, digest = _HEADER.unpack_from(data, 0)
    if version != VERSION:
        raise CheckpointError(f"{name}: checkpoint format version {version}, expected {VERSION}")
    payload = memoryview(data)[_HEADER.size :]
    if len(payload) != length:
        raise CheckpointError(
            f"{name}: truncated or extended: header says {length} payload bytes, "
            f"file holds {len(payload)}"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(
            f"{name}: content digest mismatch (sha256): the file is corrupt or was modified"
        )
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{name}: refused to load: {first}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{name}: holds {type(state).__name__}, expected a dict")
    return state


def save_checkpoint(path: str | os.PathLike, state: Mapping) -> Path:
    """Write ``state`` to ``path`` atomically (see module doc); returns the path."""
    path = Path(path)
    data = encode_checkpoint(state)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            umask = os.umask(0o022)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)  # as open() would, not mkstemp's 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """The dict saved by ``save_checkpoint``, verified (see ``decode_checkpoint``)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from None
    return decode_checkpoint(data, str(path), map_location)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported here (e.g. some platforms): the rename is still atomic
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def check_writable_dir(directory: str | os.PathLike, what: str = "directory") -> Path:
    """Create ``directory`` if needed and check a file can be created in it; returns it.
    ``CheckpointError`` (naming ``what`` and the directory) otherwise."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise CheckpointError(
            f"{what} {directory} is not a writable directory: {err.strerror or err}"
        ) from None
    return directory


# ---- one file per rank and step ---------------------------------------------------------------
def checkpoint_path(directory: str | os.PathLike, rank: int, step: int) -> Path:
    """``DIR/rank{rank}.step{step:09d}.ckpt``."""
    return Path(directory) / f"rank{int(rank)}.step{int(step):09d}.ckpt"


def list_checkpoints(directory: str | os.PathLike, rank: int) -> list[tuple[int, Path]]:
    """(step, path) of ``rank``'s checkpoint files in ``directory``, oldest first."""
    pattern = re.compile(rf"rank{int(rank)}\.step(\d+)\.ckpt")
    directory = Path(directory)
    if not directory.is_dir():
        return []
    matches = ((pattern.fullmatch(entry.name), entry) for entry in directory.iterdir())
    return sorted((int(m.group(1)), entry) for m, entry in matches if m and entry.is_file())


def prune_checkpoints(directory: str | os.PathLike, rank: int, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` of ``rank``'s files (and its stale temporary
    files); returns what was removed."""
    if int(keep) < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    removed = []
    for _, path in list_checkpoints(directory, rank)[: -int(keep)]:
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
    for tmp in Path(directory).glob(f".rank{int(rank)}.step*.ckpt.*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()
    return removed


def save_rank_checkpoint(
    directory: str | os.PathLike, rank: int, step: int, state: Mapping, keep: int = DEFAULT_KEEP
) -> Path:
    """Save ``rank``'s state at ``step`` atomically, then keep its newest ``keep`` files."""
    path = save_checkpoint(checkpoint_path(directory, rank, step), state)
    prune_checkpoints(directory, rank, keep)
    return path


def verified_steps(
    directory: str | os.PathLike, rank: int
) -> tuple[list[int], list[tuple[Path, CheckpointError]]]:
    """(steps whose file of ``rank`` verifies, newest first; [(path, error)] of those that
    do not). Verifying reads the whole file and loads it with ``weights_only=True``."""
    good, bad = [], []
    for step, path in reversed(list_checkpoints(directory, rank)):
        try:
            load_checkpoint(path)
        except CheckpointError as err:
            bad.append((path, err))
        else:
            good.append(step)
    return good, bad


# ---- validating loaded state -----------------------------------------------------------------
def check_dict(what: str, state) -> dict:
    """``state`` is a dict; returns a copy."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{what}: expected a dict, got {type(state).__name__}")
    return dict(state)


def check_keys(what: str, state, required=(), optional=()) -> dict:
    """``state`` is a dict with every key of ``required`` and no key outside
    ``required`` and ``optional``; returns it."""
    check_dict(what, state)
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"{what}: missing {', '.join(map(repr, missing))}")
    unknown = sorted(str(k) for k in state if k not in required and k not in optional)
    if unknown:
        known = sorted({*required, *optional})
        raise CheckpointError(
            f"{what}: unknown entries {', '.join(map(repr, unknown))} (known: {known})"
        )
    return state


def check_tensor(
    what: str, t, *, dtype: torch.dtype | None = torch.float32, dim: int | None = None
) -> torch.Tensor:
    """``t`` is a tensor of ``dtype`` (and ``dim`` dimensions when given), all finite;
    returns it. A dense tensor whose elements fit its storage: a file holds each value
    once, and a view of a few bytes claiming 2**40 elements (stride 0; ``torch.save``
    keeps views) is refused before anything walks it."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{what}: expected a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise CheckpointError(f"{what}: expected a dense tensor, got layout {t.layout}")
    if t.numel() * t.element_size() > t.untyped_storage().nbytes():
        raise CheckpointError(
            f"{what}: {t.numel()} elements {tuple(t.shape)} over {t.untyped_storage().nbytes()} "
            "bytes of storage (a view repeating its values, not saved state)"
        )
    if dtype is not None and t.dtype != dtype:
        raise CheckpointError(f"{what}: dtype {t.dtype}, expected {dtype}")
    if dim is not None and t.dim() != dim:
        raise CheckpointError(f"{what}: {t.dim()}-D of shape {tuple(t.shape)}, expected {dim}-D")
    if (t.is_floating_point() or t.is_complex()) and t.numel():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise CheckpointError(f"{what}: {bad} of {t.numel()} values are NaN or infinite")
    return t


def check_tensor_map(what: str, state, *, dim: int | None = 1) -> dict[str, torch.Tensor]:
    """``state`` maps tensor names (str) to finite float32 tensors of ``dim`` dimensions."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{what}: expected a dict of tensors, got {type(state).__name__}")
    for name, t in state.items():
        if not isinstance(name, str):
            raise CheckpointError(f"{what}: key {name!r} is not a tensor name (str)")
        check_tensor(f"{what}[{name!r}]", t, dim=dim)
    return dict(state)


def check_count_map(what: str, state) -> dict[str, int]:
    """``state`` maps tensor names (str) to non-negative ints (step counters)."""
    state = check_dict(what, state)
    for name, v in state.items():
        if not isinstance(name, str) or type(v) is not int or v < 0:
            raise CheckpointError(
                f"{what}: must map tensor names to non-negative ints, got {name!r}: {v!r}"
            )
    return state


def check_names(what: str, names, known) -> None:
    """Every name in ``names`` is one of ``known`` (the tensors this optimizer has)."""
    unknown = sorted(str(n) for n in names if n not in known)
    if unknown:
        shown = ", ".join(map(repr, unknown[:5])) + (" ..." if len(unknown) > 5 else "")
        raise CheckpointError(
            f"{what}: unknown tensor names {shown}: not compressed tensors of this optimizer"
        )


def check_saved_value(what: str, value, expected) -> None:
    """A configuration value a state was saved with (a seed, a ratio) is this object's
    ``expected``: of its type and equal (a tensor or a list is refused, not compared);
    CheckpointError otherwise."""
    if type(value) is not type(expected) or value != expected:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(
            f"state was saved with {what} {shown}, this compressor has {expected!r}"
        )


def check_finite_number(what: str, value, *, low: float | None = None) -> float:
    """``value`` is a finite int or float (>= ``low`` when given); returns it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CheckpointError(f"{what}: expected a finite number, got {value!r}")
    if low is not None and value < low:
        raise CheckpointError(f"{what}: expected >= {low}, got {value!r}")
    return float(value)


def check_optimizer_state(ours, *, rank: int, size: int, compressor: str, shapes: Mapping) -> None:
    """The hvdcompress part of an optimizer state (``state_dict()["hvdcompress"]``) fits
    the optimizer that loads it: saved by this rank of this many ranks, with this
    compressor (``repr``), and every per-tensor entry names one of ``shapes`` (name ->
    shape of the compressed parameters) with a tensor of the right size, dtype float32
    and finite values. Compressors and policies check the rest of their own state."""
    check_keys(
        "optimizer state 'hvdcompress'", ours,
        required=("rank", "size", "compressor", "compressor_state"),
        optional=("policy", "layout"),
    )  # fmt: skip
    for key, kind in (("rank", int), ("size", int), ("compressor", str)):
        if type(ours[key]) is not kind:  # compared below: a tensor, say, must not get there
            raise CheckpointError(
                f"optimizer state 'hvdcompress' {key}: expected {kind.__name__}, "
                f"got {type(ours[key]).__name__}"
            )
    if ours["size"] != size:
        raise CheckpointError(
            f"this optimizer state was saved by rank {ours['rank']} of {ours['size']}, "
            f"loading on rank {rank} of {size}: a different world size ({ours['size']} "
            f"ranks saved, {size} load); error-feedback residuals are per rank and the "
            "two-stage exchange's are sharded over the ranks (no re-sharding): resume with "
            f"{ours['size']} ranks, or leave out state_dict()['hvdcompress']"
        )
    if ours["rank"] != rank:
        raise CheckpointError(
            f"this optimizer state was saved by rank {ours['rank']} of {ours['size']}, "
            f"loading on rank {rank} of {size}: error-feedback residuals are per "
            "rank, so each rank must load its own state"
        )
    if ours["compressor"] != compressor:
        raise CheckpointError(
            f"state saved with compressor {ours['compressor']}, this optimizer has {compressor}"
        )
    state = check_dict("compressor state", ours["compressor_state"])
    for key in PER_RANK_STATE:
        if key in state:
            tensors = check_tensor_map(f"compressor state {key}", state[key], dim=1)
            check_names(f"compressor state {key}", tensors, shapes)
            for name, t in tensors.items():
                numel = math.prod(shapes[name])
                if t.numel() != numel:
                    raise CheckpointError(
                        f"compressor state {key}[{name!r}]: {t.numel()} elements, the "
                        f"parameter has shape {tuple(shapes[name])} ({numel} elements)"
                    )
    if "steps" in state:
        steps = check_count_map("compressor state steps", state["steps"])
        check_names("compressor state steps", steps, shapes)
    if "qs" in state:
        qs = check_tensor_map("compressor state qs", state["qs"], dim=2)
        check_names("compressor state qs", qs, shapes)
        for name, q in qs.items():
            shape = tuple(shapes[name])
            n, cols = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (0, 0)
            if q.shape[0] != cols or not 1 <= q.shape[1] <= min(n, cols):
                raise CheckpointError(
                    f"compressor state qs[{name!r}]: shape {tuple(q.shape)} does not fit the "
                    f"parameter of shape {shape} (expected ({cols}, r), 1 <= r <= {min(n, cols)})"
                )
    policy = ours.get("policy")
    if isinstance(policy, Mapping):
        for key in ("current", "sums", "budgets", "levels", "numel"):
            if isinstance(policy.get(key), Mapping):
                check_names(f"policy state {key}", policy[key], shapes)
        numel = policy.get("numel")
        numel = {} if numel is None else check_dict("policy state numel", numel)
        for name, n in numel.items():
            if type(n) is not int or n != math.prod(shapes[name]):
                raise CheckpointError(
                    f"policy state numel[{name!r}]: {n!r}, the parameter has "
                    f"{math.prod(shapes[name])} elements"
                )


def without_other_ranks_state(ours: dict, rank: int, size: int) -> dict:
    """``ours`` (an hvdcompress state) for loading on ``rank`` of ``size``: as it is when
    that rank saved it (or another job size did: ``check_optimizer_state`` refuses that);
    saved by another rank of this job size (Horovod's rank-0 checkpoint recipe), without
    the saver's own error-feedback entries (``PER_RANK_STATE``), with a warning that says
    what is lost; the shared compressor and policy state load as they are."""
    saver = ours.get("rank")
    if type(saver) is not int or saver == rank or type(ours.get("size")) is not int:
        return ours  # check_optimizer_state refuses what is not an int
    if ours["size"] != size:
        return ours
    state = ours.get("compressor_state")
    dropped = []
    if isinstance(state, dict):
        state = dict(state)
        for key in PER_RANK_STATE:
            if isinstance(state.get(key), dict) and state[key]:
                dropped.append(f"{len(state[key])} {key}")
                state[key] = {}
    if dropped:
        warnings.warn(
            f"hvdcompress: this state was saved by rank {saver}; rank {rank} loads the inner "
            f"optimizer's state and the shared compressor and policy state, but not rank "
            f"{saver}'s error-feedback state ({', '.join(dropped)}): this rank's error "
            "feedback restarts from zero, so the gradient mass it had not yet sent is lost "
            "(at most about one step's compression error). To resume exactly, save and load "
            "each rank's own state (hvdcompress.save_checkpoint on every rank).",
            UserWarning,
            stacklevel=3,
        )
    return {**ours, "rank": rank, "compressor_state": state}


def check_layout(saved, current: dict, pieces: list[str]) -> None:
    """A checkpoint's ``layout`` (the exchange asked for and the nodes it was made on,
    ``Reducer.layout``) against this job's: ``CheckpointError`` where the state holds
    pieces of tensors (``pieces``: the two-stage and hierarchical exchanges' residuals,
    cut by the job's size and nodes) and the layout differs, since those pieces would be
    other pieces here and their residuals never sent. A state without pieces, or saved
    before layouts were recorded (None), loads as it is."""
    if saved is None:
        return
    check_keys("optimizer state 'hvdcompress' layout", saved, required=("exchange", "nodes"))
    nodes = saved["nodes"]
    ok_nodes = nodes is None or (
        isinstance(nodes, list)
        and all(isinstance(n, list) and all(type(r) is int for r in n) for n in nodes)
    )
    if not isinstance(saved["exchange"], str) or not ok_nodes:
        raise CheckpointError(
            "optimizer state 'hvdcompress' layout: expected an exchange (str) and nodes "
            f"(lists of ranks, or None), got {saved!r:.200}"
        )
    if pieces and saved != current:
        raise CheckpointError(
            f"this state was saved with exchange={saved['exchange']!r} on nodes "
            f"{saved['nodes']}; this job has exchange={current['exchange']!r} on nodes "
            f"{current['nodes']}: its {len(pieces)} pieces' residuals (e.g. {pieces[0]!r}) "
            "are cut for the other layout and would never be sent here. Resume on the same "
            "nodes with the same exchange, or leave out state_dict()['hvdcompress']"
        )
