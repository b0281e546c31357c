"""Horovod's stall check under Gloo, where Horovod 0.28.1 has none
(docs/checkpoints-and-faults.md, "Stall check").

``GlooStallWatch`` watches this rank's own collectives. Each one is pending from just
before it is submitted until it is known done: an asynchronous one until its handle polls
done (``poll``, Horovod's ``hvd.poll``, from the watch thread), a blocking one until it
returns. One pending longer than ``HOROVOD_STALL_CHECK_TIME_SECONDS`` is reported, once
every check time; one pending longer than ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` ends this
rank with ``os._exit(1)`` (``hvd.shutdown()`` from that thread left the process hanging at
exit), and horovodrun ends the others.

The watch thread needs the GIL, and Horovod's submit functions hold it while they run: a
rank whose Horovod has half shut down may stop inside one for good, and then no Python
thread runs (what a CI job that hung with no stall report looks like). So when a shutdown
time is set the watch also keeps a timer armed that needs no GIL
(``faulthandler.dump_traceback_later``) while anything is pending. The watch thread pushes
it forward at every poll; if no poll comes for the shutdown time plus
``BACKSTOP_MARGIN_S``, the timer prints every thread's stack on stderr (headed "Timeout
(h:mm:ss)!") and ends the process with status 1 (where ``sys.stderr`` has no file
descriptor, on ``sys.__stderr__``; without either, no timer). It is the process's one
faulthandler timer (shared by the process's watches): a user's own
``dump_traceback_later`` is replaced while a collective is pending.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Hashable

from hvdcompress.transports.mpi_faults import _say

POLL_S = 0.5  # the watch thread's period
BACKSTOP_MARGIN_S = 1.0  # the GIL-free timer fires this long after the shutdown time


class _Backstop:
    """The process's GIL-free timer (module doc), shared by its watches (a split transport
    makes three, and faulthandler has one timer): armed while any of them, its holders,
    has a collective pending, for the longest of their times."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, float] = {}  # id of a watch -> its seconds

    def holds(self, holder: int) -> bool:
        return holder in self._holders

    def push(self, holder: int, seconds: float, file) -> None:
        """Arm, or move the deadline to the holders' longest time from now."""
        with self._lock:
            self._holders[holder] = seconds
            faulthandler.dump_traceback_later(max(self._holders.values()), exit=True, file=file)

    def release(self, holder: int) -> None:
        """``holder`` has nothing pending; the timer stops when no holder is left."""
        with self._lock:
            if self._holders.pop(holder, None) is not None and not self._holders:
                faulthandler.cancel_dump_traceback_later()


_BACKSTOP = _Backstop()


def _stderr_with_a_descriptor():
    """stderr, or the process's original stderr where ``sys.stderr`` has no file
    descriptor (a notebook's): faulthandler writes to it from C. None where neither has."""
    for file in (sys.stderr, sys.__stderr__):
        try:
            file.fileno()
        except (AttributeError, ValueError, OSError):
            continue
        return file
    return None


