"""Buckets (which gradients travel together) and the start-up agreement check
(docs/design.md, "The exchange", step 1; docs/wire-format.md, "Agreement at start-up").

Invariant: every rank builds the same buckets in the same order, so collectives started
in bucket order match across ranks without a coordinator; ``check_agreement`` proves it
once, at construction, and raises ``RankAgreementError`` on every rank otherwise.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hvdcompress.errors import RankAgreementError


@dataclass
class Bucket:
    """Parameters whose gradients travel in one collective."""

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    nbytes: int = 0
    ready: set[int] = field(default_factory=set)  # positions in params whose grads are ready
    compressed: bool = True  # False: below compress_min_numel, sent as is (allreduce)

    def add(self, name: str, p: torch.nn.Parameter) -> None:
        self.params.append(p)
        self.names.append(name)
        self.nbytes += p.numel() * p.element_size()


class PieceKey(NamedTuple):
    """The compressor-state key of a piece of a tensor (the two-stage exchange's shards):
    elements ``[start, stop)`` of the flat tensor ``name``; ``owner``: the state of the
    shard's owner (the residual of its re-compressed average), else every sender's
    (``hvdcompress.exchange.twostage.Piece``). A compressor keys its per-tensor state by
    a tensor name (str) or a PieceKey alike.

    ``str`` gives the name it has where a string is needed: the tensor id a payload
    carries (``primitives.tensor_id``) and the checkpoint's keys, ``name[start:stop]``
    with ``@owner`` appended; ``state_key`` reads a checkpoint's key back."""

    name: str
    start: int
    stop: int
    owner: bool = False

    def __str__(self) -> str:
        return f"{self.name}[{self.start}:{self.stop}]" + ("@owner" if self.owner else "")

    @classmethod
    def parse(cls, text: str) -> PieceKey | None:
        """The PieceKey whose ``str`` is ``text``, else None (a tensor's own name)."""
        m = _PIECE_TEXT.fullmatch(text)
        if m is None:
            return None
        return cls(m["name"], int(m["start"]), int(m["stop"]), m["owner"] is not None)


_PIECE_TEXT = re.compile(r"(?P<name>.+)\[(?P<start>\d+):(?P<stop>\d+)\](?P<owner>@owner)?")

StateKey = str | PieceKey  # what a compressor keys its per-tensor state by


def state_key(text: str) -> StateKey:
    """A checkpoint's key (``str`` of a StateKey) as the key it was: checkpoints keep
    strings, so that they read the same as before pieces had keys of their own."""
    return PieceKey.parse(text) or text


def state_text(state: dict) -> dict:
    """``state`` (StateKey -> value) with its keys as a checkpoint writes them."""
    return {str(k): v for k, v in state.items()}


def named_params(optimizer, named_parameters) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, parameter) pairs of ``optimizer``'s trainable parameters, checked
    against ``named_parameters`` (unique names, every optimizer parameter named)."""
    all_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:  # Horovod's names: parameter j of param group i
        return [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
            if p.requires_grad
        ]
    if isinstance(named_parameters, (str, bytes, dict, torch.Tensor)):
        raise ValueError(
            "named_parameters must be an iterable of (name, parameter) pairs, e.g. "
            f"model.named_parameters(), got a {type(named_parameters).__name__}"
        )
    named = list(named_parameters)
    for item in named:
        pair = isinstance(item, tuple) and len(item) == 2
        if not (pair and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)):
            raise ValueError(
                "named_parameters must be (str name, tensor) pairs, e.g. "
                f"model.named_parameters(), got {_short(item)}"
            )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique, repeated: {dups[:5]}")
    seen: dict[int, str] = {}
    for n, p in named:
        if id(p) in seen:
            raise ValueError(
                f"parameter {n!r} is the same tensor as {seen[id(p)]!r}: each parameter "
                "must be named once"
            )
        seen[id(p)] = n
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(all_params) if id(p) not in known]
    if missing:
        raise ValueError(
            f"{len(missing)} optimizer parameter(s) are not in named_parameters "
            "(pass model.named_parameters() of the model the optimizer trains)"
        )
    in_optimizer = {id(p) for p in all_params}
    return [(n, p) for n, p in named if id(p) in in_optimizer and p.requires_grad]


def _short(item) -> str:
    text = repr(item) if not isinstance(item, torch.Tensor) else f"a tensor {tuple(item.shape)}"
    return text if len(text) <= 80 else text[:77] + "..."


DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024  # Horovod's default fusion buffer


def resolve_fusion_threshold(value: int | None) -> int:
    """``value``, or Horovod's ``HOROVOD_FUSION_THRESHOLD``, or 64 MiB (the caller checks
    that it is an int >= 0)."""
    if value is None:
        env = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        if env is None:
            return DEFAULT_FUSION_THRESHOLD
        try:
            return int(env)
        except ValueError:
            raise ValueError(
                f"HOROVOD_FUSION_THRESHOLD must be an int >= 0 (bytes), got {env!r}"
            ) from None
    return value


def make_buckets(
    named, threshold: int, min_numel: int = 0, groups: list[list[str]] | None = None
) -> list[Bucket]:
    """Buckets from reversed parameter order, split at ``threshold`` bytes or a dtype change;
    tensors of fewer than ``min_numel`` elements go in buckets of their own, uncompressed.

    ``groups`` (names; Horovod's ``groups=``, see ``resolve_groups``): each group is one
    bucket (split only where dtype, device or compression differ), whatever its size;
    groups start in the order their last parameter's gradient becomes ready (the one
    latest in parameter order first)."""
    param = dict(named)
    if groups is None:
        runs = [[n for n, _ in reversed(named)]]
    else:
        position = {n: i for i, (n, _) in enumerate(named)}
        runs = [
            sorted(g, key=lambda n: -position[n])
            for g in sorted(groups, key=lambda g: -max(position[n] for n in g))
        ]
        threshold = math.inf  # a group is one bucket whatever its size
    buckets: list[Bucket] = []
    for run in runs:
        open_by_kind: dict[tuple, Bucket] = {}
        for name in run:
            p = param[name]
            compressed = p.numel() >= min_numel
            kind = (p.dtype, p.device, compressed)
            b = open_by_kind.get(kind)
            if b is None or (b.params and b.nbytes + p.numel() * p.element_size() > threshold):
                b = open_by_kind[kind] = Bucket(len(buckets), [], [], compressed=compressed)
                buckets.append(b)
            b.add(name, p)
    return buckets


def resolve_groups(groups, named) -> list[list[str]] | None:
    """Horovod's ``groups=`` as lists of parameter names (None: no explicit groups).

    An int n > 0: the trainable parameters in parameter order, split into n contiguous,
    nearly equal groups (the first ``len % n`` one longer, as Horovod splits them). A list
    of lists of tensors: each inner list one group (tensors the optimizer does not train
    are left out, as in Horovod), every other parameter a group of its own. Invalid
    values get Horovod's ValueError texts."""
    if groups is None:
        return None
    if isinstance(groups, bool) or not (
        isinstance(groups, list) or (isinstance(groups, int) and groups > 0)
    ):
        raise ValueError(
            "groups should be a non-negative integer or a list of list of torch.Tensor."
        )
    names = [n for n, _ in named]
    if isinstance(groups, int):
        count = min(groups, len(names))
        size, extra = divmod(len(names), count) if count else (0, 0)
        bounds = [i * size + min(i, extra) for i in range(count + 1)]
        return [names[bounds[i] : bounds[i + 1]] for i in range(count)]
    name_of = {id(p): n for n, p in named}
    seen: set[int] = set()
    out: list[list[str]] = []
    for group in groups:
        if not isinstance(group, (list, tuple)):
            raise ValueError("groups must consist of torch.Tensor.")
        chosen = []
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
            if id(p) in name_of:
                chosen.append(name_of[id(p)])
        if chosen:
            out.append(chosen)
    out += [[n] for n, p in named if id(p) not in seen]
    return out


