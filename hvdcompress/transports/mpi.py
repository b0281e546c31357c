"""Collectives over mpi4py: see hvdcompress.transports.

Faults (docs/checkpoints-and-faults.md, "Faults", "The mpi4py side channel", "Stall
check"): no fault may leave a rank waiting forever. An unhandled exception tells the
other ranks over the side channel and calls ``MPI_Abort`` (``sys.excepthook``, installed
once per process; ``HVDC_ABORT_ON_EXCEPTION=0`` turns it off); a rank that exits tells
the others how many collectives it started, so a rank waiting for one it never will
aborts; Horovod's ``HOROVOD_STALL_*`` variables drive the stall check. The side channel
is its own duplicated communicator, used only by one watcher thread per transport
(``_Watcher``), so the worker's collective order is untouched.

Exit (docs/checkpoints-and-faults.md, "Clean exits"): an atexit function ends each
transport's worker thread (``stop_worker``) and then its watcher. mpi4py calls
``MPI_Finalize`` later, from ``Py_AtExit`` at the end of interpreter shutdown, when daemon
threads still exist: none of this module's may be inside MPI then.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable

import numpy as np
import torch

from hvdcompress.transports import slots
from hvdcompress.transports.base import Handle, Transport, check_alltoallv_parts

POLL_S = 0.1  # the watcher's polling period
ABORT_GRACE_S = 2.0  # how long a failing rank waits for the others to acknowledge
REPLY_TIMEOUT_S = 2.0  # a rank that has not answered a stall query by then is "not answering"
DEFAULT_STALL_CHECK_S = 60.0

# side-channel tags
_QUERY, _REPLY, _FAIL, _EXIT, _ACK = 11, 12, 13, 14, 15


def _add_16bit(dtype: torch.dtype):
    """An MPI user op that sums 2-byte floats in float32 and rounds back (Horovod's rule)."""

    def add(inbuf, outbuf, datatype) -> None:
        a = torch.frombuffer(inbuf, dtype=dtype)
        b = torch.frombuffer(outbuf, dtype=dtype)
        b.copy_(a.float() + b.float())

    return add


_OPS_16BIT: dict = {}


def _parts_spec(buf: np.ndarray, sizes: np.ndarray, MPI) -> list:
    """mpi4py's spec of the bytes ``buf`` as parts of ``sizes`` bytes, one after another."""
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return [buf, (sizes.tolist(), displs.tolist()), MPI.UNSIGNED_CHAR]


def _sum_ops_16bit(MPI) -> dict:
    """The float16/bfloat16 sum ops, created once per process (MPI allows few user ops)."""
    if not _OPS_16BIT:
        for dtype in (torch.float16, torch.bfloat16):
            _OPS_16BIT[dtype] = MPI.Op.Create(_add_16bit(dtype), commute=True)
    return _OPS_16BIT


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


def stall_settings() -> tuple[float | None, float]:
    """(check time or None when disabled, shutdown time or 0) from Horovod's variables."""
    disable = os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "").strip().lower()
    check = _env_seconds("HOROVOD_STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_CHECK_S)
    shutdown = _env_seconds("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0)
    if disable not in ("", "0", "false", "no", "off") or check <= 0:
        return None, 0.0
    if 0 < shutdown < check:
        _say(
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is less than HOROVOD_STALL_CHECK_TIME_SECONDS: "
            "will not shut down (as Horovod)"
        )
        shutdown = 0.0
    return check, max(shutdown, 0.0)


def _say(text: str, rank: int | None = None) -> None:
    who = "hvdcompress" if rank is None else f"hvdcompress rank {rank}"
    with contextlib.suppress(Exception):  # a closed stderr must not stop an abort
        sys.stderr.write(f"[{who}] {text}\n")
        sys.stderr.flush()


def _main_thread_at() -> str:
    """Where the main thread is (innermost frame), for stall reports."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "main thread gone"
    fs = traceback.extract_stack(frame)[-1]
    return f"main thread at {os.path.basename(fs.filename)}:{fs.lineno} in {fs.name}"


class _Progress:
    """What one rank has done, as shared with the others (plain ints and tuples)."""

    def __init__(self) -> None:
        self.started = 0  # data collectives the worker has entered
        self.data_now: tuple[int, str, float] | None = None  # (index, what, since)
        self.control = 0  # blocking collectives of the main thread entered
        self.control_now: tuple[int, str, float] | None = None
        self.last_start = time.monotonic()

    def snapshot(self) -> dict:
        return {
            "started": self.started,
            "control": self.control,
            "idle_s": time.monotonic() - self.last_start,
            "at": _main_thread_at(),
        }


class _Watcher:
    """The side channel of one transport (see the module doc)."""

    def __init__(self, transport: MPITransport) -> None:
        self.t = weakref.proxy(transport)
        self.rank, self.size = transport.rank, transport.size
        self.progress = transport._progress
        self.comm = transport.comm.Dup()  # collective: every rank builds its transport
        self.check_s, self.shutdown_s = stall_settings()
        self.exited: dict[int, dict] = {}
        self.answered: set[int] = set()  # ranks that acknowledged our failure notice
        self.failed: dict[int, str] = {}
        self._sends: list = []
        self._query: dict | None = None  # the stall query in progress
        self._next_check: dict[tuple, float] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one thread at a time on self.comm
        self.thread = threading.Thread(target=self._run, name="hvdcompress-watch", daemon=True)
        self.thread.start()

    # ---- messages ---------------------------------------------------------------------------
    def _send(self, obj, dest: int, tag: int) -> None:
        self._sends.append(self.comm.isend(obj, dest=dest, tag=tag))

    def _send_all(self, obj, tag: int) -> None:
        """To every other rank that has not exited."""
        for r in range(self.size):
            if r != self.rank and r not in self.exited:
                self._send(obj, r, tag)

    def _flush_sends(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._sends and time.monotonic() < deadline:
            self._sends = [r for r in self._sends if not r.Test()]
            if self._sends:
                time.sleep(0.01)

    def _receive(self) -> None:
        MPI = self.t.MPI
        status = MPI.Status()
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            src, tag = status.Get_source(), status.Get_tag()
            msg = self.comm.recv(source=src, tag=tag)
            if tag == _QUERY:
                self._send({"qid": msg, **self.progress.snapshot()}, src, _REPLY)
            elif tag == _REPLY:
                if self._query is not None and msg["qid"] == self._query["qid"]:
                    self._query["replies"][src] = msg
            elif tag == _FAIL:
                self.failed[src] = msg
                _say(
                    f"rank {src} failed and aborts the job: {msg} (its traceback is in its output)",
                    self.rank,
                )
                self._send(None, src, _ACK)
            elif tag == _ACK:
                self.answered.add(src)
            elif tag == _EXIT:
                self.exited[src] = msg

    # ---- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._receive()
                    self._sends = [r for r in self._sends if not r.Test()]
                    self._check_exited()
                    if self.check_s is not None:
                        self._check_stall()
            except ReferenceError:  # the transport is gone
                return
            except Exception as err:  # noqa: BLE001 - the watcher must never take a rank down
                _say(f"side channel stopped: {err!r}", self.rank)
                return

    def _waiting(self) -> list[tuple[str, int, str, float]]:
        """The collectives this rank waits in now: (sequence, index, what, since)."""
        now = (("data", self.progress.data_now), ("control", self.progress.control_now))
        return [(seq, *at) for seq, at in now if at is not None]

    def _check_exited(self) -> None:
        for seq, index, what, _ in self._waiting():
            for r, final in sorted(self.exited.items()):
                done = final["started"] if seq == "data" else final["control"]
                if index > done:
                    self._abort(
                        f"rank {r} exited after starting {done} {seq} collectives; this rank "
                        f"waits in {seq} collective #{index} ({what}), which rank {r} will "
                        "never start: aborting the job"
                    )

    def _check_stall(self) -> None:
        now = time.monotonic()
        waiting = self._waiting()
        q = self._query
        if q is not None:
            peers = [r for r in range(self.size) if r != self.rank and r not in self.exited]
            if len(q["replies"]) == len(peers) or now - q["sent"] > REPLY_TIMEOUT_S:
                self._query = None
                self._report(q, peers, now)
            return
        for seq, index, what, since in waiting:
            key = (seq, index)
            due = self._next_check.get(key, since + self.check_s)
            if now >= due:
                self._next_check = {key: now + self.check_s}
                qid = (seq, index, now)
                self._query = {"qid": qid, "seq": seq, "index": index, "what": what,
                               "since": since, "sent": now, "replies": {}}  # fmt: skip
                self._send_all(qid, _QUERY)
                return

    def _report(self, q: dict, peers: list[int], now: float) -> None:
        p = self.progress
        current = p.data_now if q["seq"] == "data" else p.control_now
        if current is None or current[0] != q["index"]:
            return  # it finished meanwhile
        waited = now - q["since"]
        lines, missing = [], []
        for r in peers:
            reply = q["replies"].get(r)
            if reply is None:
                missing.append(r)
                lines.append(f"{r}: did not answer within {REPLY_TIMEOUT_S:g} s (busy or blocked)")
                continue
            done = reply["started"] if q["seq"] == "data" else reply["control"]
            if done < q["index"]:
                missing.append(r)
                lines.append(
                    f"{r}: has started {done} {q['seq']} collectives (the last "
                    f"{reply['idle_s']:.1f} s ago); {reply['at']}"
                )
        if not missing:
            return
        shut = self.shutdown_s > 0 and waited > self.shutdown_s
        text = (
            f"stall check: {q['seq']} collective #{q['index']} ({q['what']}) has waited "
            f"{waited:.1f} s for ranks that have not started it "
            f"(HOROVOD_STALL_CHECK_TIME_SECONDS={self.check_s:g}). A rank that never starts "
            "it deadlocks the job.\nMissing ranks:\n" + "\n".join(lines)
        )
        if shut:
            self._abort(
                text + f"\nStalled for longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="
                f"{self.shutdown_s:g}: shutting down (aborting the job)."
            )
        _say(text, self.rank)

    def _abort(self, text: str) -> None:
        _say(text, self.rank)
        self.t.comm.Abort(1)

    # ---- process end --------------------------------------------------------------------------
    def notify_failure(self, text: str) -> None:
        """Tell the others this rank fails, wait (up to ABORT_GRACE_S) until each has
        acknowledged or failed too."""
        with self._lock:
            self._send_all(text, _FAIL)
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline:
            others = set(range(self.size)) - {self.rank} - set(self.exited)
            if others <= self.answered | set(self.failed):
                break
            time.sleep(POLL_S / 2)

    def notify_exit(self) -> None:
        """At exit: tell the others how far this rank got, stop the watcher."""
        with self._lock:
            self._stop.set()
            p = self.progress
            self._send_all({"started": p.started, "control": p.control}, _EXIT)
            self._flush_sends(1.0)
        self.thread.join(timeout=2.0)


_WATCHERS: list = []  # weakrefs to every live watcher of this process
_HOOKED = False


def _excepthook(exc_type, exc, tb) -> None:
    _PREVIOUS_HOOK(exc_type, exc, tb)  # the traceback first
    watchers = [w for w in (ref() for ref in _WATCHERS) if w is not None and w.size > 1]
    if not watchers:
        return
    w = watchers[0]
    summary = "".join(traceback.format_exception_only(exc_type, exc)).strip()
    _say(
        f"unhandled {exc_type.__name__}: aborting the MPI job so that the other ranks do not "
        "wait for this one",
        w.rank,
    )
    try:
        for each in watchers:
            each.notify_failure(summary)
    finally:
        w.t.comm.Abort(1)


def _at_exit() -> None:
    """Before mpi4py's MPI_Finalize: each transport's worker ends first (so that no
    collective runs on it during or after MPI_Finalize, and the count of collectives it
    started is final), then its watcher tells the others that count and stops."""
    for ref in list(_WATCHERS):
        w = ref()
        if w is not None and not w._stop.is_set():
            with contextlib.suppress(Exception):  # the transport may be gone
                w.t.stop_worker(ABORT_GRACE_S)
            with contextlib.suppress(Exception):  # MPI may already be finalized
                w.notify_exit()


_PREVIOUS_HOOK = sys.excepthook


def _install_hooks() -> None:
    global _HOOKED, _PREVIOUS_HOOK
    if _HOOKED:
        return
    _HOOKED = True
    atexit.register(_at_exit)  # mpi4py's MPI_Finalize is a Py_AtExit function: later
    if os.environ.get("HVDC_ABORT_ON_EXCEPTION", "1") != "0":
        _PREVIOUS_HOOK = sys.excepthook
        sys.excepthook = _excepthook


_STOP = object()  # the worker's last queue item


class MPITransport(Transport):
    """Collectives over an mpi4py communicator (default ``COMM_WORLD``); see module doc."""

    name = "mpi4py"
    splits = True

    def __init__(self, comm=None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)  # collective, like Dup below
        self.local_size = node.Get_size()
        self._node_leader = node.allreduce(self.rank, op=MPI.MIN)  # names the node
        node.Free()
        self._data_comm = self.comm.Dup()  # the worker's collectives never meet ours
        self._ops = _sum_ops_16bit(MPI)
        # float16 and bfloat16 travel as their bits (uint16), summed by their user ops
        self._mpi_types = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}
        self._mpi_types.update(dict.fromkeys(self._ops, MPI.UINT16_T))
        self._progress = _Progress()
        self._watcher = _Watcher(self)  # Dup: collective, at the same point on every rank
        _install_hooks()
        _WATCHERS.append(weakref.ref(self._watcher))
        self._queue: queue.Queue = queue.Queue()
        self._stopped = False  # stop_worker was called: no more collectives
        self._worker = threading.Thread(target=self._run, name="hvdcompress-mpi", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        p = self._progress
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            job, handle, what = item
            handle.began = time.perf_counter()  # queued until now behind earlier jobs
            p.started += 1
            p.last_start = time.monotonic()
            p.data_now = (p.started, what, p.last_start)
            handle._run(job)
            p.data_now = None

    def stop_worker(self, timeout: float) -> bool:
        """End the worker thread (at exit, before MPI_Finalize; the transport cannot start
        collectives afterwards): the collectives queued but not started fail with a
        RuntimeError, the one in progress finishes (waited for up to ``timeout`` s).
        True when the worker has ended."""
        self._stopped = True
        if not self._worker.is_alive():
            return True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job[1]._finish(error=RuntimeError(f"{job[2]}: not started, the process exits"))
        self._queue.put(_STOP)
        self._worker.join(timeout)
        if self._worker.is_alive():
            what = self._progress.data_now
            _say(
                f"at exit: the worker is still in collective {what} after {timeout:g} s; "
                "exiting without it",
                self.rank,
            )
        return not self._worker.is_alive()

    def _submit(self, job: Callable[[], object], what: str, *, measured: bool = False) -> Handle:
        """A handle of ``job``'s result; ``measured``: ``job`` returns (result,
        ``slots.Wire``), and the handle carries what went on the wire."""
        if self._stopped:
            raise RuntimeError(f"{what}: the mpi4py transport's worker has stopped (process exit)")
        handle = Handle()
        if measured:
            inner = job

            def job():
                result, handle._wire = inner()
                return result

        self._queue.put((job, handle, what))
        return handle

    @contextlib.contextmanager
    def _control(self, what: str):
        """Context of one blocking collective of the calling thread (counted, watched)."""
        p = self._progress
        p.control += 1
        p.last_start = time.monotonic()
        p.control_now = (p.control, what, p.last_start)
        try:
            yield
        finally:
            p.control_now = None

    def _split(self, groups, mine: tuple[int, ...]) -> MPITransport:
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        return MPITransport(self.comm.Split(color, mine.index(self.rank)))

    def node_key(self) -> object:
        """The lowest rank of this rank's ``COMM_TYPE_SHARED`` group: names its node."""
        return ("mpi", self._node_leader)

    # allgatherv / alltoallv: sizes carried in slots with the data (transports.slots)
    def start_allgatherv(self, local: torch.Tensor, *, key=None) -> Handle:
        buf = torch.from_numpy(np.ascontiguousarray(local.detach().cpu().numpy(), dtype=np.uint8))
        caps = slots.capacities(self)

        def job():
            gathered, sizes, wire = slots.allgatherv(
                buf, caps, key, self.rank, self.size, self._gather_var
            )
            return (gathered, sizes), wire

        return self._submit(job, f"allgatherv of {buf.numel()} bytes", measured=True)

    def _gather_var(self, t: torch.Tensor, counts: list[int]):
        """All ranks' ``t`` (``counts[r]`` bytes on rank r), exactly: (concatenation, bytes
        sent, bytes received)."""
        sizes = np.array(counts, dtype=np.int64)
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        send = [np.ascontiguousarray(t.numpy()), self.MPI.UNSIGNED_CHAR]
        self._data_comm.Allgatherv(send, _parts_spec(recv, sizes, self.MPI))
        mine = counts[self.rank]
        return torch.from_numpy(recv), (self.size - 1) * mine, int(sizes.sum()) - mine

    def start_alltoallv(self, parts: list[torch.Tensor], *, key=None) -> Handle:
        check_alltoallv_parts(parts, self.size)
        bufs = [np.ascontiguousarray(p.detach().cpu().numpy(), dtype=np.uint8) for p in parts]
        tensors, caps, cpu = (
            [torch.from_numpy(b) for b in bufs],
            slots.capacities(self),
            torch.device("cpu"),
        )

        def job():
            return slots.alltoallv(tensors, caps, key, self.rank, self._exchange, cpu)

        return self._submit(job, f"alltoallv of {sum(b.size for b in bufs)} bytes", measured=True)

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int]):
        MPI, recv_sizes = self.MPI, np.array(recv_counts, dtype=np.int64)
        recv = np.empty(int(recv_sizes.sum()), dtype=np.uint8)
        send_spec = _parts_spec(send.numpy(), np.array(send_counts, dtype=np.int64), MPI)
        self._data_comm.Alltoallv(send_spec, _parts_spec(recv, recv_sizes, MPI))
        return torch.from_numpy(recv)

    def start_allreduce_sum(self, dense: torch.Tensor) -> Handle:
        if dense.dtype not in self._mpi_types:
            raise TypeError(f"mpi4py transport cannot sum {dense.dtype}")
        src = dense.detach().cpu().contiguous()
        device = dense.device
        mpi_type = self._mpi_types[src.dtype]
        op = self._ops.get(src.dtype, self.MPI.SUM)
        comm = self._data_comm

        def job():
            out = torch.empty_like(src)
            send = src.view(torch.uint16) if src.element_size() == 2 else src
            recv = out.view(torch.uint16) if out.element_size() == 2 else out
            comm.Allreduce([send.numpy(), mpi_type], [recv.numpy(), mpi_type], op=op)
            return out.to(device)

        return self._submit(job, f"allreduce of {src.numel()} {str(src.dtype)[6:]}")

    def allgather_object(self, obj) -> list:
        with self._control("allgather_object"):
            return self.comm.allgather(obj)

    def broadcast_(self, tensors, root: int = 0) -> None:
        with self._control(f"broadcast from rank {root}"):
            for t in tensors:  # the raw bytes: any dtype, bit-exact
                buf = t.detach().cpu().contiguous()
                view = buf.reshape(-1).view(torch.uint8).numpy()
                self.comm.Bcast([view, self.MPI.BYTE], root=root)
                t.data.copy_(buf)

    def sum_floats(self, values) -> list[float]:
        with self._control("sum_floats"):
            send = np.array(values, dtype=np.float64)
            recv = np.empty_like(send)
            self.comm.Allreduce(send, recv, op=self.MPI.SUM)
            return recv.tolist()

    def barrier(self) -> None:
        with self._control("barrier"):
            self.comm.Barrier()