class GlooStallWatch:
    """Stall check and shutdown for this rank's collectives (module doc).

    ``submitting(name)`` just before a collective is submitted, then ``submitted(name,
    handle)`` with its handle and ``waited(handle)`` once it is synchronized (the watch
    also polls it); a blocking collective runs inside ``blocking(name)``.
    ``poll(handle)`` says whether a handle is done (an exception counts as done: the
    handle was synchronized already). ``check_s`` / ``shutdown_s``: Horovod's variables
    (``shutdown_s`` 0: never shut down, and no timer)."""

    def __init__(
        self, poll: Callable[[Hashable], bool], rank: int, check_s: float, shutdown_s: float
    ) -> None:
        self.rank = rank
        self.check_s, self.shutdown_s = check_s, shutdown_s
        self._poll = poll
        self._lock = threading.Lock()  # _pending and the timer, between the two threads
        self._pending: dict[str, tuple[Hashable | None, float]] = {}  # name -> (handle, since)
        self._names: dict[Hashable, str] = {}  # handle -> name, of the pending
        self._warned: dict[str, float] = {}  # name -> when it may be reported again
        self._stderr = _stderr_with_a_descriptor() if shutdown_s > 0 else None
        self._timer_s = shutdown_s + BACKSTOP_MARGIN_S  # used where _stderr is not None
        thread = threading.Thread(
            target=_run, args=(weakref.ref(self), id(self)), name="hvdcompress-stall",
            daemon=True,
        )  # fmt: skip
        thread.start()

    def submitting(self, name: str) -> None:
        with self._lock:
            self._pending[name] = (None, time.monotonic())
            if self._stderr is not None and not _BACKSTOP.holds(id(self)):
                _BACKSTOP.push(id(self), self._timer_s, self._stderr)

    def submitted(self, name: str, handle: Hashable) -> None:
        with self._lock:
            self._pending[name] = (handle, self._pending[name][1])  # since submitting
            self._names[handle] = name

    def waited(self, handle: Hashable) -> None:
        """``handle`` was synchronized: no longer pending."""
        with self._lock:
            name = self._names.pop(handle, None)
            if name is not None:
                self._forget(name)

    def dropped(self, name: str) -> None:
        """``name`` is no longer pending (returned, or its submit raised)."""
        with self._lock:
            self._forget(name)

    def _forget(self, name: str) -> None:
        # under the lock; with nothing pending the timer stops at once, so that a job
        # that ends (its exit may be slow) has no timer armed
        self._pending.pop(name, None)
        if not self._pending:
            _BACKSTOP.release(id(self))

    @contextlib.contextmanager
    def blocking(self, name: str):
        """The context of blocking collective ``name`` (gives ``name``)."""
        self.submitting(name)
        try:
            yield name
        finally:
            self.dropped(name)

    def tick(self, now: float) -> None:
        """One poll: forget what is done, push or cancel the timer, report a stall."""
        with self._lock:
            pending = list(self._pending.items())
        stalled = []
        for name, (handle, since) in pending:
            if handle is not None and self._done(handle):
                with self._lock:
                    if self._names.get(handle) == name:
                        del self._names[handle]
                        self._forget(name)
            elif now - since > self.check_s:
                stalled.append((now - since, name))
        with self._lock:
            if not self._pending:
                _BACKSTOP.release(id(self))
            elif self._stderr is not None:
                _BACKSTOP.push(id(self), self._timer_s, self._stderr)
            left = len(self._pending)
            for gone in self._warned.keys() - self._pending.keys():
                del self._warned[gone]
        if stalled:
            self._report(now, max(stalled), len(stalled), left)

    def _done(self, handle: Hashable) -> bool:
        try:
            return bool(self._poll(handle))
        except Exception:  # noqa: BLE001 - synchronized already: the handle is gone
            return True

    def _report(self, now: float, oldest: tuple[float, str], stalled: int, left: int) -> None:
        waited, name = oldest
        if self.shutdown_s > 0 and waited > self.shutdown_s:
            _say(
                f"stall check: collective {name} has waited {waited:.1f} s, longer than "
                f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown_s:g}: shutting down "
                "(this rank exits with status 1, the launcher ends the others)",
                self.rank,
            )
            os._exit(1)
        if now >= self._warned.get(name, 0.0):
            self._warned[name] = now + self.check_s
            _say(
                f"stall check: collective {name} has waited {waited:.1f} s "
                f"(HOROVOD_STALL_CHECK_TIME_SECONDS={self.check_s:g}; {stalled} stalled, "
                f"{left} pending): some rank has not submitted it (under Gloo Horovod does "
                "not say which); a rank that never does deadlocks the job",
                self.rank,
            )


def _run(ref: weakref.ref, holder: int) -> None:
    """The watch thread: ticks until its watch (the transport's) is gone."""
    while True:
        time.sleep(POLL_S)
        watch = ref()
        if watch is None:
            _BACKSTOP.release(holder)
            return
        watch.tick(time.monotonic())
        del watch
