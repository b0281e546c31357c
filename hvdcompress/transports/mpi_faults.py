"""The fault handling of the mpi4py transport (hvdcompress.transports.mpi): its side
channel, stall check, exception hook and exit.

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
threads still exist: neither thread (worker, watcher) may be inside MPI then.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
import weakref

from hvdcompress.transports.base import Transport

POLL_S = 0.1  # the watcher's polling period
ABORT_GRACE_S = 2.0  # how long a failing rank waits for the others to acknowledge
REPLY_TIMEOUT_S = 2.0  # a rank that has not answered a stall query by then is "not answering"
DEFAULT_STALL_CHECK_S = 60.0

# side-channel tags
_QUERY, _REPLY, _FAIL, _EXIT, _ACK = 11, 12, 13, 14, 15


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

    def __init__(self, transport: Transport) -> None:  # an MPITransport (no import cycle)
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