def describe(settings: list[str], named, buckets: list[Bucket]) -> list[str]:
    """What every rank must agree on: the settings, every tensor, every bucket."""
    lines = list(settings)
    lines += [f"tensor {n} {tuple(p.shape)} {p.dtype}" for n, p in named]
    lines += [f"bucket {b.index}: {b.names}" for b in buckets]
    return lines


def check_agreement(transport, lines: list[str]) -> None:
    """Raise RankAgreementError on every rank unless every rank describes the same
    communication (``lines``): one digest allgather, and a second one of the
    descriptions only when the digests differ, to name the first difference."""
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests = transport.allgather_object(digest)
    if len(set(digests)) == 1:
        return
    described = transport.allgather_object(lines)  # every rank takes this branch
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    r = odd[0]
    ref, other = described[0], described[r]
    diff = next(
        (i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
        min(len(ref), len(other)),
    )
    line0 = ref[diff] if diff < len(ref) else "<nothing>"
    liner = other[diff] if diff < len(other) else "<nothing>"
    raise RankAgreementError(
        f"ranks disagree on the gradients they will communicate: ranks {odd} differ "
        f"from rank 0; first difference (item {diff}): rank 0 has {line0!r}, rank {r} "
        f"has {liner!r}. Every rank must build the same model, parameter order, "
        "dtypes and compressor."
    )
