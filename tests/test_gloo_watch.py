"""The stall watch under Gloo (hvdcompress.transports.gloo_watch), one process each case:
what it reports, when it ends the rank, and its GIL-free timer, which must end a rank
whose interpreter is stuck inside a call that holds the GIL (Horovod's submit functions
do) while a collective is pending, and only then. The horovodrun jobs in tests/faults
test the watch inside real Gloo jobs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import ctypes, time
from hvdcompress.transports import gloo_watch
gloo_watch.POLL_S = 0.1

def hold_the_gil(seconds):  # a C call that keeps the GIL (ctypes.PyDLL does not release it)
    ctypes.PyDLL(None).sleep(seconds)

def watch(done, shutdown_s):
    return gloo_watch.GlooStallWatch(lambda handle: done, 0, 0.3, shutdown_s)
"""


def run(body: str, limit_s: float = 15.0) -> tuple[int, str, float]:
    code = PRELUDE + textwrap.dedent(body)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
        timeout=limit_s,
    )  # fmt: skip
    return proc.returncode, proc.stderr, time.monotonic() - t0


def test_a_stuck_interpreter_with_a_pending_collective_ends_with_every_stack():
    rc, err, seconds = run("""
        w = watch(done=False, shutdown_s=1.0)
        w.submitting("hvdcompress.set0.allgatherv.7")  # stuck in the submit itself
        hold_the_gil(20)
    """)
    assert rc == 1, err
    assert "Timeout (0:00:02)!" in err, err  # shutdown time + BACKSTOP_MARGIN_S
    assert "in hold_the_gil" in err, err  # the stack of the stuck thread
    assert seconds < 10, seconds


def test_one_watch_with_nothing_pending_leaves_the_others_timer_armed():
    # a split transport has three watches and faulthandler one timer
    rc, err, _ = run("""
        a, b = watch(done=False, shutdown_s=1.0), watch(done=False, shutdown_s=1.0)
        a.submitting("a")
        b.submitting("b")
        b.submitted("b", 7)
        b.waited(7)  # b has nothing pending: a's collective still is
        hold_the_gil(20)
    """)
    assert rc == 1 and "Timeout (0:00:02)!" in err, err


def test_the_timer_writes_to_the_real_stderr_when_sys_stderr_has_no_descriptor():
    rc, err, _ = run("""
        import io, sys
        sys.stderr = io.StringIO()  # as in a notebook
        w = watch(done=False, shutdown_s=1.0)
        w.submitting("a")
        hold_the_gil(20)
    """)
    assert rc == 1 and "Timeout (0:00:02)!" in err and "in hold_the_gil" in err, err


def test_a_pending_collective_is_reported_then_shuts_the_rank_down():
    rc, err, _ = run("""
        w = watch(done=False, shutdown_s=1.0)
        w.submitting("hvdcompress.set0.allgatherv.7")
        w.submitted("hvdcompress.set0.allgatherv.7", object())
        time.sleep(20)
    """)
    assert rc == 1, err
    assert "stall check: collective hvdcompress.set0.allgatherv.7 has waited" in err, err
    assert "HOROVOD_STALL_CHECK_TIME_SECONDS=0.3; 1 stalled, 1 pending" in err, err
    assert "longer than HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=1: shutting down" in err, err
    assert "Timeout (" not in err, err  # the watch itself, not the timer


def test_a_blocking_collective_is_watched_until_it_returns():
    rc, err, _ = run("""
        w = watch(done=True, shutdown_s=1.0)
        with w.blocking("hvdcompress.set0.sum.3") as name:
            assert name == "hvdcompress.set0.sum.3"
            time.sleep(20)
    """)
    assert rc == 1, err
    assert "collective hvdcompress.set0.sum.3 has waited" in err, err
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=1: shutting down" in err, err


def test_nothing_pending_disarms_the_timer():
    # a collective that finished, then the GIL held longer than the timer's time: no exit
    rc, err, _ = run("""
        w = watch(done=True, shutdown_s=1.0)
        w.submitting("a")
        w.submitted("a", object())
        with w.blocking("b"):
            pass
        time.sleep(0.6)  # a few polls: "a" polls done, nothing pending, the timer cancelled
        hold_the_gil(3)
        print("survived")
    """)
    assert rc == 0, err
    assert "stall check" not in err and "Timeout (" not in err, err


def test_a_synchronized_collective_stops_the_timer_at_once():
    # no poll in between: a job whose last collective is waited and which then exits
    # (slowly: hvd.shutdown at exit) has no timer armed
    rc, err, _ = run("""
        w = watch(done=False, shutdown_s=1.0)
        w.submitting("a")
        w.submitted("a", 7)
        w.waited(7)
        hold_the_gil(3)
    """)
    assert rc == 0, err
    assert "Timeout (" not in err, err


def test_without_a_shutdown_time_nothing_ends_the_rank():
    rc, err, _ = run("""
        w = watch(done=False, shutdown_s=0.0)
        w.submitting("a")
        hold_the_gil(3)
        time.sleep(0.5)  # the watch reports once the GIL is free, and nothing more
    """)
    assert rc == 0, err
    assert "stall check: collective a has waited" in err, err
    assert "Timeout (" not in err and "shutting down" not in err, err


def test_a_submit_that_raises_is_no_longer_pending():
    rc, err, _ = run("""
        w = watch(done=False, shutdown_s=1.0)
        w.submitting("a")
        w.dropped("a")
        time.sleep(0.6)
        hold_the_gil(3)
    """)
    assert rc == 0, err
    assert "stall check" not in err and "Timeout (" not in err, err
