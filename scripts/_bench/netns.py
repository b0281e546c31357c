"""A network namespace as a benchmark's link: created with its loopback up, rate-limited
with tc tbf, its tx bytes read from /proc/net/dev, and removed (with every process in it)
on exit, on failure and on SIGINT / SIGTERM / SIGHUP; stale ones (their driver was
killed) are found by the driver's pid in their name."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def rate_bits(rate: str) -> float | None:
    """Bits per second of a tc rate ("100mbit", "1gbit", "2500kbit"); None for unlimited."""
    if rate == "unlimited":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)", rate.lower())
    if not m:
        raise argparse.ArgumentTypeError(
            f"rate {rate!r}: use unlimited or a number with kbit, mbit, gbit (e.g. 100mbit)"
        )
    scale = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    return float(m.group(1)) * scale


def rate_arg(text: str) -> str:
    rate_bits(text)
    return text.lower()


def read_tx_bytes() -> int:
    """tx bytes of ``lo`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


class Interrupted(Exception):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def netns_available() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} not found (iproute2)"
    res = sh("ip", "netns", "list", check=False)
    if res.returncode != 0:
        return f"ip netns unavailable: {res.stderr.strip()}"
    return None


def list_namespaces(prefix: str) -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def ns_pids(ns: str) -> list[int]:
    res = sh("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


def ns_kill(ns: str, grace: float = 5.0) -> None:
    """End every process in the namespace (they are all ours): TERM, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = ns_pids(ns)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and ns_pids(ns):
            time.sleep(0.1)


def ns_delete(ns: str) -> None:
    ns_kill(ns)
    sh("ip", "netns", "del", ns, check=False)


def ns_create(ns: str) -> None:
    if ns in list_namespaces(ns):  # left by a killed driver that had our pid
        ns_delete(ns)
    sh("ip", "netns", "add", ns)
    sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")


def tc_rate_command(rate: str) -> list[str]:
    """The tc command that gives ``lo`` (of the namespace it runs in) ``rate``."""
    tc = shutil.which("tc") or "/usr/sbin/tc"
    bits = rate_bits(rate)
    if bits is None:  # fails harmlessly when there is no qdisc yet
        return [tc, "qdisc", "del", "dev", "lo", "root"]
    burst = max(1 << 20, int(bits / 8 * 1e-3))  # > 64 KiB loopback MTU, >= 1 ms of rate
    return [
        tc, "qdisc", "replace", "dev", "lo", "root", "tbf",
        "rate", f"{int(bits)}bit", "burst", str(burst), "latency", "100ms",
    ]  # fmt: skip


def set_rate(rate: str) -> None:
    """Give ``lo`` of this process's namespace ``rate`` (unlimited: remove the qdisc)."""
    sh(*tc_rate_command(rate), check=rate_bits(rate) is not None)


def cleanup_stale(prefix: str, script_name: str) -> list[str]:
    """Remove namespaces with the prefix whose driver (the pid in the name, a process
    running ``script_name``) is gone."""
    removed = []
    for ns in list_namespaces(prefix):
        suffix = ns[len(prefix) :]
        alive = False
        if suffix.isdigit():
            try:
                cmdline = Path(f"/proc/{suffix}/cmdline").read_bytes()
                alive = script_name.encode() in cmdline
            except OSError:
                alive = False
        if not alive:
            ns_delete(ns)
            removed.append(ns)
    return removed


def guarded(create, delete, body) -> str | None:
    """``create()``, ``body()``, then ``delete()`` whatever happens. SIGINT, SIGTERM and
    SIGHUP end ``body``; the return value is the name of the signal that did, else None.
    Nothing interrupts ``delete``."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    handlers = {s: signal.getsignal(s) for s in signals}
    interrupted = None
    try:
        for s in signals:
            signal.signal(s, _on_signal)
        create()
        body()
    except (Interrupted, KeyboardInterrupt) as err:
        interrupted = str(err) or "SIGINT"
        print(f"interrupted ({interrupted}): cleaning up", file=sys.stderr, flush=True)
    finally:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        delete()
        for s, h in handlers.items():
            signal.signal(s, h)
    return interrupted


def in_namespace(ns: str, prefix: str, body) -> str | None:
    """Create ``ns``, run ``body()`` and remove the namespace and every process in it,
    whatever happens (``guarded``)."""

    def delete() -> None:
        if ns in list_namespaces(prefix):
            ns_delete(ns)

    return guarded(lambda: ns_create(ns), delete, body)
