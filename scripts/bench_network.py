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
import statistics
import sys
import time
from pathlib import Path

from hvdcompress.compressors import REGISTRY
from hvdcompress.training.methods import METHODS

try:  # python scripts/bench_network.py: scripts/ is first on sys.path
    from _bench import cluster, launch, netns, netreport, report, steps
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import cluster, launch, netns, netreport, report, steps

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
PREFIX = "hvdc-bench-"
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
# DistributedOptimizer(exchange=...); hierarchical: on the emulated cluster (--nodes)
EXCHANGES = ("auto", "allgather", "twostage", "hierarchical")
CLUSTER_LAUNCHER = "torchrun"  # --nodes >= 2: one torchrun per node, torch.distributed
CLUSTER_PORT = 29470
CAT_CALIBRATION_SIZES = (1, 1 << 10, 1 << 14, 1 << 17, 1 << 20)
# the optimizer's figures per step, summed over the timed steps: key -> last_stats field
# (sent and received: as the transport counted them)
STEP_STATS = {"payload": "payload_bytes", "wire": "wire_bytes", "compress": "compress_s",
              "wait": "wait_s", "decode": "decode_s", "sent": "sent_bytes",
              "received": "received_bytes"}  # fmt: skip


# =========================================================================================
# worker: runs under horovodrun / mpirun inside the namespace, one process per rank
# =========================================================================================
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
    opt = steps.distributed_sgd(model, method.compressor(), transport, policy=policy,
                                compress_min_numel=method.compress_min_numel,
                                exchange=exchange)  # fmt: skip

    t_built = time.perf_counter()
    extra["build_s"] = t_built - t_begin

    for _ in range(args.warmup):
        steps.train_step(model, opt, x, y)
    transport.allgather_object(None)  # barrier: every rank's warmup traffic is done
    extra["warmup_s"] = time.perf_counter() - t_built
    node_link = cluster.node_link_counter()  # cluster: the node's local rank 0 reads its link
    on_cluster = os.environ.get(cluster.NODE_DEVICE_ENV) is not None
    tx0 = netns.read_tx_bytes() if rank == 0 and not on_cluster else 0
    link0 = node_link() if node_link is not None else None
    transport.allgather_object(None)  # nobody sends a timed byte before rank 0 has read
    times = []
    acc = dict.fromkeys(STEP_STATS, 0.0)
    t_start = time.perf_counter()
    for _ in range(args.steps):
        times.append(steps.train_step(model, opt, x, y))
        for key, field in STEP_STATS.items():
            acc[key] += getattr(opt.last_stats, field)
    transport.allgather_object(None)  # barrier: every rank received everything
    elapsed = time.perf_counter() - t_start
    tx1 = netns.read_tx_bytes() if rank == 0 and not on_cluster else 0
    moved = None
    if node_link is not None:
        moved = [b - a for a, b in zip(link0, node_link(), strict=True)]
    metrics = opt.last_stats.metrics
    levels = [v for k, v in metrics.items() if k.startswith("level/")]
    budgets = [v for k, v in metrics.items() if k.startswith("T/")]
    mine = {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "node_link": moved,  # (tx, rx) of its node's link: the node's local rank 0 only
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
    if on_cluster:  # the bytes that crossed the switch: the sum of the nodes' link tx
        links = sorted((r["node"], r["node_link"]) for r in everyone if r["node_link"])
        extra["node_link_bytes_per_step"] = [[tx / n, rx / n] for _, (tx, rx) in links]
        tx1, tx0 = sum(tx for _, (tx, _) in links), 0
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
    if args.backend == "torch":  # the emulated cluster: torchrun per node, gloo
        import torch.distributed as dist

        from hvdcompress.transports.torch_dist import TorchDistTransport

        dist.init_process_group("gloo")
        transport = TorchDistTransport(threaded=True)
    else:
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
            launch.emit({"event": "start", "item": item})
        t0 = time.perf_counter()
        try:
            if rate != rate_now:  # rank 0 re-rates the link while every rank waits
                transport.allgather_object(None)
                if rank == 0 and args.backend != "torch":  # cluster: the driver rates them
                    netns.set_rate(rate)
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
            launch.emit({"event": "error", "item": item, "rank": rank, "error": f"{err!r}"[:400]})
            sys.stdout.flush()
            os._exit(3)  # collectives may be pending: no orderly shutdown
        if rank == 0:
            row["case_wall_s"] = time.perf_counter() - t0
            launch.emit({"event": "result", "item": item, "row": row})
    if rank == 0:
        launch.emit({"event": "done"})
    transport.allgather_object(None)
    return 0


# =========================================================================================
# driver: the namespace, the launches and the report (scripts/_bench)
# =========================================================================================
def item_name(rate: str, model: str, case: str, exchange: str = "auto") -> str:
    return f"{rate}/{model}/{case}/{exchange}"


def parse_item(item: str) -> tuple[str, str, str, str]:
    rate, model, case, exchange = item.split("/")
    return rate, model, case, exchange


def case_exchanges(case: str, exchanges: list[str]) -> list[str]:
    """The exchanges a case runs with: summable compressors only with the allreduce."""
    summable = REGISTRY[CASES[case].compression].summable
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="default: 2 4")
    p.add_argument(
        "--rates",
        type=netns.rate_arg,
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
    p.add_argument("--backend", choices=["horovod", "mpi4py", "torch"], help=argparse.SUPPRESS)
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
    if args.nodes >= 2:  # the emulated cluster: its ranks, launcher and link rates
        if args.ranks_per_node < 1:
            p.error("--ranks-per-node must be >= 1")
        args.ranks = [args.nodes * args.ranks_per_node]
        args.launchers = [CLUSTER_LAUNCHER]
        args.rates = list(args.node_link or args.rates)
    elif args.node_link:
        p.error("--node-link is the rate of a cluster's node links: give --nodes 2 or more")
    args.port = CLUSTER_PORT
    return args


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
    mine = f"{args.ns_prefix}{os.getpid()}"
    stale = [
        ns
        for ns in netns.list_namespaces(args.ns_prefix)
        if ns != mine and not ns.startswith(mine + "-")
    ]
    if stale:
        print(f"note: namespaces {stale} exist (another run, or stale: --cleanup)", flush=True)

    on_cluster = args.nodes >= 2
    ns = f"{args.ns_prefix}{os.getpid()}" + ("-" if on_cluster else "")
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
    t_all = time.monotonic()

    def body():
        print(f"namespace {ns}; {LATENCY_NOTE}", flush=True)
        for launcher in args.launchers:
            for ranks in args.ranks:
                run_group(args, ns, launcher, ranks, items, rows)

    def cluster_body():
        print(f"emulated cluster {ns}*: {args.nodes} nodes x {args.ranks_per_node} ranks; "
              f"{LATENCY_NOTE}", flush=True)  # fmt: skip
        for rate in args.rates:  # the driver rates every node's link, then launches
            cluster.set_node_link(c, rate)
            mine = [i for i in items if parse_item(i)[0] == rate]
            run_group(args, c, CLUSTER_LAUNCHER, args.ranks[0], mine, rows)

    if on_cluster:
        c = cluster.Cluster(ns, args.nodes)
        interrupted = cluster.in_cluster(c, cluster_body)
    else:
        interrupted = netns.in_namespace(ns, args.ns_prefix, body)
    meta["wall_s"] = time.monotonic() - t_all
    if interrupted:
        meta["interrupted"] = interrupted
        netreport.add_not_run(rows, args, items, parse_item, interrupted)
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
    if interrupted:
        return 128 + getattr(signal.Signals, interrupted, signal.SIGINT).value
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
