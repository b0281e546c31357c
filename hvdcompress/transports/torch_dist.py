"""Collectives over ``torch.distributed`` (gloo on CPU, NCCL on GPUs): see
hvdcompress.transports. The transport of the DDP communication hook (``hvdcompress.ddp``).

Two ways to run (``threaded``):

- **inline** (default): every collective runs when it is started, on the caller's
  thread, and its handle is already done;
- **threaded**: the transport owns a process group of its own (``new_group`` over the
  same ranks, made collectively when the transport is built) and one worker thread,
  which runs the collectives in the order they were started. ``start_*`` returns at
  once, so the caller (DDP's autograd thread) goes on with backward while the bytes
  move. Invariant: collectives are started from one thread per transport, in the same
  order on every rank, so the worker's order is the same on every rank; a group of its
  own keeps them apart from DDP's and the user's collectives on the other groups.
  That group inherits the timeout of the group it is made from (``group_timeout``: the
  user's ``init_process_group(timeout=...)``), so a stalled rank fails the job after the
  user's timeout, not after gloo's default of 30 minutes.

NCCL moves only device tensors, so with it the bytes travel on the current CUDA device.

A process that ends on an uncaught exception while a threaded transport is open (a rank
whose backward raised, or whose peer's did: docs/checkpoints-and-faults.md, "A rank that
raises") leaves at once with status 1, its output flushed (``_exit_on_uncaught``): the
transport's group may have a collective that its gone peers will never finish, and
tearing it down at interpreter shutdown aborted a rank ("terminate called without an
active exception", SIGABRT) in 2 of 10 such jobs on 2 x 2 nodes, so that torchrun
reported -6 instead of the exception.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import sys
import weakref
from datetime import timedelta

import torch

from hvdcompress.transports import slots
from hvdcompress.transports.base import (
    Handle,
    Transport,
    check_alltoallv_parts,
    drain_worker,
    start_worker,
)

_CLOSED = object()  # the group of a closed threaded transport
_OPEN: weakref.WeakSet = weakref.WeakSet()  # threaded transports not closed yet


def _exit_on_uncaught() -> None:
    """At interpreter exit (``atexit``): where an uncaught exception ends the process and
    a threaded transport is still open, flush the output and logs and leave with status
    1, as Python would, without tearing its process groups down (module doc)."""
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if uncaught is None or not len(_OPEN):
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(1)


atexit.register(_exit_on_uncaught)


def group_timeout(process_group=None) -> timedelta | None:
    """The timeout of ``process_group`` (None: the world) as its backend holds it: the
    ``timeout=`` given to ``init_process_group`` / ``new_group``, else torch's default
    for the backend. None where the backend does not say (an out-of-tree backend):
    ``new_group`` then applies torch's default."""
    import torch.distributed as dist

    group = dist.group.WORLD if process_group is None else process_group
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:  # gloo's and NCCL's options hold it; torch has no public getter (2.13)
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


