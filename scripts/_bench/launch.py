"""Launching a benchmark's ranks and following them: the launcher command (horovodrun
--gloo or mpirun over TCP), the events the ranks print (one JSON object per line after
MARK), a timeout for the launch to start and one per case, and relaunches after a
failed case for the cases after it."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

MARK = "HVDC_BENCH "  # worker events: one JSON object per line after this marker


def emit(event: dict) -> None:
    print(MARK + json.dumps({**event, "t": time.time()}), flush=True)


def root_env(**extra: str) -> dict:
    """This process's environment with Open MPI allowed to run as root (and ``extra``)."""
    return {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            **extra}  # fmt: skip


def rank_command(launcher: str, ranks: int, worker: list[str]) -> list[str]:
    """``worker`` on ``ranks`` local ranks: ``gloo``, horovodrun --gloo over ``lo``;
    ``mpi``, mpirun over TCP on ``lo`` (no shared memory: every byte crosses the
    loopback)."""
    if launcher == "gloo":
        horovodrun = Path(sys.executable).with_name("horovodrun")
        exe = str(horovodrun) if horovodrun.exists() else (shutil.which("horovodrun") or "")
        cmd = [exe, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}"]
        cmd += ["--network-interface", "lo", *worker]
    else:
        cmd = [shutil.which("mpirun") or "mpirun", "-np", str(ranks), "--oversubscribe"]
        cmd += ["--bind-to", "none", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]
        cmd += ["--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo"]
        cmd += ["--mca", "mpi_yield_when_idle", "1", *worker]
    return cmd


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line.rstrip("\n"))
    q.put(None)


def run_launch(cmd: list[str], items: list[str], args, cwd: Path, stop) -> tuple[dict, bool, float]:
    """One launch of ``cmd`` for ``items``: ({item: row or failure}, whether any case
    started, wall s). Ends at the first failure (the caller relaunches for the rest).
    ``args``: ``timeout`` (s per case), ``startup_timeout``, ``verbose``; ``stop()`` ends
    the launcher and every rank (and anything they left behind)."""
    env = root_env(PYTHONUNBUFFERED="1")
    if args.verbose:
        print("  $ " + " ".join(cmd), flush=True)
    t_launch = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        cwd=cwd,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the driver only; it ends the ranks
    )
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
    tail: deque[str] = deque(maxlen=40)
    out: dict = {}
    try:
        current, started = _follow(q, items, args, t_launch + args.startup_timeout, out, tail)
    finally:
        rc = _end_launch(proc, out, items, stop)
    if current is not None and current not in out:
        out[current] = {
            "status": "failed",
            "reason": f"the launch exited with status {rc} during the case" + _tail_note(tail),
        }
    elif not started and not out:
        why = f"the launch exited with status {rc} before any case" + _tail_note(tail)
        out[items[0]] = {"status": "failed", "reason": why}
    return out, started, time.monotonic() - t_launch


def _follow(q: queue.Queue, items: list[str], args, deadline: float, out: dict, tail: deque):
    """The ranks' events from ``q`` into ``out`` until the output ends, a case fails or a
    deadline passes (``deadline`` first: the start's); (the case running at the end,
    whether any case started). Other lines go to ``tail``."""
    current = None
    started = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = _timeout_reason(args, current, started)
            target = current or next((i for i in items if i not in out), None)
            if target is not None:
                out[target] = {"status": "failed", "reason": why + _tail_note(tail)}
            break
        try:
            line = q.get(timeout=min(left, 0.5))
        except queue.Empty:
            continue
        if line is None:
            break
        event = _event(line, tail, args.verbose)
        if event is None:
            continue
        kind = event.get("event")
        if kind == "start":
            current, started = event["item"], True
            deadline = time.monotonic() + args.timeout
        elif kind == "result":
            out[event["item"]] = {"status": "ok", **event["row"]}
            current = None
            deadline = time.monotonic() + args.timeout
        elif kind == "error":
            why = f"error on rank {event.get('rank')}: {event.get('error')}"
            out.setdefault(event["item"], {"status": "failed", "reason": why})
            current, started = None, True  # rank 0's start event may not be here yet
            break  # the ranks are exiting; the clean-up below ends what is left
        elif kind == "done":
            deadline = time.monotonic() + 30.0  # let the launcher exit on its own
    return current, started


def _timeout_reason(args, current, started: bool) -> str:
    """What a passed deadline means: no case started, no next case, or no result."""
    if current is None and not started:
        return f"timeout: the launch started no case within {args.startup_timeout:g} s"
    if current is None:
        return f"timeout: no next case within {args.timeout:g} s"
    return f"timeout: no result within {args.timeout:g} s"


def _event(line: str, tail: deque, verbose: bool) -> dict | None:
    """The event a line of output carries after MARK; None for any other line (kept in
    ``tail``, and printed when ``verbose``)."""
    pos = line.find(MARK)
    if pos < 0:
        tail.append(line)
        if verbose:
            print("    | " + line, flush=True)
        return None
    try:
        event = json.loads(line[pos + len(MARK) :])
    except json.JSONDecodeError:
        tail.append(line)
        return None
    if verbose:
        lag = time.time() - event.get("t", time.time())
        print(f"    event {event.get('event')} {event.get('item', '')} (arrived {lag:.1f} s late)")
    return event


def _end_launch(proc: subprocess.Popen, out: dict, items: list[str], stop) -> int:
    """The launcher's exit status, once it and every rank have ended: a moment to exit on
    its own when every item has its result, then ``stop()``, then a kill."""
    if proc.poll() is None:
        try:
            proc.wait(timeout=2.0 if out and all(i in out for i in items) else 0.01)
        except subprocess.TimeoutExpired:
            pass
    stop()  # the launcher and every rank (and anything they left behind)
    if proc.poll() is None:
        proc.kill()
    return proc.wait()


def _tail_note(tail) -> str:
    lines = [ln.strip() for ln in tail if ln.strip()]
    return (" | last output: " + " / ".join(lines[-3:]))[:600] if lines else ""


def run_items(items: list[str], launch, record, verbose: bool = False) -> None:
    """Every item through ``launch(pending)`` (run_launch's result), relaunching after a
    failed case for the items after it; ``record(item, result)`` for each."""
    pending = list(items)
    while pending:
        got, started, wall = launch(pending)
        if not started:  # it never got going: the same would happen again
            reason = got.get(pending[0], {}).get("reason", "the launch failed")
            for item in pending:
                record(item, got.get(item) or {"status": "failed", "reason": "not run: " + reason})
            return
        for item in pending:
            if item in got:
                record(item, got[item])
        pending = [i for i in pending if i not in got]
        if verbose:
            print(f"  launch took {wall:.1f} s", flush=True)
