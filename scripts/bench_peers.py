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

Per (model, row): a fresh DDP model (the same seed on every rank, its own random batch
per rank), ``--warmup`` steps (error feedback and PowerSGD's warm start build up; torch
PowerSGD starts compressing at step 2; an ``hvdc-`` row with ``exchange="auto"`` goes on
until its tuner's first round has decided, at most 60 steps more: the steady state a
user gets, its decisions in the JSON), a barrier, then ``--steps`` timed steps. A step
is forward, backward (the hook's collectives and DDP's wait for their futures) and
SGD's step; its time is the slowest rank's. Reported: median step time and the spread
(min-max) over the timed steps, bytes on the wire per step (MEASURED: the namespace's
loopback tx bytes, every rank's sends with TCP/IP headers), the speedup over ``ddp`` on
the same link and, for hvdcompress's rows, where a rank's step time goes (encode,
waiting on collectives, decode: ``DDPHookState.last_stats``, summed over its buckets).

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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

try:  # python scripts/bench_peers.py: scripts/ is first on sys.path
    from _bench import cluster, netns
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench import cluster, netns

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[1]
PREFIX = "hvdc-peers-"
MARK = "HVDC_PEERS "
MODELS = ("mlp10m", "cnn", "vit")
HVDC_METHODS = ("none", "fp16", "3lc", "3lc-1.75", "powersgd", "powersgd-r2", "topk")
ROWS = (
    "ddp", "torch-fp16", "torch-bf16", "torch-powersgd-r1", "torch-powersgd-r2",
    "torch-powersgd-r4", *(f"hvdc-{m}" for m in HVDC_METHODS), "hvdc-none-inline",
    "hvdc-3lc-inline", "hvdc-3lc-measured", "hvdc-3lc-guess", "hvdc-3lc-allgather",
    "hvdc-3lc-twostage",
    "hvdc-3lc-hierarchical", "hvdc-powersgd-r2-hierarchical",
)  # fmt: skip
DEFAULT_ROWS = ROWS[:-4]  # the exchange rows are for the bytes check (--rows)
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
def build_model(name: str, rank: int, batch: int):
    import torch

    from hvdcompress.training.models import INPUT_SHAPES
    from hvdcompress.training.models import build_model as training_model

    torch.manual_seed(0)  # the same parameters on every rank
    model = training_model(name, 16)  # train.py's models at its default width
    g = torch.Generator().manual_seed(1000 + rank)
    return (
        model,
        torch.randn(batch, *INPUT_SHAPES[name], generator=g),
        torch.randint(0, 10, (batch,), generator=g),
    )


def hooked(row: str, model):
    """DDP of ``model`` with ``row``'s hook; (ddp model, hvdcompress hook state or None)."""
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdcompress
    from hvdcompress.training.methods import METHODS
    from hvdcompress.training.torch_hooks import POWERSGD_BUCKET_CAP_MB, bf16_hook

    if row.startswith("torch-powersgd-r"):
        ddp = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_CAP_MB)  # one bucket: train.py's
        rank = int(row.rsplit("r", 1)[1])
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return ddp, None
    ddp = DDP(model)
    if row == "torch-fp16":
        ddp.register_comm_hook(None, default.fp16_compress_hook)
    elif row == "torch-bf16":
        # torch's bf16 hook under another name: DDP refuses the name without CUDA + NCCL,
        # though gloo sums bfloat16 on the CPU (hvdcompress.training.torch_hooks)
        ddp.register_comm_hook(None, bf16_hook)
    elif row.startswith("hvdc-"):
        name = row[len("hvdc-") :].removesuffix("-inline")
        exchange, link_cost, tuned = "auto", None, True
        for suffix, (mode, cost, tune) in EXCHANGE_SUFFIXES.items():
            if name.endswith(suffix):
                name, exchange, link_cost, tuned = name.removesuffix(suffix), mode, cost, tune
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


