"""bench_network's worker mode (``--worker``): the training-step loop each rank runs
(under horovodrun / mpirun inside the namespace, or under torchrun on a node of the
emulated cluster), the cases and models it runs, and the names of the items (rate, model,
case, exchange) the driver hands it. What a case measures: scripts/bench_network.py's
docstring ("Per case")."""

from __future__ import annotations

import os
import statistics
import sys
import time

from hvdcompress.training.methods import METHODS

from . import cluster, launch, netns, steps

# the cases, in report order: methods of the one table (compressor, parameters, policy,
# compress_min_numel); policies take --accordion-interval / --cat-every and the calibration
CASES = {
    name: METHODS[name]
    for name in ("none", "fp16", "3lc", "3lc-1.75", "topk", "powersgd", "dqsg",
                 "accordion-3lc", "cat-topk", "3lc-min64k")
}  # fmt: skip
# what a Horovod user has instead (backend horovod only: horovodrun, launcher gloo): stock
# hvd.DistributedOptimizer with Horovod's own compression, allreduced
STOCK_CASES = {"horovod-none": "none", "horovod-fp16": "fp16"}
MODELS = ("light", "cnn", "vit", "mlp10m")  # of hvdcompress.training.models
CAT_CALIBRATION_SIZES = (1, 1 << 10, 1 << 14, 1 << 17, 1 << 20)
# the optimizer's figures per step, summed over the timed steps: key -> last_stats field
# (sent and received: as the transport counted them)
STEP_STATS = {"payload": "payload_bytes", "wire": "wire_bytes", "compress": "compress_s",
              "wait": "wait_s", "decode": "decode_s", "sent": "sent_bytes",
              "received": "received_bytes"}  # fmt: skip


# an item is one case of a launch: the driver names it, the worker parses it
def item_name(rate: str, model: str, case: str, exchange: str = "auto") -> str:
    return f"{rate}/{model}/{case}/{exchange}"


def parse_item(item: str) -> tuple[str, str, str, str]:
    rate, model, case, exchange = item.split("/")
    return rate, model, case, exchange


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
    """One case on every rank: its model and optimizer built, ``--warmup`` steps, then
    ``--steps`` timed steps (``_timed_steps``); the row of every rank's figures."""
    rank = transport.rank
    t_begin = time.perf_counter()
    if case not in CASES and case not in STOCK_CASES:
        raise ValueError(f"unknown case {case!r}")
    model, x, y = build_model(model_name, args.batch_size, rank)
    numel = sum(p.numel() for p in model.parameters())
    extra = {}
    if case in STOCK_CASES:
        return _stock_case(args, transport, case, model, x, y, numel, t_begin)
    method = CASES[case]
    policy = _case_policy(args, transport, method, cat_cost, extra)
    opt = steps.distributed_sgd(model, method.compressor(), transport, policy=policy,
                                compress_min_numel=method.compress_min_numel,
                                exchange=exchange, tuning=_tuning(args))  # fmt: skip

    t_built = time.perf_counter()
    extra["build_s"] = t_built - t_begin

    for _ in range(args.warmup):
        steps.train_step(model, opt, x, y)
    transport.allgather_object(None)  # barrier: every rank's warmup traffic is done
    extra["warmup_s"] = time.perf_counter() - t_built
    on_cluster = os.environ.get(cluster.NODE_DEVICE_ENV) is not None
    mine, elapsed, (tx0, tx1) = _timed_steps(args, transport, model, opt, x, y, on_cluster)
    tuner = opt.reducer.tuner
    if tuner is not None:  # what the tuner decided, and what its re-checks cost
        extra["tuner"] = {"rounds": tuner.rounds, "drift_rounds": tuner.drift_rounds,
                          "trial_steps": tuner.trial_steps,
                          "decisions": [str(d) for d in tuner.decisions]}  # fmt: skip
    metrics = opt.last_stats.metrics
    levels = [v for k, v in metrics.items() if k.startswith("level/")]
    budgets = [v for k, v in metrics.items() if k.startswith("T/")]
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
        **_timing(everyone, elapsed, tx1 - tx0, n, transport.size),
        "exchanges": sorted({label for r in everyone for label in r["exchanges"]}),
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


def _timing(everyone: list[dict], elapsed: float, moved: float, n: int, size: int) -> dict:
    """A row's step times and link bytes from every rank's figures (``_timed_steps``):
    ``moved`` bytes on the link over ``n`` timed steps of ``size`` ranks."""
    return {
        "step_s": max(r["median"] for r in everyone),  # the slowest rank decides
        "step_s_mean": elapsed / n,
        "step_s_per_rank": [r["median"] for r in everyone],
        # every timed step's time on its slowest rank: a tuner's moves show in it
        "step_s_series": [max(t) for t in zip(*(r["times"] for r in everyone), strict=True)],
        "measured_bytes_per_step": moved / n,
        "measured_bytes_per_rank": moved / n / size,
    }


