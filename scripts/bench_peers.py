#!/usr/bin/env python
"""Step time of DDP with hvdcompress's hook against what a user would pick instead, on a
rate-limited link: DDP's own allreduce, torch's fp16 / bf16 / PowerSGD hooks, and
hvdcompress's hook (overlapped, and inline for the comparison). Run as root:

    python scripts/bench_peers.py                                  # the default matrix
    python scripts/bench_peers.py --rates 100mbit --models mlp10m --rows ddp hvdc-3lc

The driver creates a network namespace ``hvdc-peers-<pid>`` (scripts/_bench/netns.py, as
bench_network.py), and per rate gives its loopback that rate with tc tbf and launches
``torchrun --standalone --nproc_per_node N`` of this script's worker mode inside it. All
ranks share the one link (a shared bus, not one NIC per node); no latency is emulated.
Gloo on CPU, one torch thread per rank; with 2 cores, 4 ranks oversubscribe the CPU.

Per rate, ``--repeats`` (default 3) separate torchrun launches. Per launch and (model,
row): a fresh DDP model, ``--warmup`` steps (error feedback and PowerSGD's warm start
build up; torch PowerSGD starts compressing at step 2, its state train.py's:
``torch_hooks.powersgd_state``, ``min_compression_rate=1``; an ``hvdc-`` row with
``exchange="auto"`` goes on until its tuner's first round has decided, at most 60 steps
more: the steady state a user gets, its decisions in the JSON, those steps counted in
``tuning_steps`` and their time in ``tuning_s``, per step the slowest rank's, summed), a
barrier, then ``--steps`` timed steps. A step is forward, backward (the hook's
collectives and DDP's wait for their futures) and SGD's step; its time is the slowest
rank's. ``--recipe training`` (the default; scripts/_bench/recipe.py) steps on the job
train.py trains, so that the bits timed are the bits trained: the model as train.py
initialises it for seed 1, each rank's Fashion-MNIST training batches in train.py's order
for seed 1 (``--batch`` default 64, train.py's), and the SGD train.py builds for the row's
method (lr 0.05 x the compressor's factor, its momentum or 0.9: ``flags.method_sgd``;
``ddp`` and torch's rows lr 0.05, momentum 0.9). ``--recipe random``: one random batch per
rank (``--batch`` default 32) at every step, plain SGD at lr 0.01, as before. Reported:
the median of the launches' median step times and their spread (lo-hi; each launch's
median in ``step_runs_s``, the launches a row failed in in ``failed_runs``), the other
fields from the launch whose median is the middle one: bytes on the wire per step
(MEASURED: the namespace's loopback tx bytes, every rank's sends with TCP/IP headers),
the speedup over ``ddp`` on the same link and, for hvdcompress's rows, where a rank's step
time goes (encode, waiting on collectives, decode: ``DDPHookState.last_stats``, summed
over its buckets); the recipe in each row (``recipe``, ``data``, ``seed``, ``batch``,
``lr``, ``momentum``).

Models: train.py's (hvdcompress.training.models, width 16): ``mlp10m``
(784-2048-2048-2048-10, 10.0 M parameters, little compute per parameter), ``cnn`` (the
SmallCNN, 0.21 M) and ``vit`` (a 4-layer ViT, 0.54 M; not in the default ``--models``).
Rows: ``ddp`` (DDP's default allreduce), ``torch-fp16``, ``torch-bf16``,
``torch-powersgd-r1`` / ``-r2`` / ``-r4`` (torch's hooks; PowerSGD with one bucket,
``bucket_cap_mb=1000``: with DDP's 25 MB buckets it aborted or hung on gloo here), and
``hvdc-<method>`` for none, fp16, 3lc, 3lc-1.75, powersgd (rank 1), powersgd-r2, topk
(the methods table of hvdcompress.training.methods), with ``-inline`` for the hook
without overlap, ``hvdc-3lc-measured`` (``exchange="auto"`` with ``link_cost="measure"``:
by seconds on the link, timed at start, untuned), ``hvdc-3lc-guess`` (auto's first
guess, untuned), and ``hvdc-3lc-allgather`` / ``hvdc-3lc-twostage`` (``exchange=``; not
in the default rows), whose bytes per rank it compares with the two-stage exchange's
2 (N - 1) / N x payload.
Writes ``--out``/bench_peers.md, .json and .png (step time against link rate).

A matrix too long for one job runs in pieces: ``--launches FILE --max-launches N``
(scripts/_bench/launchlog.py), the same command again until no launch is left.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:  # python scripts/bench_peers.py: scripts/ is first on sys.path
    from _bench import cluster, launchlog, netns, recipe
    from _bench.peerreport import combine_launches, plot, summary, table, targets, twostage_bytes
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import cluster, launchlog, netns, recipe
    from scripts._bench.peerreport import (
        combine_launches,
        plot,
        summary,
        table,
        targets,
        twostage_bytes,
    )

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
PREFIX = "hvdc-peers-"
MARK = "HVDC_PEERS "
MODELS = ("mlp10m", "cnn", "vit")
HVDC_METHODS = ("none", "fp16", "3lc", "3lc-1.75", "powersgd", "powersgd-r2", "topk", "dqsg")
# fixed-exchange rows: for the bytes check and for time to accuracy (--rows), not default
EXCHANGE_ROWS = (
    "hvdc-3lc-allgather", "hvdc-3lc-twostage", "hvdc-dqsg-allgather", "hvdc-3lc-hierarchical",
    "hvdc-powersgd-r2-hierarchical",
)  # fmt: skip
ROWS = (
    "ddp", "torch-fp16", "torch-bf16", "torch-powersgd-r1", "torch-powersgd-r2",
    "torch-powersgd-r4", *(f"hvdc-{m}" for m in HVDC_METHODS), "hvdc-none-inline",
    "hvdc-3lc-inline", "hvdc-3lc-measured", "hvdc-3lc-guess", *EXCHANGE_ROWS,
)  # fmt: skip
DEFAULT_ROWS = ROWS[: -len(EXCHANGE_ROWS)]
# (exchange, link_cost, tuned) of a row's suffix; else ("auto", None, True): "auto"
# measured while training (docs/exchanges.md); "-guess": auto's first guess, untuned
EXCHANGE_SUFFIXES = {
    "-allgather": ("allgather", None, False),
    "-twostage": ("twostage", None, False),
    "-hierarchical": ("hierarchical", None, False),
    "-measured": ("auto", "measure", False),
    "-guess": ("auto", None, False),
}
TUNING_STEPS_MAX = 60  # warm-up steps a tuned row may add until its first round decides


# =========================================================================================
# worker: one rank under torchrun, inside the namespace
# =========================================================================================
def hvdc_row(row: str) -> tuple[str, str, str | None, bool]:
    """An ``hvdc-`` row's (method of the methods table, exchange, link_cost, tuned)."""
    name = row[len("hvdc-") :].removesuffix("-inline")
    exchange, link_cost, tuned = "auto", None, True
    for suffix, (mode, cost, tune) in EXCHANGE_SUFFIXES.items():
        if name.endswith(suffix):
            name, exchange, link_cost, tuned = name.removesuffix(suffix), mode, cost, tune
    return name, exchange, link_cost, tuned


