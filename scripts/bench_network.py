#!/usr/bin/env python
"""Training steps through real TCP traffic on a rate-limited link, per compression method.

Run as root (it needs network namespaces and tc):

    python scripts/bench_network.py                       # the default matrix
    python scripts/bench_network.py --ranks 2 --rates 100mbit unlimited \\
        --cases none 3lc --models light --steps 3         # a small run
    python scripts/bench_network.py --cleanup             # remove stale namespaces
    python scripts/bench_network.py --ranks 2 4 8 --rates unlimited --models cnn \
        --cases none 3lc --exchanges allgather twostage --launchers mpi   # bytes vs ranks

The script (the driver) creates a network namespace ``hvdc-bench-<pid>`` and brings its
loopback up. Inside it, it launches the ranks of a training-step loop (the worker mode of
this script), once per (launcher, ranks); before the cases of each rate, rank 0 sets the
rate of the namespace's loopback with ``tc qdisc replace dev lo root tbf rate R burst B
latency 100ms`` (B = max(1 MiB, R x 1 ms): the burst must exceed the 64 KiB loopback MTU)
while the other ranks wait. Launchers:

* ``gloo``: ``horovodrun --gloo -np N -H localhost:N --network-interface lo``, backend
  ``horovod`` of ``hvdcompress.DistributedOptimizer``;
* ``mpi``: ``mpirun --mca pml ob1 --mca btl tcp,self ...`` (no shared memory: every byte
  crosses the loopback), backend ``mpi4py``.

Rates: ``100mbit``, ``1gbit``, ``10gbit`` (any tc rate with kbit/mbit/gbit) and
``unlimited`` (no qdisc). LATENCY IS NOT EMULATED: this kernel has no netem, so the link
has a rate but (almost) no delay; methods that save round trips are not credited.

All ranks share the one rate-limited loopback, so the link carries every rank's traffic
at once (a shared bus, not one NIC per node): compare methods side by side on the same
link rather than against a per-node formula. With 2 cores, 4 ranks oversubscribe the CPU,
so the fast-link cases are CPU-bound and noisy.

Cases: methods of the table ``hvdcompress.training.methods.METHODS``: none, fp16, 3lc
(sparsity 1.0), 3lc-1.75, topk (ratio 0.01), powersgd (rank 1), dqsg (3 levels),
accordion-3lc (hvdcompress.Accordion between 3LC sparsity 1.0 and 1.75, every
``--accordion-interval`` steps), cat-topk (hvdcompress.CAT over top-k, every
``--cat-every`` steps, with a cost model calibrated on the transport at the link rate in
force, with payloads of 1 B to 1 MiB; on a slow link it picks small budgets) and
3lc-min64k (3LC with ``compress_min_numel=65536``: smaller tensors are sent uncompressed).
Models (hvdcompress.training.models): ``light`` (LightMLP 1024-1024-1024-10, 2.1 M
parameters, little compute) and ``cnn`` (the Fashion-MNIST SmallCNN of scripts/train.py,
0.2 M parameters). Data are random tensors (no data loading), one torch thread per rank.

Exchanges (``--exchanges``, default ``auto``): the ``exchange=`` of the optimizer for
gather-only cases, ``allgather`` (one allgather: (N - 1) x payload per rank), ``twostage``
(compressed reduce-scatter + allgather of re-compressed shards: about 2 (N - 1) / N x
payload) or ``auto`` (per bucket, by bytes); summable cases (none, fp16, powersgd) are
allreduced and run once, as exchange ``allreduce``. Ranks (``--ranks``): one launch per
rank count; ``--ranks 2 4 8`` gives bytes per rank against N (10 ranks: use ``--models
cnn``).

Per case: ``--warmup`` steps, a barrier, rank 0 reads the namespace's loopback tx bytes
(/proc/net/dev), ``--steps`` timed steps, a barrier, tx bytes again. Reported: the
median step time of the slowest rank, bytes on the wire per step (MEASURED on the
loopback: every rank's sends plus TCP/IP headers and acks; and MODELLED: the sum over
ranks of ``opt.last_stats.wire_bytes``, the ring model), bytes per rank per step (the
measured loopback bytes / N, and what the transport counted: ``last_stats.sent_bytes``,
mean over ranks), bits per value, and the speedup over ``none``, over ``fp16`` and (for
``twostage``) over the same case on ``allgather``, of the same launcher, ranks, rate and
model. With several rank counts or exchanges a second table gives bytes per rank per step
against N, and for ``twostage`` rows the ratio of the bytes sent to 2 (N - 1) / N x the
allgather case's payload. A case that
fails or passes ``--timeout`` is reported as failed with the reason, its processes are
killed, and the launch is restarted for the cases after it.

Output in ``--out`` (default results/network): bench_network.md (tables), .json, .png
(step time against bandwidth, log-log, one line per case and exchange, one panel per
model x ranks) and, with several rank counts, bench_network_bytes.png (bytes per rank per
step against N).
The namespace and every process in it are removed on exit, on failure and on Ctrl-C /
SIGTERM; ``--cleanup`` removes namespaces left by a driver that was killed (SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from hvdcompress.compressors import REGISTRY
from hvdcompress.training.methods import METHODS

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
PREFIX = "hvdc-bench-"
MARK = "HVDC_BENCH "  # worker events: one JSON object per line after this marker
LATENCY_NOTE = (
    "no latency emulated: this kernel has no netem, links have a rate (tc tbf) but no delay"
)

# the cases, in report order: methods of the one table (compressor, parameters, policy,
# compress_min_numel); policies take --accordion-interval / --cat-every and the calibration
CASES = {
    name: METHODS[name]
    for name in ("none", "fp16", "3lc", "3lc-1.75", "topk", "powersgd", "dqsg",
                 "accordion-3lc", "cat-topk", "3lc-min64k")
}  # fmt: skip
MODELS = ("light", "cnn")  # of hvdcompress.training.models
LAUNCHERS = ("gloo", "mpi")
DEFAULT_RATES = ("100mbit", "1gbit", "10gbit", "unlimited")
EXCHANGES = ("auto", "allgather", "twostage")  # DistributedOptimizer(exchange=...)
CAT_CALIBRATION_SIZES = (1, 1 << 10, 1 << 14, 1 << 17, 1 << 20)


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


# =========================================================================================
# worker: runs under horovodrun / mpirun inside the namespace, one process per rank
# =========================================================================================
def read_tx_bytes() -> int:
    """tx bytes of ``lo`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == "lo":
                return int(rest.split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def emit(event: dict) -> None:
    print(MARK + json.dumps({**event, "t": time.time()}), flush=True)


def build_model(name: str, batch: int, rank: int):
    import torch

    from hvdcompress.training import models

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}")
    torch.manual_seed(0)  # the same parameters on every rank
    model = models.build_model(name)  # default widths: light 1024, cnn 16
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own random batch
    x = torch.randn(batch, *models.INPUT_SHAPES[name], generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return model, x, y


def run_case(
    args, transport, model_name: str, case: str, cat_cost: dict, exchange: str = "auto"
) -> dict:
    import torch
    import torch.nn.functional as F

    import hvdcompress

    rank = transport.rank
    t_begin = time.perf_counter()
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}")
    method = CASES[case]
    model, x, y = build_model(model_name, args.batch_size, rank)
    numel = sum(p.numel() for p in model.parameters())
    extra = {}
    policy = None
    if method.policy == "accordion":
        policy = method.make_policy(interval_steps=args.accordion_interval)
    elif method.policy == "cat":
        if "model" not in cat_cost:  # once per link rate (the caller empties it on a change)
            t0 = time.perf_counter()
            cat_cost["model"] = hvdcompress.calibrate(
                transport, sizes=CAT_CALIBRATION_SIZES, repeats=3
            )
            cat_cost["seconds"] = time.perf_counter() - t0
        cost = cat_cost["model"]
        extra["cat_cost"] = {"c0": cost.c0, "c1": cost.c1, "calibration_s": cat_cost["seconds"]}
        policy = method.make_policy(cost_model=cost, recompute_every=args.cat_every)
    opt = hvdcompress.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model.named_parameters(),
        compression=method.compressor(),
        backend=transport,
        policy=policy,
        compress_min_numel=method.compress_min_numel,
        exchange=exchange,
    )

    t_built = time.perf_counter()
    extra["build_s"] = t_built - t_begin

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    transport.allgather_object(None)  # barrier: every rank's warmup traffic is done
    extra["warmup_s"] = time.perf_counter() - t_built
    tx0 = read_tx_bytes() if rank == 0 else 0
    transport.allgather_object(None)  # nobody sends a timed byte before rank 0 has read
    times = []
    acc = {"payload": 0.0, "wire": 0.0, "compress": 0.0, "wait": 0.0, "decode": 0.0,
           "sent": 0.0, "received": 0.0}  # fmt: skip
    t_start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        s = opt.last_stats
        acc["payload"] += s.payload_bytes
        acc["wire"] += s.wire_bytes
        acc["compress"] += s.compress_s
        acc["wait"] += s.wait_s
        acc["decode"] += s.decode_s
        acc["sent"] += s.sent_bytes  # as the transport counted them
        acc["received"] += s.received_bytes
    transport.allgather_object(None)  # barrier: every rank received everything
    elapsed = time.perf_counter() - t_start
    tx1 = read_tx_bytes() if rank == 0 else 0
    metrics = opt.last_stats.metrics
    levels = [v for k, v in metrics.items() if k.startswith("level/")]
    budgets = [v for k, v in metrics.items() if k.startswith("T/")]
    mine = {
        "median": statistics.median(times),
        "times": times,
        **{k: v / args.steps for k, v in acc.items()},
    }
    everyone = transport.allgather_object(mine)
    for h in getattr(opt, "_hooks", []):  # the next case builds a new model
        h.remove()
    if levels:
        extra["accordion_levels"] = {str(v): levels.count(v) for v in sorted(set(levels))}
    if budgets:
        extra["cat_kept_fraction"] = sum(budgets) / numel
    n = args.steps
    return {
        "params": numel,
        "compressor": method.compression,
        "compressor_params": dict(method.params),
        "policy": method.policy,
        "step_s": max(r["median"] for r in everyone),  # the slowest rank decides
        "step_s_mean": elapsed / n,
        "step_s_per_rank": [r["median"] for r in everyone],
        "exchanges": sorted({e.kind for e in opt._exchanges.values()}),
        "measured_bytes_per_step": (tx1 - tx0) / n,
        "measured_bytes_per_rank": (tx1 - tx0) / n / transport.size,
        "sent_bytes_per_rank": statistics.mean(r["sent"] for r in everyone),
        "received_bytes_per_rank": statistics.mean(r["received"] for r in everyone),
        "modelled_bytes_per_step": sum(r["wire"] for r in everyone),
        "payload_bytes_per_rank": statistics.mean(r["payload"] for r in everyone),
        "bits_per_value": 8.0 * statistics.mean(r["payload"] for r in everyone) / numel,
        "raw_bytes": 4 * numel,
        "compress_s": max(r["compress"] for r in everyone),
        "wait_s": max(r["wait"] for r in everyone),
        "decode_s": max(r["decode"] for r in everyone),
        **extra,
    }


def worker_main(args) -> int:
    import torch

    torch.set_num_threads(1)
    from hvdcompress.transports import make_transport

    transport = make_transport(args.backend)
    rank = transport.rank
    # slow first-time imports (torch.optim pulls in torch._dynamo: seconds) and every rank
    # up before the first case, so that startup is not charged to a case or its timeout
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import hvdcompress.training.models  # noqa: F401  (the models)

    transport.allgather_object(None)
    cat_cost: dict = {}
    rate_now = None
    for item in args.items:
        rate, model_name, case, exchange = parse_item(item)
        if rank == 0:
            emit({"event": "start", "item": item})
        t0 = time.perf_counter()
        try:
            if rate != rate_now:  # rank 0 re-rates the link while every rank waits
                transport.allgather_object(None)
                if rank == 0:
                    sh(*tc_rate_command(rate), check=rate_bits(rate) is not None)
                transport.allgather_object(None)
                rate_now = rate
                cat_cost.clear()  # CAT calibrates again at the new rate
            if case == args.inject_failure:
                raise RuntimeError(f"injected failure in case {case!r}")
            if case == args.inject_hang and rank == transport.size - 1:
                time.sleep(10**6)  # the other ranks wait in a collective: a deadlock
            mode = "auto" if exchange == "allreduce" else exchange  # summable: allreduced
            row = run_case(args, transport, model_name, case, cat_cost, mode)
        except BaseException as err:  # noqa: BLE001 - report, then end every rank
            emit({"event": "error", "item": item, "rank": rank, "error": f"{err!r}"[:400]})
            sys.stdout.flush()
            os._exit(3)  # collectives may be pending: no orderly shutdown
        if rank == 0:
            row["case_wall_s"] = time.perf_counter() - t0
            emit({"event": "result", "item": item, "row": row})
    if rank == 0:
        emit({"event": "done"})
    transport.allgather_object(None)
    return 0


# =========================================================================================
# driver: namespace, rate, launches, timeouts, cleanup, report
# =========================================================================================
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


def item_name(rate: str, model: str, case: str, exchange: str = "auto") -> str:
    return f"{rate}/{model}/{case}/{exchange}"


def parse_item(item: str) -> tuple[str, str, str, str]:
    rate, model, case, exchange = item.split("/")
    return rate, model, case, exchange


def case_exchanges(case: str, exchanges: list[str]) -> list[str]:
    """The exchanges a case runs with: summable compressors only with the allreduce."""
    summable = REGISTRY[CASES[case].compression].summable
    return ["allreduce"] if summable else list(exchanges)


def cleanup_stale(prefix: str) -> list[str]:
    """Remove namespaces with the prefix whose driver (the pid in the name) is gone."""
    removed = []
    for ns in list_namespaces(prefix):
        suffix = ns[len(prefix) :]
        alive = False
        if suffix.isdigit():
            try:
                cmdline = Path(f"/proc/{suffix}/cmdline").read_bytes()
                alive = SCRIPT.name.encode() in cmdline
            except OSError:
                alive = False
        if not alive:
            ns_delete(ns)
            removed.append(ns)
    return removed


def launch_command(args, ns: str, launcher: str, ranks: int, items: list[str]) -> list[str]:
    worker = [
        sys.executable, "-u", str(SCRIPT), "--worker",
        "--backend", "horovod" if launcher == "gloo" else "mpi4py",
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size),
        "--accordion-interval", str(args.accordion_interval),
        "--cat-every", str(args.cat_every),
    ]  # fmt: skip
    if args.inject_failure:
        worker += ["--inject-failure", args.inject_failure]
    if args.inject_hang:
        worker += ["--inject-hang", args.inject_hang]
    worker += ["--items", *items]
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
    return ["ip", "netns", "exec", ns, *cmd]


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line.rstrip("\n"))
    q.put(None)


def run_launch(args, ns, launcher, ranks, items) -> tuple[dict, bool, float]:
    """One launch for ``items``: ({item: row or failure}, whether any case started, wall s).
    Ends at the first failure (the caller relaunches for the rest)."""
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = launch_command(args, ns, launcher, ranks, items)
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
        cwd=ROOT,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the driver only; it ends the ranks
    )
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
    tail: deque[str] = deque(maxlen=40)
    out: dict = {}
    current = None
    started = False
    deadline = t_launch + args.startup_timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if current is None and not started:
                    why = f"timeout: the launch started no case within {args.startup_timeout:g} s"
                elif current is None:
                    why = f"timeout: no next case within {args.timeout:g} s"
                else:
                    why = f"timeout: no result within {args.timeout:g} s"
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
            pos = line.find(MARK)
            if pos < 0:
                tail.append(line)
                if args.verbose:
                    print("    | " + line, flush=True)
                continue
            try:
                event = json.loads(line[pos + len(MARK) :])
            except json.JSONDecodeError:
                tail.append(line)
                continue
            kind = event.get("event")
            if args.verbose:
                lag = time.time() - event.get("t", time.time())
                print(f"    event {kind} {event.get('item', '')} (arrived {lag:.1f} s late)")
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
    finally:
        if proc.poll() is None:
            try:
                proc.wait(timeout=2.0 if out and all(i in out for i in items) else 0.01)
            except subprocess.TimeoutExpired:
                pass
        ns_kill(ns)  # the launcher and every rank (and anything they left behind)
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
    if current is not None and current not in out:
        out[current] = {
            "status": "failed",
            "reason": f"the launch exited with status {rc} during the case" + _tail_note(tail),
        }
    elif not started and not out:
        why = f"the launch exited with status {rc} before any case" + _tail_note(tail)
        out[items[0]] = {"status": "failed", "reason": why}
    return out, started, time.monotonic() - t_launch


def _tail_note(tail) -> str:
    lines = [ln.strip() for ln in tail if ln.strip()]
    return (" | last output: " + " / ".join(lines[-3:]))[:600] if lines else ""


def run_group(args, ns, launcher, ranks, items, rows: list, log) -> None:
    """All items of one (launcher, ranks) in one launch; relaunches after a failed case."""

    def record(item, result):
        rate, model, case, exchange = parse_item(item)
        row = {"launcher": launcher, "ranks": ranks, "rate": rate, "model": model, "case": case,
               "exchange": exchange}  # fmt: skip
        row.update(result)
        rows.append(row)
        log(row)

    pending = list(items)
    while pending:
        got, started, wall = run_launch(args, ns, launcher, ranks, pending)
        if not started:  # it never got going: the same would happen again
            reason = got.get(pending[0], {}).get("reason", "the launch failed")
            for item in pending:
                record(item, got.get(item) or {"status": "failed", "reason": "not run: " + reason})
            return
        for item in pending:
            if item in got:
                record(item, got[item])
        pending = [i for i in pending if i not in got]
        if args.verbose:
            print(f"  launch took {wall:.1f} s", flush=True)


def add_speedups(rows: list) -> None:
    """Speedups over none and fp16 (allreduced), and of a twostage row over the same case
    on the allgather; for twostage rows also ``sent_vs_model``: the bytes sent per rank
    over 2 (N - 1) / N x the allgather row's payload per rank."""
    groups: dict = {}
    for r in rows:
        key = (r["launcher"], r["ranks"], r["rate"], r["model"])
        groups.setdefault(key, {})[(r["case"], r.get("exchange", "auto"))] = r
    for r in rows:
        g = groups[(r["launcher"], r["ranks"], r["rate"], r["model"])]
        ok = r.get("status") == "ok"
        for base in ("none", "fp16"):
            b = g.get((base, "allreduce")) or g.get((base, "auto"))
            fine = ok and b is not None and b.get("status") == "ok"
            r[f"speedup_vs_{base}"] = b["step_s"] / r["step_s"] if fine else None
        ag = g.get((r["case"], "allgather"))
        fine = ok and r.get("exchange") == "twostage" and ag is not None and ag["status"] == "ok"
        r["speedup_vs_allgather"] = ag["step_s"] / r["step_s"] if fine else None
        n = r["ranks"]
        model = 2.0 * (n - 1) / n * ag["payload_bytes_per_rank"] if fine else None
        r["sent_vs_model"] = r["sent_bytes_per_rank"] / model if model else None


def _fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def markdown(rows: list, meta: dict) -> str:
    head = (
        "| launcher | ranks | rate | model | case | exchange | step s (median) | wire MB/step "
        "measured | modelled | meas/model | kB/rank/step measured | sent kB/rank (transport) "
        "| bits/value | speedup vs none | vs fp16 | vs allgather | status |"
    )
    lines = [
        f"# Network benchmark ({meta['date']})",
        "",
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up steps, batch "
        f"{meta['batch_size']} per rank, 1 torch thread per rank, on {meta['host']}. "
        f"Link: the loopback of network namespace {meta['namespace']} limited with tc tbf; "
        f"{LATENCY_NOTE}. All ranks share the one link. Measured bytes: loopback tx bytes "
        "of the namespace per step (every rank's sends, TCP/IP headers included); modelled: "
        "the sum over ranks of DistributedOptimizer.last_stats.wire_bytes (ring model).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for r in rows:
        ok = r.get("status") == "ok"
        meas = r.get("measured_bytes_per_step") if ok else None
        model = r.get("modelled_bytes_per_step") if ok else None
        ratio = meas / model if ok and model else None
        status = "ok" if ok else "FAILED: " + str(r.get("reason", "")).replace("|", "/")
        cells = [
            r["launcher"], str(r["ranks"]), r["rate"], r["model"], r["case"],
            r.get("exchange", "auto"),
            _fmt(r.get("step_s") if ok else None, ".3f"),
            _fmt(None if meas is None else meas / 1e6, ".2f"),
            _fmt(None if model is None else model / 1e6, ".2f"),
            _fmt(ratio, ".2f"),
            _fmt(r.get("measured_bytes_per_rank") / 1e3 if ok else None, ".1f"),
            _fmt(r.get("sent_bytes_per_rank") / 1e3 if ok else None, ".1f"),
            _fmt(r.get("bits_per_value") if ok else None, ".2f"),
            _fmt(r.get("speedup_vs_none"), ".2f"),
            _fmt(r.get("speedup_vs_fp16"), ".2f"),
            _fmt(r.get("speedup_vs_allgather"), ".2f"),
            status,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    exchanges = {r.get("exchange") for r in rows} - {"allreduce"}
    if len({r["ranks"] for r in rows}) > 1 or len(exchanges) > 1:
        lines += ["", *bytes_table(rows)]
    return "\n".join(lines) + "\n"


def _label(r: dict) -> str:
    """A row's case, with its exchange when that is a choice (gather-only cases)."""
    exchange = r.get("exchange", "auto")
    return r["case"] if exchange in ("auto", "allreduce") else f"{r['case']} ({exchange})"


def bytes_table(rows: list) -> list[str]:
    """Bytes per rank per step against the number of ranks: kB measured on the loopback
    / N, and (transport-counted) sent kB; for twostage rows / 2 (N - 1) / N x payload."""
    ranks = sorted({r["ranks"] for r in rows})
    keys = list(dict.fromkeys((r["launcher"], r["rate"], r["model"], _label(r)) for r in rows))
    head = "| launcher | rate | model | case | " + " | ".join(f"N={n}" for n in ranks) + " |"
    lines = [
        "Bytes per rank per step: loopback-measured kB / N; transport-counted sent kB; for "
        "twostage, sent / (2 (N - 1) / N x the allgather payload per rank).",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for key in keys:
        cells = []
        for n in ranks:
            r = next(
                (r for r in rows
                 if (r["launcher"], r["rate"], r["model"], _label(r)) == key and r["ranks"] == n),
                None,
            )  # fmt: skip
            if r is None or r.get("status") != "ok":
                cells.append("-")
                continue
            text = (
                f"{r['measured_bytes_per_rank'] / 1e3:.1f} / {r['sent_bytes_per_rank'] / 1e3:.1f}"
            )
            if r.get("sent_vs_model") is not None:
                text += f" ({r['sent_vs_model']:.2f})"
            cells.append(text)
        lines.append("| " + " | ".join([*key, *cells]) + " |")
    return lines


def plot_bytes(rows: list, path: Path) -> str | None:
    """Bytes sent per rank per step (transport-counted) against the number of ranks, one
    line per (launcher, rate, model, case and exchange); only with several rank counts."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ranks = sorted({r["ranks"] for r in ok})
    if len(ranks) < 2:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"no bytes PNG ({err})"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    keys = list(dict.fromkeys((r["launcher"], r["rate"], r["model"], _label(r)) for r in ok))
    for key in keys:
        pts = sorted(
            (r["ranks"], r["sent_bytes_per_rank"] / 1e3)
            for r in ok
            if (r["launcher"], r["rate"], r["model"], _label(r)) == key
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=" ".join(key))
    ax.set_xticks(ranks)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("kB sent per rank per step (transport-counted)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Bytes per rank vs ranks: allgather (N - 1) x P, two-stage ~2 (N - 1) / N x P")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def plot(rows: list, path: Path) -> str | None:
    """Step time against link rate, log-log: one panel per model x ranks (rows: models,
    columns: ranks), one colour per case, one line style per launcher."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError as err:
        return f"no PNG ({err})"
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return "no PNG (no successful case)"
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    all_ranks = sorted({r["ranks"] for r in rows})
    finite = [rate_bits(r["rate"]) for r in rows if rate_bits(r["rate"]) is not None]
    unlimited_x = 10 * max(finite) / 1e9 if finite else 100.0

    def x_of(rate):
        b = rate_bits(rate)
        return unlimited_x if b is None else b / 1e9

    cases = list(dict.fromkeys(_label(r) for r in rows))
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(cases)}
    styles = {"gloo": "-", "mpi": "--"}
    launchers = [la for la in LAUNCHERS if any(r["launcher"] == la for r in rows)]
    xs = sorted({x_of(r["rate"]) for r in rows})
    fig, axes = plt.subplots(
        len(models),
        len(all_ranks),
        figsize=(5.5 * len(all_ranks) + 2.0, 4.2 * len(models)),
        squeeze=False,
    )
    for i, model in enumerate(models):
        for j, ranks in enumerate(all_ranks):
            ax = axes[i][j]
            for case in cases:
                for launcher in launchers:
                    key = (model, ranks, case, launcher)
                    pts = sorted(
                        (x_of(r["rate"]), r["step_s"])
                        for r in ok
                        if (r["model"], r["ranks"], _label(r), r["launcher"]) == key
                    )
                    style = styles.get(launcher, ":") if len(launchers) > 1 else "-"
                    if pts:
                        ax.plot(*zip(*pts, strict=True), style,
                                marker="o", markersize=3, color=colors[case])  # fmt: skip
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(xs)
            ax.set_xticklabels(["unlimited" if x == unlimited_x else f"{x:g}" for x in xs])
            ax.minorticks_off()
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
            if not ax.lines:
                ax.text(0.5, 0.5, "no successful case", ha="center", transform=ax.transAxes)
            ax.set_xlabel("link rate, Gbit/s (no added latency)")
            ax.set_ylabel("median step time, s")
            ax.set_title(f"{model}, {ranks} ranks")
            ax.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], color=colors[c], marker="o", markersize=3, label=c) for c in cases]
    if len(launchers) > 1:
        handles += [
            Line2D([], [], color="black", linestyle=styles.get(la, ":"), label=la)
            for la in launchers
        ]
    fig.legend(handles=handles, loc="center right", fontsize=8)
    fig.suptitle(
        "Training step time vs link rate (all ranks share one tc-tbf loopback; no latency)"
    )
    fig.tight_layout(rect=(0, 0, 1 - 1.9 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="default: 2 4")
    p.add_argument(
        "--rates",
        type=rate_arg,
        nargs="+",
        default=list(DEFAULT_RATES),
        help="tc rates (100mbit, 1gbit, ...) or unlimited; default: " + " ".join(DEFAULT_RATES),
    )
    p.add_argument(
        "--cases", nargs="+", choices=list(CASES), default=list(CASES), help="default: all"
    )
    p.add_argument(
        "--models", nargs="+", choices=MODELS, default=list(MODELS), help="default: light cnn"
    )
    p.add_argument(
        "--launchers",
        nargs="+",
        choices=LAUNCHERS,
        default=list(LAUNCHERS),
        help="gloo: horovodrun --gloo (backend horovod); mpi: mpirun over TCP (backend\n"
        "mpi4py); default: both",
    )
    p.add_argument(
        "--exchanges",
        nargs="+",
        choices=EXCHANGES,
        default=["auto"],
        help="exchange= of gather-only cases (summable ones are allreduced); default: auto",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one case may take")
    p.add_argument(
        "--startup-timeout", type=float, default=180.0, help="seconds a launch may take to start"
    )
    p.add_argument("--accordion-interval", type=int, default=2, help="steps per interval")
    p.add_argument("--cat-every", type=int, default=100, help="CAT recomputes T* every S steps")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "network")
    p.add_argument("--ns-prefix", default=PREFIX, help="namespace name prefix")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 2 ranks, gloo, 1gbit and unlimited, light model, none and 3lc,\n"
        "1 warm-up and 2 timed steps (explicit options still win)",
    )
    p.add_argument("--cleanup", action="store_true", help="remove stale namespaces and exit")
    p.add_argument("--verbose", "-v", action="store_true", help="show the ranks' output")
    # worker mode and test hooks (hidden)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=["horovod", "mpi4py"], help=argparse.SUPPRESS)
    p.add_argument("--items", nargs="+", default=[], help=argparse.SUPPRESS)
    p.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject-hang", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in argv if a.startswith("--")}
        quick = {
            "--ranks": ("ranks", [2]),
            "--rates": ("rates", ["1gbit", "unlimited"]),
            "--cases": ("cases", ["none", "3lc"]),
            "--models": ("models", ["light"]),
            "--launchers": ("launchers", ["gloo"]),
            "--steps": ("steps", 2),
            "--warmup": ("warmup", 1),
            "--timeout": ("timeout", 120.0),
        }
        for flag, (dest, value) in quick.items():
            if flag not in given:
                setattr(args, dest, value)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step negotiates and decides)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    why = netns_available()
    if why:
        print(f"bench_network: {why}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale(args.ns_prefix)
        print(f"removed {len(removed)} stale namespace(s): {' '.join(removed) or '-'}")
        return 0
    stale = [ns for ns in list_namespaces(args.ns_prefix) if ns != f"{args.ns_prefix}{os.getpid()}"]
    if stale:
        print(f"note: namespaces {stale} exist (another run, or stale: --cleanup)", flush=True)

    ns = f"{args.ns_prefix}{os.getpid()}"
    items = [
        item_name(r, m, c, e)
        for r in args.rates
        for m in args.models
        for c in args.cases
        for e in case_exchanges(c, args.exchanges)
    ]
    rows: list = []
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})",
        "namespace": ns,
        "latency": LATENCY_NOTE,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "ranks": args.ranks,
        "rates": args.rates,
        "cases": args.cases,
        "exchanges": args.exchanges,
        "models": args.models,
        "launchers": args.launchers,
        "timeout_s": args.timeout,
        "cases_defined": {k: {"compressor": m.compression, "params": dict(m.params),
                              "policy": m.policy} for k, m in CASES.items()},
    }  # fmt: skip
    t_all = time.monotonic()

    def log(row):
        if row.get("status") == "ok":
            what = (
                f"{row['step_s']:.3f} s/step, {row['measured_bytes_per_step'] / 1e6:.2f} MB/step "
                f"measured, {row['modelled_bytes_per_step'] / 1e6:.2f} modelled "
                f"({row.get('case_wall_s', 0):.1f} s)"
            )
        else:
            what = f"FAILED: {row.get('reason')}"
        print(
            f"{row['launcher']:<4} {row['ranks']} ranks {row['rate']:>9} {row['model']:<5} "
            f"{_label(row):<24} {what}",
            flush=True,
        )

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    interrupted = None
    created = False
    try:
        for s in handlers:
            signal.signal(s, _on_signal)
        ns_create(ns)
        created = True
        print(f"namespace {ns}; {LATENCY_NOTE}", flush=True)
        for launcher in args.launchers:
            for ranks in args.ranks:
                run_group(args, ns, launcher, ranks, items, rows, log)
    except (Interrupted, KeyboardInterrupt) as err:
        interrupted = str(err) or "SIGINT"
        print(f"interrupted ({interrupted}): cleaning up", file=sys.stderr, flush=True)
    finally:
        for s in handlers:  # nothing may interrupt the clean-up
            signal.signal(s, signal.SIG_IGN)
        if created or ns in list_namespaces(args.ns_prefix):
            ns_delete(ns)
        for s, h in handlers.items():
            signal.signal(s, h)
    meta["wall_s"] = time.monotonic() - t_all
    if interrupted:
        meta["interrupted"] = interrupted
        seen = {
            (r["launcher"], r["ranks"], r["rate"], r["model"], r["case"], r["exchange"])
            for r in rows
        }
        for launcher in args.launchers:
            for ranks in args.ranks:
                for item in items:
                    rate, model, case, exchange = parse_item(item)
                    if (launcher, ranks, rate, model, case, exchange) not in seen:
                        rows.append(
                            {"launcher": launcher, "ranks": ranks, "rate": rate,
                             "model": model, "case": case, "exchange": exchange,
                             "status": "failed",
                             "reason": f"not run: interrupted by {interrupted}"}
                        )  # fmt: skip
    order = {
        "launcher": {v: i for i, v in enumerate(args.launchers)},
        "rate": {v: i for i, v in enumerate(args.rates)},
        "model": {v: i for i, v in enumerate(args.models)},
        "case": {v: i for i, v in enumerate(args.cases)},
        "exchange": {v: i for i, v in enumerate(["allreduce", *args.exchanges])},
    }
    rows.sort(key=lambda r: (order["launcher"].get(r["launcher"], 99), r["ranks"],
                             order["rate"].get(r["rate"], 99), order["model"].get(r["model"], 99),
                             order["case"].get(r["case"], 99),
                             order["exchange"].get(r["exchange"], 99)))  # fmt: skip
    add_speedups(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_network.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = markdown(rows, meta)
    (args.out / "bench_network.md").write_text(table)
    note = plot(rows, args.out / "bench_network.png")
    note = plot_bytes(rows, args.out / "bench_network_bytes.png") or note
    print()
    print(table)
    print(f"wrote {args.out}/bench_network.md, .json" + (f"; {note}" if note else ", .png"))
    print(f"total {meta['wall_s']:.0f} s")
    if interrupted:
        return 128 + getattr(signal.Signals, interrupted, signal.SIGINT).value
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