def _tuning(args):
    """``exchange="auto"``'s tuner as --tuning-half / --tuning-drift set it (off: None)."""
    import hvdcompress

    half = None if args.tuning_half == "off" else args.tuning_half
    drift = None if args.tuning_drift == "off" else float(args.tuning_drift)
    return hvdcompress.Tuning(half=half, drift=drift)


def _stock_case(args, transport, case, model, x, y, numel: int, t_begin: float) -> dict:
    """A stock-Horovod case: ``hvd.DistributedOptimizer`` over the same SGD, with
    Horovod's ``Compression.none`` / ``fp16``, the same warm-up and timed steps; its row
    has no byte counts of the optimizer's own (the link's are measured as for any case)."""
    import horovod.torch as hvd
    import torch

    if args.backend != "horovod":
        raise ValueError(f"case {case!r} is stock Horovod: it needs --launchers gloo")
    compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        compression=compression[STOCK_CASES[case]],
    )  # fmt: skip
    t_built = time.perf_counter()
    for _ in range(args.warmup):
        steps.train_step(model, opt, x, y)
    transport.allgather_object(None)
    warmup_s = time.perf_counter() - t_built
    mine, elapsed, (tx0, tx1) = _timed_steps(
        args, transport, model, opt, x, y, on_cluster=False, counted=False
    )
    everyone = transport.allgather_object(mine)
    return {
        "params": numel, "compressor": f"horovod.Compression.{STOCK_CASES[case]}",
        "compressor_params": {}, "policy": None,
        **_timing(everyone, elapsed, tx1 - tx0, args.steps, transport.size),
        "exchanges": ["allreduce"],
        "sent_bytes_per_rank": 0.0, "received_bytes_per_rank": 0.0,
        "modelled_bytes_per_step": 0.0, "payload_bytes_per_rank": 0.0,
        "bits_per_value": 16.0 if STOCK_CASES[case] == "fp16" else 32.0,
        "raw_bytes": 4 * numel, "compress_s": 0.0, "wait_s": 0.0, "decode_s": 0.0,
        "build_s": t_built - t_begin, "warmup_s": warmup_s,
    }  # fmt: skip


def _case_policy(args, transport, method, cat_cost: dict, extra: dict):
    """The case's policy: Accordion every --accordion-interval steps; CAT recomputing every
    --cat-every steps with a cost model calibrated on ``transport`` once per link rate
    (kept in ``cat_cost``; its figures into ``extra``); None for the other cases."""
    import hvdcompress

    if method.policy == "accordion":
        return method.make_policy(interval_steps=args.accordion_interval)
    if method.policy != "cat":
        return None
    if "model" not in cat_cost:  # once per link rate (the caller empties it on a change)
        t0 = time.perf_counter()
        cat_cost["model"] = hvdcompress.calibrate(transport, sizes=CAT_CALIBRATION_SIZES, repeats=3)
        cat_cost["seconds"] = time.perf_counter() - t0
    cost = cat_cost["model"]
    extra["cat_cost"] = {"c0": cost.c0, "c1": cost.c1, "calibration_s": cat_cost["seconds"]}
    return method.make_policy(cost_model=cost, recompute_every=args.cat_every)


def _timed_steps(args, transport, model, opt, x, y, on_cluster: bool, counted: bool = True):
    """``--steps`` timed steps between barriers, the link counters read around them: (this
    rank's figures, the seconds they took, rank 0's loopback tx bytes before and after;
    0 on the cluster, where each node's local rank 0 reads its node's link).
    ``counted``: the optimizer is hvdcompress's, whose ``last_stats`` count its bytes
    (stock Horovod's counts none: its figures stay 0)."""
    rank = transport.rank
    node_link = cluster.node_link_counter()  # cluster: the node's local rank 0 reads its link
    tx0 = netns.read_tx_bytes() if rank == 0 and not on_cluster else 0
    link0 = node_link() if node_link is not None else None
    transport.allgather_object(None)  # nobody sends a timed byte before rank 0 has read
    times = []
    acc = dict.fromkeys(STEP_STATS, 0.0)
    exchanges: set[str] = set()  # the options the buckets took (the tuner's included)
    t_start = time.perf_counter()
    for _ in range(args.steps):
        times.append(steps.train_step(model, opt, x, y))
        if counted:
            for key, field in STEP_STATS.items():
                acc[key] += getattr(opt.last_stats, field)
            exchanges.update(opt.last_stats.exchanges.values())
    transport.allgather_object(None)  # barrier: every rank received everything
    elapsed = time.perf_counter() - t_start
    tx1 = netns.read_tx_bytes() if rank == 0 and not on_cluster else 0
    moved = None
    if node_link is not None:
        moved = [b - a for a, b in zip(link0, node_link(), strict=True)]
    mine = {
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "node_link": moved,  # (tx, rx) of its node's link: the node's local rank 0 only
        "median": statistics.median(times),
        "times": times,
        "exchanges": sorted(exchanges),
        **{k: v / args.steps for k, v in acc.items()},
    }
    return mine, elapsed, (tx0, tx1)


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
