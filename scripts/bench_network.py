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
this script: scripts/_bench/networker.py), once per (launcher, ranks); before the cases
of each rate, rank 0 sets the rate of the namespace's loopback with ``tc qdisc replace
dev lo root tbf rate R burst B latency 100ms`` (B = max(1 MiB, R x 1 ms): the burst must
exceed the 64 KiB loopback MTU) while the other ranks wait. Launchers:

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

An emulated cluster (``--nodes M --ranks-per-node K --node-link RATE...``, M >= 2):
scripts/_bench/cluster.py's M node namespaces behind a switch, each node's link at RATE
in both directions (tc tbf on its veth, set by the driver before each launch, one
launch per rate; default ``--rates``), the ranks of a node on its loopback. One torchrun
per node namespace (launcher ``torchrun``, backend ``torch``: TorchDistTransport over
gloo, threaded); ``--ranks`` and ``--launchers`` do not apply, ``--exchanges`` may add
``hierarchical``. Each node's local rank 0 reads its link's veth counters around the
timed steps: rows get ``node_link_bytes_per_step`` ([tx, rx] per node) and their
measured bytes are the sum of the nodes' tx (what crossed the switch; traffic inside a
node is not counted). For example::

    python scripts/bench_network.py --nodes 2 --ranks-per-node 2 --node-link 100mbit \
        --models cnn --cases none 3lc --exchanges allgather hierarchical