def run_row(args, model_name: str, row: str) -> dict:
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    model, x, y = build_model(model_name, rank, args.batch)
    ddp, state = hooked(row, model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    parts = {"compress": 0.0, "wait": 0.0, "decode": 0.0}
    counted = {"payload": 0, "sent": 0}  # this rank's, from the transport's own counts

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    tuner = state.exchange_tuner if state is not None else None
    tuning_steps = 0  # the same on every rank: the tuner's schedule is
    while tuner is not None and (tuner.tuning_now or not tuner.decisions):
        if tuning_steps == TUNING_STEPS_MAX or not tuner.options:
            break
        step()
        tuning_steps += 1
    dist.barrier()
    link = _link_counter()
    start = link()
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
    end = link()
    moved = None if start[0] < 0 else [b - a for a, b in zip(start, end, strict=True)]
    every = [None] * size
    dist.all_gather_object(every, (times, counted, moved))
    # shared link: rank 0's loopback carries every rank's sends; cluster: each node's
    # local rank 0 reads its node's link, (tx, rx)
    links = [m for _, _, m in every if m is not None]
    tx = sum(m[0] for m in links)
    slowest = [max(ts) for ts in zip(*(t for t, _, _ in every), strict=True)]  # slowest rank's
    per_rank = {k: sum(c[k] for _, c, _ in every) / size / args.steps / 1e3 for k in counted}
    return {
        "model": model_name,
        "row": row,
        "ranks": size,
        "step_s": statistics.median(slowest),
        "step_min_s": min(slowest),
        "step_max_s": max(slowest),
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
    dist.init_process_group("gloo")
    for model_name in args.models:
        for row in args.rows:
            try:
                result = run_row(args, model_name, row)
            except Exception as err:  # a row that fails is reported, the rest go on
                result = {"model": model_name, "row": row, "error": f"{type(err).__name__}: {err}"}
            if dist.get_rank() == 0:
                print(MARK + json.dumps({**result, "rate": args.rate}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


# =========================================================================================
# driver
# =========================================================================================
def launch(args, ns: str, rate: str) -> list[dict]:
    subprocess.run(["ip", "netns", "exec", ns, *netns.tc_rate_command(rate)], check=False)
    cmd = [
        "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
        "--standalone", f"--nproc_per_node={args.ranks}", str(SCRIPT), "--worker",
        "--rate", rate, "--models", *args.models, "--rows", *args.rows,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
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
    worker = [
        str(SCRIPT), "--worker", "--rate", rate, "--models", *args.models, "--rows", *args.rows,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
    ]  # fmt: skip
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


def table(rows: list[dict]) -> str:
    lines = [
        "| model | row | rate | step s (median, min-max) | speedup over ddp "
        "| MB on the wire per step | bits/value | encode / wait / decode s per step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["model"], r["rate"]): r["step_s"]
        for r in rows
        if r.get("row") == "ddp" and "step_s" in r
    }
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['row']} | {r['rate']} | failed: {r['error'][:80]} | | | | |"
            )
            continue
        ref = base.get((r["model"], r["rate"]))
        speedup = f"{ref / r['step_s']:.2f}x" if ref else ""
        bits = f"{r['bits_per_value']:.3f}" if r["bits_per_value"] is not None else ""
        split = (f"{r['compress_s']:.3f} / {r['wait_s']:.3f} / {r['decode_s']:.3f}"
                 if r["row"].startswith("hvdc") else "")  # fmt: skip
        wire = f"{r['wire_mb']:.2f}"
        if r.get("node_link_mb"):  # cluster: the busiest node link's tx / rx
            tx, rx = (max(m[k] for m in r["node_link_mb"]) for k in (0, 1))
            wire += f" (node link {tx:.2f} / {rx:.2f})"
        lines.append(
            f"| {r['model']} | {r['row']} | {r['rate']} | {r['step_s']:.3f} "
            f"({r['step_min_s']:.3f}-{r['step_max_s']:.3f}) | {speedup} | {wire} | "
            f"{bits} | {split} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """The link-speed targets (docs/benchmarks.md), MET / MISS per model and rate, for
    the rows this run has: ``hvdc-3lc`` (auto) at least 0.97x the speed of the fastest of
    DDP's allreduce and the fixed exchanges; ``hvdc-none`` at least 0.97x DDP; at 100 Mbit/s
    and 1 Gbit/s the fastest hvdcompress codec row at least as fast as torch's PowerSGD
    at rank 2; the 3LC step on the CNN at 100 Mbit/s waiting at most 1.3x the line-rate
    time of the bytes it put on the link."""
    got = {(r["model"], r["rate"], r["row"]): r for r in rows if "error" not in r}
    lines = []

    def check(what: str, ratio: float, bound: float, above: bool = True) -> None:
        ok = ratio >= bound if above else ratio <= bound
        sign = ">=" if above else "<="
        lines.append(f"- {what}: {ratio:.2f} (target {sign} {bound}) {'MET' if ok else 'MISS'}")

    for model, rate in dict.fromkeys((m, r) for m, r, _ in got):
        step = {row: r["step_s"] for (m, rt, row), r in got.items() if (m, rt) == (model, rate)}
        where = f"{model} at {rate}"
        fixed = [row for row in ("ddp", "hvdc-3lc-allgather", "hvdc-3lc-twostage") if row in step]
        if "hvdc-3lc" in step and fixed:
            fastest = min(fixed, key=step.get)
            check(
                f"{where}: hvdc-3lc (auto) speed / {fastest}'s",
                step[fastest] / step["hvdc-3lc"],
                0.97,
            )
        if "hvdc-none" in step and "ddp" in step:
            check(f"{where}: hvdc-none speed / ddp's", step["ddp"] / step["hvdc-none"], 0.97)
        codecs = [row for row in step if row.startswith("hvdc-") and row not in
                  ("hvdc-none", "hvdc-fp16") and not row.endswith("-inline")]  # fmt: skip
        if rate in ("100mbit", "1gbit") and codecs and "torch-powersgd-r2" in step:
            best = min(codecs, key=step.get)
            check(f"{where}: {best} (fastest hvdc codec) speed / torch-powersgd-r2's",
                  step["torch-powersgd-r2"] / step[best], 1.0)  # fmt: skip
        bits = netns.rate_bits(rate)
        r3 = got.get((model, rate, "hvdc-3lc"))
        if model == "cnn" and rate == "100mbit" and r3 is not None and bits:
            line_s = r3["wire_mb"] * 8e6 / bits
            check(f"{where}: hvdc-3lc wait / line-rate time of its bytes "
                  f"({r3['wait_s']:.3f} / {line_s:.3f} s)", r3["wait_s"] / line_s, 1.3,
                  above=False)  # fmt: skip
    return "\n".join(lines)


def twostage_bytes(rows: list[dict], ranks: int) -> str:
    """The two-stage hook's bytes against its model: per rank 2 (N - 1) / N x P, P the
    payload a rank hands the allgather (the ``-allgather`` row's, on the same model and
    link); target within 15%."""
    lines = []
    got = {(r["model"], r["rate"], r["row"]): r for r in rows if "sent_kb_per_rank" in r}
    for (model, rate, row), r in got.items():
        gather = got.get((model, rate, "hvdc-3lc-allgather"))
        if row != "hvdc-3lc-twostage" or gather is None:
            continue
        model_kb = 2 * (ranks - 1) / ranks * gather["payload_kb_per_rank"]
        ratio = r["sent_kb_per_rank"] / model_kb if model_kb else float("nan")
        verdict = "MET " if abs(ratio - 1) <= 0.15 else "MISS"
        lines.append(
            f"  {verdict} {model} {rate}, {ranks} ranks: two-stage sends "
            f"{r['sent_kb_per_rank']:.1f} kB per rank per step, 2 (N - 1) / N x payload "
            f"{gather['payload_kb_per_rank']:.1f} kB = {model_kb:.1f} kB: {ratio:.2f}x "
            f"(target within 15%); the allgather sends {gather['sent_kb_per_rank']:.1f} kB"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Median step time against the link rate, one panel per model, a line per row
    (``unlimited`` drawn at 100 Gbit/s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "step_s" in r]
    models = sorted({r["model"] for r in ok})
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for row in dict.fromkeys(r["row"] for r in ok if r["model"] == model):
            points = sorted(
                (netns.rate_bits(r["rate"]) or 1e11, r["step_s"])
                for r in ok
                if r["model"] == model and r["row"] == row
            )
            style = "-" if row.startswith("hvdc") else "--"
            ax.plot(*zip(*points, strict=True), style, marker="o", label=row)
        ax.set(xscale="log", yscale="log", xlabel="link rate, bit/s (unlimited at 1e11)",
               ylabel="step s (median)", title=model)  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per rate")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "peers")
    args = ap.parse_args(argv)
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
            c, lambda: [rows.extend(launch_cluster(args, c, rate)) for rate in args.rates]
        )
    else:
        ns = f"{PREFIX}{os.getpid()}"

        def body() -> None:
            for rate in args.rates:
                rows.extend(launch(args, ns, rate))

        interrupted = netns.in_namespace(ns, PREFIX, body)
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    where = (f"an emulated cluster of {args.nodes} nodes x {args.ranks_per_node} ranks, "
             "each node's link at the rate" if args.nodes >= 2 else "one shared link")  # fmt: skip
    header = (f"bench_peers: {args.ranks} ranks on {where}, gloo, batch {args.batch} per rank, "
              f"{args.steps} timed steps after {args.warmup}; load average at the end "
              f"{load[0]:.2f}; no latency emulated")  # fmt: skip
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
