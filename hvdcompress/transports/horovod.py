"""Collectives through horovod.torch: see hvdcompress.transports.

``split`` (the node and cross-node transports of the hierarchical exchange) makes Horovod
process sets with ``hvd.add_process_set``, which needs dynamic process sets:
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` in the environment before ``hvd.init()`` (or
``hvd.init(process_sets="dynamic")``); without them ``split`` raises at once on every
rank, saying so (never a hang).

Faults are Horovod's (docs/checkpoints-and-faults.md, "Faults"), except that Horovod
0.28.1 under Gloo has no stall check: there a ``GlooStallWatch`` (transports.gloo_watch)
watches every collective of this transport, asynchronous and blocking, with Horovod's
variables ("Stall check").
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct

import numpy as np
import torch

from hvdcompress.transports.base import Handle, Transport, _DoneHandle, check_alltoallv_parts
from hvdcompress.transports.gloo_watch import GlooStallWatch
from hvdcompress.transports.mpi_faults import stall_settings

_LEN = struct.Struct("<Q")


class HorovodTransport(Transport):
    """Collectives through ``horovod.torch`` (initialised here if the caller has not).

    ``process_set`` (an ``hvd.ProcessSet`` this rank belongs to; None: every rank): every
    collective runs over that set, and ``rank`` / ``size`` are this rank's place in it.
    ``prefix``: the names of its collectives (``split`` gives each of its transports its
    own, as two transports may share a set)."""

    name = "horovod"

    def __init__(self, process_set=None, *, prefix: str | None = None) -> None:
        import horovod.torch as hvd

        if not hvd.is_initialized():
            hvd.init()
        self.hvd = hvd
        self._set = process_set if process_set is not None else hvd.global_process_set
        if not self._set.included():
            raise ValueError(f"this rank ({hvd.rank()}) is not in {self._set}")
        self.rank = self._set.rank()
        self.size = self._set.size()
        self.local_size = hvd.local_size()
        self._cross_rank = hvd.cross_rank()  # the node's index among the nodes
        self._prefix = prefix or f"hvdcompress.set{self._set.process_set_id}"
        self._count = 0
        self._splits = 0
        self._watch: GlooStallWatch | None = None
        if hvd.gloo_enabled() and self.size > 1:
            check, shutdown = stall_settings()
            if check is not None:
                self._watch = GlooStallWatch(hvd.poll, self.rank, check, shutdown)

    def _launch(self, kind: str, start, *args, **kwargs):
        """``start(*args, **kwargs)`` (an ``hvd.*_async``) over this set as collective
        ``kind``; its handle, watched under Gloo from before the submit."""
        name = self._name(kind)
        if self._watch is None:
            return start(*args, name=name, process_set=self._set, **kwargs)
        self._watch.submitting(name)
        try:
            handle = start(*args, name=name, process_set=self._set, **kwargs)
        except BaseException:
            self._watch.dropped(name)
            raise
        self._watch.submitted(name, handle)
        return handle

    def _wait(self, handle):
        """``hvd.synchronize(handle)``; the watch (under Gloo) no longer counts it."""
        try:
            return self.hvd.synchronize(handle)
        finally:
            if self._watch is not None:
                self._watch.waited(handle)

    def _blocking(self, kind: str):
        """The context of one blocking collective ``kind``: its name, watched under Gloo."""
        name = self._name(kind)
        if self._watch is None:
            return contextlib.nullcontext(name)
        return self._watch.blocking(name)

    def _name(self, kind: str) -> str:
        # Horovod matches collectives across ranks by name: a per-transport counter is the
        # same on every rank because every rank starts collectives in the same order.
        self._count += 1
        return f"{self._prefix}.{kind}.{self._count}"

    @property
    def splits(self) -> bool:
        """Whether ``split`` works here: the global set, with dynamic process sets."""
        return self._set.process_set_id == 0 and _dynamic_sets()

    def _split(self, groups, mine: tuple[int, ...]) -> HorovodTransport:
        """A process set per group, the one of ``mine`` as the new transport's. Adding a
        process set is collective over every Horovod rank: only the global set splits.
        A set of the same ranks that exists already (the user's, or an earlier split's)
        is used as it is."""
        hvd = self.hvd
        if self._set.process_set_id != 0:
            raise NotImplementedError(
                "a Horovod transport over a process set cannot split: Horovod adds process "
                "sets collectively over all its ranks; split the global transport"
            )
        if not _dynamic_sets():
            raise RuntimeError(
                "splitting the Horovod transport (exchange='hierarchical') needs Horovod's "
                "dynamic process sets: set HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment "
                "of every rank before hvd.init() (e.g. horovodrun -x / export), or call "
                "hvd.init(process_sets='dynamic') before building the optimizer"
            )
        from horovod.common.process_sets import ProcessSet, _basics

        existing = {tuple(r): i for i, r in _basics._get_process_set_ids_and_ranks().items()}
        sets = []
        for g in groups:  # every rank adds every set, in the same order
            ranks = sorted(g)
            if tuple(ranks) in existing:
                ps = ProcessSet(ranks)
                ps.process_set_id = existing[tuple(ranks)]
            else:
                try:
                    ps = hvd.add_process_set(ranks)
                except ValueError as err:  # Horovod's words on dynamic sets, ours first
                    raise RuntimeError(
                        "Horovod refused a process set for the split (exchange="
                        "'hierarchical' needs HOROVOD_DYNAMIC_PROCESS_SETS=1 before "
                        f"hvd.init()): {err}"
                    ) from err
            sets.append(ps)
        self._splits += 1
        ps = sets[groups.index(mine)]
        return HorovodTransport(
            ps, prefix=f"{self._prefix}.split{self._splits}.set{ps.process_set_id}"
        )

    def node_key(self) -> object:
        """Horovod's cross rank: the index of this rank's node."""
        return ("horovod", self._cross_rank)

    def start_allgatherv(self, local: torch.Tensor, *, key=None) -> Handle:
        # Horovod gathers variable sizes itself (its coordinator knows them): ``key`` unused
        hvd = self.hvd
        local = local.detach().reshape(-1).to(torch.uint8)
        prefix = torch.frombuffer(bytearray(_LEN.pack(local.numel())), dtype=torch.uint8)
        framed = torch.cat([prefix.to(local.device), local])
        if not self.moves_on(framed.device):
            framed = framed.cpu()
        handle = self._launch("allgatherv", hvd.allgather_async, framed)
        size, device = self.size, framed.device
        return _DoneHandle(lambda: _strip_length_prefixes(self._wait(handle).to(device), size))

    def moves_on(self, device: torch.device) -> bool:
        """The host, and a CUDA device when Horovod was built with GPU support
        (``hvd.cuda_built()`` or ``hvd.rocm_built()``): horovod.torch then gathers device
        tensors and returns the result on the device."""
        if device.type == "cuda":
            return bool(self.hvd.cuda_built() or self.hvd.rocm_built())
        return device.type == "cpu"

    def start_alltoallv(self, parts: list[torch.Tensor], *, key=None) -> Handle:
        check_alltoallv_parts(parts, self.size)
        hvd = self.hvd
        devices = {p.device for p in parts}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        if not self.moves_on(device):
            device = torch.device("cpu")
        send = torch.cat([p.detach().to(device) for p in parts])
        splits = torch.tensor([p.numel() for p in parts], dtype=torch.int32)  # on the host
        handle = self._launch("alltoallv", hvd.alltoall_async, send, splits=splits)

        def finish():
            received, received_splits = self._wait(handle)
            return list(received.to(device).split(received_splits.tolist()))

        return _DoneHandle(finish)

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        hvd = self.hvd
        src = dense.detach().contiguous()
        if src.dtype == torch.bfloat16 and not src.is_cuda:
            # Horovod 0.28.1 has no bfloat16 CPU allreduce: gather the bits, sum in rank
            # order in float32 rounding each add to bfloat16 (same on every rank).
            from hvdcompress.transports.simulated import sum_in_rank_order

            handle = self._launch("bf16sum", hvd.allgather_async, src.view(torch.int16))
            n, size = src.numel(), self.size

            def finish():
                parts = self._wait(handle).view(torch.bfloat16).view(size, n)
                return sum_in_rank_order(list(parts)).to(dense.device)

            return _DoneHandle(finish)
        handle = self._launch("allreduce", hvd.allreduce_async, src, op=hvd.Sum)
        return _DoneHandle(lambda: self._wait(handle).to(dense.device))

    def allgather_object(self, obj) -> list:
        if self._set.process_set_id == 0:
            with self._blocking("object") as name:
                return self.hvd.allgather_object(obj, name=name)
        # hvd.allgather_object has no process_set in 0.28.1: pickled bytes, framed as above
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        gathered, sizes = self.start_allgatherv(data).wait()
        return [pickle.loads(part.numpy().tobytes()) for part in gathered.split(sizes)]

    def broadcast_(self, tensors, root: int = 0) -> None:
        for t in tensors:
            buf = t.data if t.data.is_contiguous() else t.detach().contiguous()
            # Horovod 0.28.1 has no bfloat16 on CPU: its bits travel as int16
            bits = buf.view(torch.int16) if buf.dtype == torch.bfloat16 else buf
            with self._blocking("broadcast") as name:
                self.hvd.broadcast_(bits, root_rank=root, name=name, process_set=self._set)
            if buf is not t.data:
                t.data.copy_(buf)

    def sum_floats(self, values) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        with self._blocking("sum") as name:
            total = self.hvd.allreduce(t, op=self.hvd.Sum, name=name, process_set=self._set)
        return total.tolist()

    def barrier(self) -> None:
        with self._blocking("barrier"):
            self.hvd.barrier(process_set=self._set)


def _dynamic_sets() -> bool:
    """Whether ``HOROVOD_DYNAMIC_PROCESS_SETS`` asks for dynamic process sets."""
    value = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _strip_length_prefixes(gathered: torch.Tensor, size: int) -> tuple[torch.Tensor, list[int]]:
    """Undo HorovodTransport's framing: ``size`` x (8-byte length, bytes) -> (bytes, sizes),
    on the gathered bytes' device (a device's lengths are read by one small kernel,
    kernels/threelc.cu hvd_length_prefixes, not by copying the bytes to the host)."""
    if gathered.device.type == "cpu":
        verdict = length_prefix_verdict(gathered.numpy(), size)
    else:
        from hvdcompress import backends

        verdict = backends.for_device(gathered.device).length_prefixes(gathered, size)
    status, where = int(verdict[0]), int(verdict[1])
    if status == -1:
        raise RuntimeError(f"allgather: rank {where}'s length prefix is missing")
    if status == -2:
        n = int(verdict[2 + where]) % 2**64  # the prefix as sent: uint64
        raise RuntimeError(f"allgather: rank {where} announced {n} bytes, fewer arrived")
    if status == -3:
        raise RuntimeError(f"allgather: {where} unexpected trailing bytes")
    sizes = [int(n) for n in verdict[2:]]
    parts, offset = [], 0
    for n in sizes:
        parts.append(gathered[offset + _LEN.size : offset + _LEN.size + n])
        offset += _LEN.size + n
    return torch.cat(parts) if parts else gathered[:0], sizes


def length_prefix_verdict(raw: np.ndarray, size: int) -> np.ndarray:
    """The host's verdict on ``size`` x (8-byte length, bytes) in ``raw`` (uint8), in the
    form of the CUDA backend's ``length_prefixes``: int64 [1, 0, each rank's count], or
    [-1, rank] (its prefix is missing), [-2, rank, counts up to it] (it announced more
    bytes than arrived), [-3, trailing bytes]."""
    out = np.zeros(size + 2, dtype=np.int64)
    offset = 0
    for rank in range(size):
        if offset + _LEN.size > raw.size:
            out[:2] = -1, rank
            return out
        (n,) = _LEN.unpack_from(raw, offset)
        offset += _LEN.size
        out[2 + rank] = np.uint64(n).astype(np.int64)
        if n > raw.size - offset:
            out[:2] = -2, rank
            return out
        offset += n
    if offset != raw.size:
        out[:2] = -3, raw.size - offset
        return out
    out[0] = 1
    return out