class TorchDistTransport(Transport):
    """Collectives over a ``torch.distributed`` process group (default: the world);
    ``threaded``: on a worker thread and a group of their own (module doc)."""

    name = "torch.distributed"
    splits = True

    def __init__(self, process_group=None, *, threaded: bool = False) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group (torchrun sets its environment)"
            )
        self.dist = dist
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        # torchrun's count of ranks on this node (1 when launched otherwise)
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        backend = dist.get_backend(process_group)
        nccl = backend == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        self.group = process_group
        self._jobs: queue.SimpleQueue | None = None
        if threaded:
            # collective over the world: every rank builds its transport at the same point
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            timeout = group_timeout(process_group)
            self.group = dist.new_group(ranks, backend=backend, timeout=timeout)
            self._jobs = start_worker(self, "hvdcompress-torch-dist")
            _OPEN.add(self)

    def _split(self, groups, mine: tuple[int, ...]) -> TorchDistTransport:
        # new_group is collective over the world: every rank makes every group, in order;
        # each inherits this group's timeout (the user's)
        world = self.dist.get_process_group_ranks(self.group or self.dist.group.WORLD)
        backend, timeout = self.dist.get_backend(self.group), group_timeout(self.group)
        made = [
            self.dist.new_group([world[r] for r in g], backend=backend, timeout=timeout)
            for g in groups
        ]
        return TorchDistTransport(made[groups.index(mine)])

    def node_key(self) -> object:
        """torchrun's node index (``GROUP_RANK``) where torchrun launched the rank."""
        group_rank = os.environ.get("GROUP_RANK")
        return ("torchrun", int(group_rank)) if group_rank is not None else super().node_key()

    def close(self) -> None:
        """Threaded: end the worker after the collectives already started, then free the
        transport's own process group (its gloo threads end here, not at interpreter
        shutdown). Inline: nothing (the group is the caller's). Idempotent."""
        if self._jobs is None:
            return
        drain_worker(self._jobs)
        self._jobs = None
        _OPEN.discard(self)
        group, self.group = self.group, _CLOSED
        self.dist.destroy_process_group(group)
        # the last reference to the group: its C++ object and gloo threads end now, not
        # when the interpreter exits (where, held by a transport the user's hook state
        # kept, its destruction aborted about one run in 30 of the README's recipe)
        del group

    def _run(self, job, *, measured: bool = False) -> Handle:
        """A handle of ``job``'s result; ``measured``: ``job`` returns (result,
        ``slots.Wire``), and the handle carries what went on the wire."""
        if self.group is _CLOSED:
            raise RuntimeError("this torch.distributed transport is closed (close())")
        handle = Handle()

        def run():
            if not measured:
                return job()
            result, handle._wire = job()
            return result

        if self._jobs is None:  # inline: the collective runs now; its error comes from wait()
            handle._run(run)
        else:
            self._jobs.put(functools.partial(handle._run, run))
        return handle

    def _on_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self._device) if self._device is not None else t.cpu()

    # allgatherv / alltoallv: sizes carried in slots with the data (transports.slots)
    def start_allgatherv(self, local: torch.Tensor, *, key=None) -> Handle:
        local = self._on_wire(local.detach().reshape(-1).to(torch.uint8))
        caps = slots.capacities(self)

        def job():
            gathered, sizes, wire = slots.allgatherv(
                local, caps, key, self.rank, self.size, self._gather_var
            )
            return (gathered.cpu(), sizes), wire

        return self._run(job, measured=True)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts)

    def _gather_var(self, t: torch.Tensor, counts: list[int]):
        """All ranks' ``t`` (``counts[r]`` bytes on rank r): gloo and NCCL gather equal
        sizes, so each pads to the largest; (concatenation, bytes sent, bytes received)."""
        width = max(counts)
        padded = torch.zeros(width, dtype=torch.uint8, device=t.device)
        padded[: t.numel()] = t
        rows = self._gather(padded).view(self.size, width)
        gathered = torch.cat([rows[r, :n] for r, n in enumerate(counts)])
        return gathered, (self.size - 1) * width, (self.size - 1) * width

    def start_alltoallv(self, parts: list[torch.Tensor], *, key=None) -> Handle:
        check_alltoallv_parts(parts, self.size)
        parts = [self._on_wire(p.detach()) for p in parts]
        caps, device = slots.capacities(self), self._device or torch.device("cpu")

        def job():
            got, wire = slots.alltoallv(parts, caps, key, self.rank, self._exchange, device)
            return [g.cpu() for g in got], wire  # host bytes (Transport.moves_on)

        return self._run(job, measured=True)

    def _exchange(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]):
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        self.dist.all_to_all_single(
            recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
            group=self.group,
        )  # fmt: skip
        return recv

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        total = self._on_wire(dense.detach()).clone()
        device = dense.device

        def job():
            self.dist.all_reduce(total, op=self.dist.ReduceOp.SUM, group=self.group)
            return total.to(device)

        return self._run(job)

    # the blocking helpers run on the worker too (threaded): one thread per group
    def allgather_object(self, obj) -> list:
        def job():
            out = [None] * self.size
            self.dist.all_gather_object(out, obj, group=self.group)
            return out

        return self._run(job).wait()

    def broadcast_(self, tensors, root: int = 0) -> None:
        def job():
            for t in tensors:
                buf = self._on_wire(t.detach()).contiguous()
                self.dist.broadcast(buf, src=root, group=self.group)
                t.data.copy_(buf)

        self._run(job).wait()

    def sum_floats(self, values) -> list[float]:
        t = self._on_wire(torch.tensor([float(v) for v in values], dtype=torch.float64))

        def job():
            self.dist.all_reduce(t, group=self.group)
            return t.cpu().tolist()

        return self._run(job).wait()

    def barrier(self) -> None:
        self._run(lambda: self.dist.barrier(group=self.group)).wait()