Output in ``--out`` (default results/network): bench_network.md (tables), .json, .png
(step time against bandwidth, log-log, one line per case and exchange, one panel per
model x ranks) and, with several rank counts, bench_network_bytes.png (bytes per rank per
step against N).
The namespace (the cluster's namespaces) and every process in it are removed on exit, on
failure and on Ctrl-C / SIGTERM; ``--cleanup`` removes namespaces (a cluster's too) left
by a driver that was killed (SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from hvdcompress.compressors import REGISTRY

try:  # python scripts/bench_network.py: scripts/ is first on sys.path
    from _bench import cluster, launch, netns, netreport, report
    from _bench.networker import CASES, MODELS, STOCK_CASES, item_name, parse_item, worker_main
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import cluster, launch, netns, netreport, report
    from scripts._bench.networker import (
        CASES,
        MODELS,
        STOCK_CASES,
        item_name,
        parse_item,
        worker_main,
    )

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
PREFIX = "hvdc-bench-"
LATENCY_NOTE = (
    "no latency emulated: this kernel has no netem, links have a rate (tc tbf) but no delay"
)

LAUNCHERS = ("gloo", "mpi")
DEFAULT_RATES = ("100mbit", "1gbit", "10gbit", "unlimited")
# DistributedOptimizer(exchange=...); hierarchical: on the emulated cluster (--nodes)
EXCHANGES = ("auto", "allgather", "twostage", "hierarchical")
CLUSTER_LAUNCHER = "torchrun"  # --nodes >= 2: one torchrun per node, torch.distributed
CLUSTER_PORT = 29470


# =========================================================================================
# driver: the namespace, the launches and the report (scripts/_bench); the worker mode
# (--worker) is scripts/_bench/networker.py's worker_main
# =========================================================================================
def case_exchanges(case: str, exchanges: list[str]) -> list[str]:
    """The exchanges a case runs with: summable compressors (and stock Horovod) only with
    the allreduce."""
    summable = case in STOCK_CASES or REGISTRY[CASES[case].compression].summable
    return ["allreduce"] if summable else list(exchanges)


def launch_command(args, ns, launcher: str, ranks: int, items: list[str]) -> list[str]:
    """The launch of ``items`` on ``ranks`` ranks: in namespace ``ns`` with ``launcher``, or
    on the emulated cluster ``ns`` (a ``cluster.Cluster``: torchrun per node)."""
    backend = {"gloo": "horovod", "mpi": "mpi4py", CLUSTER_LAUNCHER: "torch"}[launcher]
    worker = [
        str(SCRIPT), "--worker", "--backend", backend,
        "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size),
        "--accordion-interval", str(args.accordion_interval),
        "--cat-every", str(args.cat_every),
        "--tuning-half", args.tuning_half, "--tuning-drift", args.tuning_drift,
    ]  # fmt: skip
    if args.inject_failure:
        worker += ["--inject-failure", args.inject_failure]
    if args.inject_hang:
        worker += ["--inject-hang", args.inject_hang]
    worker += ["--items", *items]
    if isinstance(ns, cluster.Cluster):
        args.port += 1  # a fresh store port for a relaunch after a failed case
        return cluster.launch_command(ns, args.ranks_per_node, args.port, worker)
    python = [sys.executable, "-u", *worker]
    return ["ip", "netns", "exec", ns, *launch.rank_command(launcher, ranks, python)]


def run_group(args, ns, launcher, ranks, items, rows: list) -> None:
    """All items of one (launcher, ranks) in one launch; relaunches after a failed case.
    ``ns``: the namespace, or the emulated cluster (``cluster.Cluster``)."""
    on_cluster = isinstance(ns, cluster.Cluster)

    def record(item, result):
        rate, model, case, exchange = parse_item(item)
        row = {"launcher": launcher, "ranks": ranks, "rate": rate, "model": model, "case": case,
               "exchange": exchange}  # fmt: skip
        if on_cluster:
            row.update(nodes=ns.nodes, ranks_per_node=args.ranks_per_node,
                       topology=f"{ns.nodes}x{args.ranks_per_node}")  # fmt: skip
        row.update(result)
        rows.append(row)
        print(netreport.log_line(row), flush=True)

    def run(pending):
        cmd = launch_command(args, ns, launcher, ranks, pending)
        stop = (lambda: cluster.kill(ns)) if on_cluster else (lambda: netns.ns_kill(ns))
        return launch.run_launch(cmd, pending, args, ROOT, stop)

    launch.run_items(items, run, record, args.verbose)


def _add_matrix_args(p) -> None:
    """The matrix: ranks, rates, cases, models, launchers, exchanges."""
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="default: 2 4")
    p.add_argument(
        "--rates",
        type=netns.rate_arg,
        nargs="+",
        default=list(DEFAULT_RATES),
        help="tc rates (100mbit, 1gbit, ...) or unlimited; default: " + " ".join(DEFAULT_RATES),
    )
    p.add_argument(
        "--cases",
        nargs="+",
        choices=[*CASES, *STOCK_CASES],
        default=list(CASES),
        help="default: all of hvdcompress's; horovod-none, horovod-fp16: stock\n"
        "hvd.DistributedOptimizer with Horovod's compression (launcher gloo only)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=["light", "cnn"],
        help="default: light cnn (vit, mlp10m: the train.py models)",
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


def _add_cluster_args(p) -> None:
    """The emulated cluster: nodes, ranks per node, node link rates."""
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="2 or more: an emulated cluster of that many nodes (a namespace each, one\n"
        "torchrun per node, torch.distributed over gloo), each node's link at --node-link;\n"
        "--ranks and --launchers do not apply; default: 1 (the shared link)",
    )
    p.add_argument("--ranks-per-node", type=int, default=2, help="on the cluster; default: 2")
    p.add_argument(
        "--node-link",
        type=netns.rate_arg,
        nargs="+",
        default=None,
        metavar="RATE",
        help="on the cluster: the rate of every node's link, both directions (one run per\n"
        "rate); default: --rates",
    )


def _add_case_args(p) -> None:
    """A case's steps, batch and timeouts, and the policies' intervals."""
    p.add_argument("--steps", type=int, default=5, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one case may take")
    p.add_argument(
        "--startup-timeout", type=float, default=180.0, help="seconds a launch may take to start"
    )
    p.add_argument("--accordion-interval", type=int, default=2, help="steps per interval")
    p.add_argument("--cat-every", type=int, default=100, help="CAT recomputes T* every S steps")
    p.add_argument(
        "--tuning-half",
        choices=["bf16", "fp16", "off"],
        default="bf16",
        help="exchange auto: Tuning.half, the 16-bit dense option timed (off: None, float32\n"
        "only); default: bf16",
    )
    p.add_argument(
        "--tuning-drift",
        type=_drift_arg,
        default="0.25",
        help="exchange auto: Tuning.drift, re-time when the step time moves by this\n"
        "fraction (off: never); default: 0.25",
    )


def _add_driver_args(p) -> None:
    """The driver's output, namespaces and modes (--quick, --cleanup, --verbose)."""
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


def _add_worker_args(p) -> None:
    """Worker mode and test hooks (hidden)."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=["horovod", "mpi4py", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--items", nargs="+", default=[], help=argparse.SUPPRESS)
    p.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--inject-hang", default=None, help=argparse.SUPPRESS)


def _apply_quick(args, argv: list[str]) -> None:
    """--quick's smoke-test settings, for every option not given in ``argv``."""
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


def _drift_arg(text: str) -> str:
    """--tuning-drift: "off" or a fraction > 0 (kept as text: the worker's argument)."""
    if text != "off":
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number or 'off': {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return text


def _check_args(p, args) -> None:
    """The checks across options (``p.error`` on a failure); on the emulated cluster, its
    ranks, launcher and link rates in place of --ranks, --launchers and --rates."""
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step negotiates and decides)")
    stock = sorted(set(args.cases) & set(STOCK_CASES))
    if stock and (args.nodes >= 2 or set(args.launchers) != {"gloo"}):
        p.error(f"{', '.join(stock)}: stock Horovod runs with --launchers gloo only")
    if args.nodes >= 2:  # the emulated cluster: its ranks, launcher and link rates
        if args.ranks_per_node < 1:
            p.error("--ranks-per-node must be >= 1")
        args.ranks = [args.nodes * args.ranks_per_node]
        args.launchers = [CLUSTER_LAUNCHER]
        args.rates = list(args.node_link or args.rates)
    elif args.node_link:
        p.error("--node-link is the rate of a cluster's node links: give --nodes 2 or more")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_matrix_args(p)
    _add_cluster_args(p)
    _add_case_args(p)
    _add_driver_args(p)
    _add_worker_args(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.quick:
        _apply_quick(args, argv)
    _check_args(p, args)
    args.port = CLUSTER_PORT
    return args


def _note_stale_namespaces(args) -> None:
    """A note on the namespaces of the prefix that are not this run's (another run's, or
    stale: --cleanup)."""
    mine = f"{args.ns_prefix}{os.getpid()}"
    stale = [
        ns
        for ns in netns.list_namespaces(args.ns_prefix)
        if ns != mine and not ns.startswith(mine + "-")
    ]
    if stale:
        print(f"note: namespaces {stale} exist (another run, or stale: --cleanup)", flush=True)


def _matrix_items(args) -> list[str]:
    """Every (rate, model, case, exchange) of the run, in that nesting order."""
    return [
        item_name(r, m, c, e)
        for r in args.rates
        for m in args.models
        for c in args.cases
        for e in case_exchanges(c, args.exchanges)
    ]


def _run_meta(args, ns: str, on_cluster: bool) -> dict:
    """The JSON's ``meta``: when, where and what the run measures."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": report.command_line(),
        "host": report.host(),
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
        "cluster": {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                    "node_link": args.rates} if on_cluster else None,
        "timeout_s": args.timeout,
        "cases_defined": {k: {"compressor": m.compression, "params": dict(m.params),
                              "policy": m.policy} for k, m in CASES.items()},
    }  # fmt: skip


def _run_on_shared_link(args, ns: str, items: list[str], rows: list):
    """Every (launcher, ranks) group in namespace ``ns``, removed afterwards; the signal
    that interrupted the run, if one did."""

    def body():
        print(f"namespace {ns}; {LATENCY_NOTE}", flush=True)
        for launcher in args.launchers:
            for ranks in args.ranks:
                run_group(args, ns, launcher, ranks, items, rows)

    return netns.in_namespace(ns, args.ns_prefix, body)


def _run_on_cluster(args, ns: str, items: list[str], rows: list):
    """Every rate's items on the emulated cluster ``ns``*, its node links set to the rate
    before the launch; the cluster removed afterwards; the signal that interrupted the
    run, if one did."""
    c = cluster.Cluster(ns, args.nodes)

    def cluster_body():
        print(f"emulated cluster {ns}*: {args.nodes} nodes x {args.ranks_per_node} ranks; "
              f"{LATENCY_NOTE}", flush=True)  # fmt: skip
        for rate in args.rates:  # the driver rates every node's link, then launches
            cluster.set_node_link(c, rate)
            mine = [i for i in items if parse_item(i)[0] == rate]
            run_group(args, c, CLUSTER_LAUNCHER, args.ranks[0], mine, rows)

    return cluster.in_cluster(c, cluster_body)


def _write_report(args, rows: list, meta: dict) -> None:
    """The rows sorted with their speedups into --out (.json, .md, the plots), the table
    printed."""
    netreport.sort_rows(rows, args)
    netreport.add_speedups(rows)
    report.write_json(args.out / "bench_network.json", {"meta": meta, "rows": rows}, indent=1)
    table = netreport.markdown(rows, meta)
    (args.out / "bench_network.md").write_text(table)
    note = netreport.plot(rows, args.out / "bench_network.png", MODELS,
                          (*LAUNCHERS, CLUSTER_LAUNCHER))  # fmt: skip
    note = netreport.plot_bytes(rows, args.out / "bench_network_bytes.png") or note
    print()
    print(table)
    print(f"wrote {args.out}/bench_network.md, .json" + (f"; {note}" if note else ", .png"))
    print(f"total {meta['wall_s']:.0f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    why = netns.netns_available()
    if why:
        print(f"bench_network: {why}", file=sys.stderr)
        return 2
    if args.cleanup:  # the shared link's namespace and a cluster's (<prefix><pid>-...)
        removed = cluster.cleanup_stale(args.ns_prefix, SCRIPT.name)
        print(f"removed {len(removed)} stale namespace(s): {' '.join(removed) or '-'}")
        return 0
    _note_stale_namespaces(args)

    on_cluster = args.nodes >= 2
    ns = f"{args.ns_prefix}{os.getpid()}" + ("-" if on_cluster else "")
    items = _matrix_items(args)
    rows: list = []
    meta = _run_meta(args, ns, on_cluster)
    t_all = time.monotonic()
    if on_cluster:
        interrupted = _run_on_cluster(args, ns, items, rows)
    else:
        interrupted = _run_on_shared_link(args, ns, items, rows)
    meta["wall_s"] = time.monotonic() - t_all
    if interrupted:
        meta["interrupted"] = interrupted
        netreport.add_not_run(rows, args, items, parse_item, interrupted)
    _write_report(args, rows, meta)
    if interrupted:
        return 128 + getattr(signal.Signals, interrupted, signal.SIGINT).value
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