def hooked(row: str, model):
    """DDP of ``model`` with ``row``'s hook; (ddp model, hvdcompress hook state or None)."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcompress
    from hvdcompress.training.methods import METHODS
    from hvdcompress.training.torch_hooks import (
        POWERSGD_BUCKET_CAP_MB,
        bf16_hook,
        powersgd_state,
    )

    if row.startswith("torch-powersgd-r"):
        ddp = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_CAP_MB)  # one bucket: train.py's
        rank = int(row.rsplit("r", 1)[1])
        # train.py's TorchHook's state: min_compression_rate 1, dense for the first 2 steps
        ddp.register_comm_hook(powersgd_state(rank), psgd.powerSGD_hook)
        return ddp, None
    ddp = DDP(model)
    if row == "torch-fp16":
        ddp.register_comm_hook(None, default.fp16_compress_hook)
    elif row == "torch-bf16":
        # torch's bf16 hook under another name: DDP refuses the name without CUDA + NCCL,
        # though gloo sums bfloat16 on the CPU (hvdcompress.training.torch_hooks)
        ddp.register_comm_hook(None, bf16_hook)
    elif row.startswith("hvdc-"):
        name, exchange, link_cost, tuned = hvdc_row(row)
        method = METHODS[name]
        state = hvdcompress.DDPHookState(
            method.compressor(),
            compress_min_numel=method.compress_min_numel,
            overlap=not row.endswith("-inline"),
            exchange=exchange,
            link_cost=link_cost,
            tuning=hvdcompress.Tuning() if tuned else None,
        ).register(ddp)
        return ddp, state
    return ddp, None


def run_row(args, model_name: str, row: str, data=None) -> dict:
    """One row's steps on this rank (``--recipe``'s model, SGD and batches: recipe.py;
    ``data``: recipe.load's); rank 0's is the row."""
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    method = hvdc_row(row)[0] if row.startswith("hvdc-") else None
    rec = recipe.build(args.recipe, model_name, method, rank, size, args.batch, args.width, data)
    model = rec.model
    ddp, state = hooked(row, model)
    opt = torch.optim.SGD(ddp.parameters(), lr=rec.lr, momentum=rec.momentum)
    parts = {"compress": 0.0, "wait": 0.0, "decode": 0.0}
    counted = {"payload": 0, "sent": 0}  # this rank's, from the transport's own counts
    taken = 0  # batches stepped on: the recipe's order goes on from warm-up to timed steps

    def step() -> float:
        nonlocal taken
        x, y = rec.batch(taken)
        taken += 1
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    tuner = state.exchange_tuner if state is not None else None
    tuning = []  # this rank's seconds of each step the tuner added
    while tuner is not None and (tuner.tuning_now or not tuner.decisions):
        if len(tuning) == TUNING_STEPS_MAX or not tuner.options:
            break
        tuning.append(step())
    tuning_steps = len(tuning)  # the same on every rank: the tuner's schedule is
    dist.barrier()
    link = _link_counter()
    start = link()
    began = time.perf_counter()
    times = []
    for _ in range(args.steps):
        times.append(step())
        if state is not None:
            s = state.last_stats
            parts["compress"] += s.compress_s
            parts["wait"] += s.wait_s
            parts["decode"] += s.decode_s
            counted["payload"] += s.payload_bytes
            counted["sent"] += s.sent_bytes
    dist.barrier()
    period = (time.perf_counter() - began) / args.steps  # barrier to barrier, this rank
    end = link()
    moved = None if start[0] < 0 else [b - a for a, b in zip(start, end, strict=True)]
    every = [None] * size
    dist.all_gather_object(every, (times, counted, moved, tuning))
    # shared link: rank 0's loopback carries every rank's sends; cluster: each node's
    # local rank 0 reads its node's link, (tx, rx)
    links = [m for _, _, m, _ in every if m is not None]
    tx = sum(m[0] for m in links)
    slowest = [max(ts) for ts in zip(*(e[0] for e in every), strict=True)]  # slowest rank's
    per_rank = {k: sum(e[1][k] for e in every) / size / args.steps / 1e3 for k in counted}
    return {
        "model": model_name,
        "row": row,
        "ranks": size,
        **rec.fields,  # the recipe, its data, seed, batch per rank, lr and momentum
        "step_s": statistics.median(slowest),
        "step_min_s": min(slowest),
        "step_max_s": max(slowest),
        # the timed steps' wall-clock from barrier to barrier over their number (rank 0's):
        # what a run of them takes, where the slowest rank's median counts every step at
        # its worst rank
        "period_s": period,
        "wire_mb": tx / args.steps / 1e6,
        # per node (cluster): MB its link sent and received per step
        "node_link_mb": [[t / args.steps / 1e6, r / args.steps / 1e6] for t, r in links]
        if os.environ.get(cluster.NODE_DEVICE_ENV)
        else None,
        "payload_kb_per_rank": per_rank["payload"],  # handed to the transport per step
        "sent_kb_per_rank": per_rank["sent"],  # sent per step, as the transport counted
        "parameters": sum(p.numel() for p in model.parameters()),
        "overlapping": bool(state is not None and state.overlapping),
        "bits_per_value": state.last_stats.bits_per_value if state is not None else None,
        # the compressed parts' exchanges ("dense": sent uncompressed by "auto")
        "exchanges": sorted(set(state.last_stats.exchanges.values())) if state else [],
        # exchange="auto" tuned: its decisions, and the warm-up steps its round added
        "decisions": [str(d) for d in tuner.decisions] if tuner else [],
        "tuning_steps": tuning_steps,
        # those steps' seconds: per step the slowest rank's, summed
        "tuning_s": sum((max(ts) for ts in zip(*(e[3] for e in every), strict=True)), 0.0),
        **{f"{k}_s": v / args.steps for k, v in parts.items()},
    }


def _link_counter():
    """The byte counter this rank reads around the timed steps: on the shared link rank
    0's loopback tx (every rank's sends); on an emulated cluster each node's local rank
    0 reads its node's link (tx, rx); the other ranks read nothing (-1)."""
    import torch.distributed as dist

    node_link = cluster.node_link_counter()
    if node_link is not None:
        return node_link
    if os.environ.get(cluster.NODE_DEVICE_ENV) is None and dist.get_rank() == 0:
        return lambda: (netns.read_tx_bytes(), 0)
    return lambda: (-1, -1)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    data = recipe.load(args.recipe)  # every row's batches, read once
    dist.init_process_group("gloo")
    for model_name in args.models:
        for row in args.rows:
            try:
                result = run_row(args, model_name, row, data)
            except Exception as err:  # a row that fails is reported, the rest go on
                result = {"model": model_name, "row": row, "error": f"{type(err).__name__}: {err}"}
            if dist.get_rank() == 0:
                print(MARK + json.dumps({**result, "rate": args.rate}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# =========================================================================================
# driver (the report, its targets and figure: scripts/_bench/peerreport.py)
# =========================================================================================
def worker_command(args, rate: str) -> list[str]:
    """This script's worker mode with the driver's flags (under torchrun)."""
    return [
        str(SCRIPT), "--worker", "--rate", rate, "--models", *args.models, "--rows", *args.rows,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
        "--width", str(args.width), "--recipe", args.recipe,
    ]  # fmt: skip


def launch(args, ns: str, rate: str) -> list[dict]:
    subprocess.run(["ip", "netns", "exec", ns, *netns.tc_rate_command(rate)], check=False)
    cmd = [
        "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={args.ranks}", *worker_command(args, rate),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    rows = [
        json.loads(line[len(MARK) :]) for line in done.stdout.splitlines() if line.startswith(MARK)
    ]
    if done.returncode != 0:
        print(f"bench_peers: the launch at {rate} ended with rc {done.returncode}:\n"
              f"{done.stderr[-2000:]}", file=sys.stderr)  # fmt: skip
    for r in rows:
        if "error" not in r:
            print(f"  {rate:>9} {r['model']:>7} {r['row']:>18}: {r['step_s']:.3f} s, "
                  f"{r['wire_mb']:.2f} MB/step", flush=True)  # fmt: skip
    return rows


def launch_cluster(args, c: cluster.Cluster, rate: str) -> list[dict]:
    """One torchrun per node namespace, every node's link at ``rate``; rank 0 (node 0)
    prints the rows."""
    cluster.set_node_link(c, rate)
    worker = worker_command(args, rate)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            cluster.torchrun_command(c, i, args.ranks_per_node, 29400, worker),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(c.nodes)
    ]
    outs = [p.communicate(timeout=args.timeout) for p in procs]
    rows = [
        {**json.loads(line[len(MARK) :]), "topology": f"{c.nodes}x{args.ranks_per_node}"}
        for line in outs[0][0].splitlines()
        if line.startswith(MARK)
    ]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            print(f"bench_peers: a node's launch at {rate} ended with rc {p.returncode}:\n"
                  f"{err[-2000:]}", file=sys.stderr)  # fmt: skip
    for r in rows:
        if "error" not in r:
            per_node = ", ".join(f"{t:.2f}/{x:.2f}" for t, x in r["node_link_mb"])
            print(f"  {rate:>9} {r['model']:>7} {r['row']:>18}: {r['step_s']:.3f} s, "
                  f"node links tx/rx MB/step {per_node}", flush=True)  # fmt: skip
    return rows


def repeated(args, one_launch, rate: str) -> list[dict]:
    """``--repeats`` launches at ``rate`` (each printing its rows), their rows combined
    (``combine_launches``: the median of the launches' median step times, their spread),
    and a summary line per row. With ``--launches`` the launches already recorded there
    count, each new one is recorded as it ends, and at most ``args.launch_budget`` new
    ones run (``--max-launches``, shared by the rates)."""
    config = launchlog.config_of(args)
    launches = launchlog.launches_of(launchlog.read(args.launches), config, rate) if (
        args.launches) else []  # fmt: skip
    for i in range(len(launches), args.repeats):
        if args.launch_budget <= 0:
            print(f"bench_peers: {rate}, launch {i + 1} of {args.repeats} left for the next "
                  "piece (--max-launches)", flush=True)  # fmt: skip
            break
        print(f"bench_peers: {rate}, launch {i + 1} of {args.repeats}", flush=True)
        launches.append(one_launch(rate))
        args.launch_budget -= 1
        if args.launches:
            launchlog.append(args.launches, config, rate, launches[-1])
    rows = combine_launches(launches)
    print(summary(rows), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate", default="unlimited", help=argparse.SUPPRESS)
    ap.add_argument(
        "--rates", nargs="+", type=netns.rate_arg, default=["100mbit", "1gbit", "unlimited"]
    )
    ap.add_argument("--models", nargs="+", choices=MODELS, default=["mlp10m", "cnn"])
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(DEFAULT_ROWS))
    ap.add_argument("--ranks", type=int, default=4, help="on the shared link")
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="2 or more: an emulated cluster, --rates per node's link",
    )
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument(
        "--recipe",
        choices=recipe.RECIPES,
        default="training",
        help="training: train.py's model, SGD and Fashion-MNIST batches (seed 1); random: "
        "one random batch per rank, SGD lr 0.01",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="launches per rate; rows: their median step time"
    )
    ap.add_argument(
        "--batch", type=int, default=None, help="per rank (default: 64 training, 32 random)"
    )
    ap.add_argument(
        "--width", type=int, default=16, help="the models' size knob (train.py's --width)"
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per rate")
    ap.add_argument("--launches", type=Path, help="finished launches (JSON lines): they "
                    "count toward --repeats; the table joins the pieces")  # fmt: skip
    ap.add_argument("--max-launches", type=int, help="new launches this run (a piece)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "peers")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats: expected an int >= 1, got {args.repeats}")
    if args.max_launches is not None and args.max_launches < 1:
        ap.error(f"--max-launches: expected an int >= 1, got {args.max_launches}")
    if args.max_launches is not None and args.launches is None:
        ap.error("--max-launches needs --launches (where the other pieces are recorded)")
    args.launch_budget = math.inf if args.max_launches is None else args.max_launches
    if args.batch is None:
        args.batch = recipe.default_batch(args.recipe)
    if args.worker:
        worker(args)
        return 0
    reason = netns.netns_available()
    if reason:
        print(f"bench_peers: {reason}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    if args.nodes >= 2:
        cluster.cleanup_stale(PREFIX, SCRIPT.name)
        c = cluster.Cluster(f"{PREFIX}{os.getpid()}-", args.nodes)
        args.ranks = args.nodes * args.ranks_per_node
        interrupted = cluster.in_cluster(
            c,
            lambda: [
                rows.extend(repeated(args, lambda r: launch_cluster(args, c, r), rate))
                for rate in args.rates
            ],
        )
    else:
        ns = f"{PREFIX}{os.getpid()}"

        def body() -> None:
            for rate in args.rates:
                rows.extend(repeated(args, lambda r: launch(args, ns, r), rate))

        interrupted = netns.in_namespace(ns, PREFIX, body)
    if args.launches:  # the table of every piece recorded with these settings
        rows = launchlog.combined(
            launchlog.read(args.launches), launchlog.config_of(args), args.repeats
        )
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    where = (f"an emulated cluster of {args.nodes} nodes x {args.ranks_per_node} ranks, "
             "each node's link at the rate" if args.nodes >= 2 else "one shared link")  # fmt: skip
    header = (f"bench_peers: {args.ranks} ranks on {where}, gloo, recipe {args.recipe}, "
              f"batch {args.batch} per rank, width {args.width}, "
              f"{args.steps} timed steps after {args.warmup}, {args.repeats} "
              f"launch{'es' if args.repeats > 1 else ''} per rate; "
              f"load average at the end {load[0]:.2f}; no latency emulated")  # fmt: skip
    if args.launches:
        header += f"; pieces recorded in {args.launches.name}"
    text = header + "\n\n" + table(rows)
    met = targets(rows)
    if met:
        text += "\n\nTargets:\n" + met
    bytes_check = twostage_bytes(rows, args.ranks)
    if bytes_check:
        text += "\n\nTwo-stage bytes (DDPHookState(exchange=...), 3lc):\n" + bytes_check
    (args.out / "bench_peers.md").write_text(text + "\n")
    (args.out / "bench_peers.json").write_text(
        json.dumps({"header": header, "rows": rows}, indent=1)
    )
    plot(rows, args.out / "bench_peers.png")
    print(text)
    return 1 if interrupted or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
