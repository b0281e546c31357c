"""bench_network's report: the rows' speedups, its markdown tables (every case; bytes per
rank against the number of ranks), its figures (step time against link rate; bytes per
rank against ranks), its progress line per case, and the rows of cases an interruption
left unrun, in the order of the command line."""

from __future__ import annotations

from pathlib import Path

from . import netns, report
from .networker import STOCK_CASES


def label(r: dict) -> str:
    """A row's case, with its exchange when that is a choice (gather-only cases)."""
    exchange = r.get("exchange", "auto")
    return r["case"] if exchange in ("auto", "allreduce") else f"{r['case']} ({exchange})"


def log_line(row: dict) -> str:
    """One case's progress line."""
    if row.get("status") == "ok":
        what = (
            f"{row['step_s']:.3f} s/step, {row['measured_bytes_per_step'] / 1e6:.2f} MB/step "
            f"measured, {row['modelled_bytes_per_step'] / 1e6:.2f} modelled "
            f"({row.get('case_wall_s', 0):.1f} s)"
        )
        if row.get("node_link_bytes_per_step"):
            what += ", node links tx/rx MB/step " + node_links(row)
    else:
        what = f"FAILED: {row.get('reason')}"
    return (
        f"{row['launcher']:<4} {row['ranks']} ranks {row['rate']:>9} {row['model']:<5} "
        f"{label(row):<24} {what}"
    )


def node_links(row: dict) -> str:
    """An emulated cluster's row: each node's link, MB sent / received per step."""
    return " ".join(f"{tx / 1e6:.2f}/{rx / 1e6:.2f}" for tx, rx in row["node_link_bytes_per_step"])


def add_not_run(rows: list, args, items: list, parse_item, interrupted: str) -> None:
    """A failed row for every (launcher, ranks, item) an interruption left unrun."""
    seen = {
        (r["launcher"], r["ranks"], r["rate"], r["model"], r["case"], r["exchange"]) for r in rows
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


def sort_rows(rows: list, args) -> None:
    """In the order of the command line's launchers, ranks, rates, models, cases and
    exchanges (allreduce first)."""
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


def add_speedups(rows: list) -> None:
    """Speedups over none and fp16 (allreduced; and over stock Horovod's none and fp16 where
    the run has them), and of a twostage row over the same case
    on the allgather; for twostage rows also ``sent_vs_model``: the bytes sent per rank
    over 2 (N - 1) / N x the allgather row's payload per rank."""
    groups: dict = {}
    for r in rows:
        key = (r["launcher"], r["ranks"], r["rate"], r["model"])
        groups.setdefault(key, {})[(r["case"], r.get("exchange", "auto"))] = r
    for r in rows:
        g = groups[(r["launcher"], r["ranks"], r["rate"], r["model"])]
        ok = r.get("status") == "ok"
        for base in ("none", "fp16", *STOCK_CASES):
            b = g.get((base, "allreduce")) or g.get((base, "auto"))
            fine = ok and b is not None and b.get("status") == "ok"
            r[f"speedup_vs_{base.replace('-', '_')}"] = b["step_s"] / r["step_s"] if fine else None
        ag = g.get((r["case"], "allgather"))
        fine = ok and r.get("exchange") == "twostage" and ag is not None and ag["status"] == "ok"
        r["speedup_vs_allgather"] = ag["step_s"] / r["step_s"] if fine else None
        n = r["ranks"]
        model = 2.0 * (n - 1) / n * ag["payload_bytes_per_rank"] if fine else None
        r["sent_vs_model"] = r["sent_bytes_per_rank"] / model if model else None


def markdown(rows: list, meta: dict) -> str:
    head = ["launcher", "ranks", "rate", "model", "case", "exchange", "step s (median)",
            "wire MB/step measured", "modelled", "meas/model", "kB/rank/step measured",
            "sent kB/rank (transport)", "bits/value", "speedup vs none", "vs fp16",
            "vs allgather", "status"]  # fmt: skip
    stock = any(r["case"] in STOCK_CASES for r in rows)
    if stock:  # the speedups over stock Horovod's DistributedOptimizer
        head[-1:-1] = ["vs hvd none", "vs hvd fp16"]
    on_cluster = meta.get("cluster")
    if on_cluster:
        head.insert(8, "node links tx/rx MB/step")
        link = (
            f"Link: an emulated cluster of {on_cluster['nodes']} nodes x "
            f"{on_cluster['ranks_per_node']} ranks (namespaces {meta['namespace']}*, one "
            f"torchrun per node, torch.distributed over gloo), each node's link limited "
            f"with tc tbf in both directions, the ranks of a node on its loopback; "
            f"{meta['latency']}. Measured bytes: the bytes that crossed the node links "
            "per step (the sum of each node's link tx, TCP/IP headers included; traffic "
            "inside a node is not counted); node links: each node's tx/rx per step"
        )
    else:
        link = (
            f"Link: the loopback of network namespace {meta['namespace']} limited with tc "
            f"tbf; {meta['latency']}. All ranks share the one link. Measured bytes: "
            "loopback tx bytes of the namespace per step (every rank's sends, TCP/IP "
            "headers included)"
        )
    lines = [
        f"# Network benchmark ({meta['date']})",
        "",
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up steps, batch "
        f"{meta['batch_size']} per rank, 1 torch thread per rank, on {meta['host']}. "
        f"{link}; modelled: the sum over ranks of DistributedOptimizer.last_stats.wire_bytes "
        "(ring model).",
        "",
    ]
    cells = []
    for r in rows:
        ok = r.get("status") == "ok"
        meas = r.get("measured_bytes_per_step") if ok else None
        model = r.get("modelled_bytes_per_step") if ok else None
        ratio = meas / model if ok and model else None
        status = "ok" if ok else "FAILED: " + str(r.get("reason", "")).replace("|", "/")
        row = [
            r["launcher"], str(r["ranks"]), r["rate"], r["model"], r["case"],
            r.get("exchange", "auto"),
            report.fmt(r.get("step_s") if ok else None, ".3f"),
            report.fmt(None if meas is None else meas / 1e6, ".2f"),
            report.fmt(None if model is None else model / 1e6, ".2f"),
            report.fmt(ratio, ".2f"),
            report.fmt(r.get("measured_bytes_per_rank") / 1e3 if ok else None, ".1f"),
            report.fmt(r.get("sent_bytes_per_rank") / 1e3 if ok else None, ".1f"),
            report.fmt(r.get("bits_per_value") if ok else None, ".2f"),
            report.fmt(r.get("speedup_vs_none"), ".2f"),
            report.fmt(r.get("speedup_vs_fp16"), ".2f"),
            report.fmt(r.get("speedup_vs_allgather"), ".2f"),
            status,
        ]  # fmt: skip
        if stock:
            row[-1:-1] = [report.fmt(r.get("speedup_vs_horovod_none"), ".2f"),
                          report.fmt(r.get("speedup_vs_horovod_fp16"), ".2f")]  # fmt: skip
        if on_cluster:
            row.insert(8, node_links(r) if ok and r.get("node_link_bytes_per_step") else "-")
        cells.append(row)
    lines += report.md_table(head, cells)
    exchanges = {r.get("exchange") for r in rows} - {"allreduce"}
    if len({r["ranks"] for r in rows}) > 1 or len(exchanges) > 1:
        lines += ["", *bytes_table(rows)]
    return "\n".join(lines) + "\n"


def bytes_table(rows: list) -> list[str]:
    """Bytes per rank per step against the number of ranks: kB measured on the loopback
    / N, and (transport-counted) sent kB; for twostage rows / 2 (N - 1) / N x payload."""
    ranks = sorted({r["ranks"] for r in rows})
    keys = list(dict.fromkeys((r["launcher"], r["rate"], r["model"], label(r)) for r in rows))
    lines = [
        "Bytes per rank per step: measured kB / N (on the shared link's loopback, or across "
        "a cluster's node links); transport-counted sent kB; for "
        "twostage, sent / (2 (N - 1) / N x the allgather payload per rank).",
        "",
    ]
    table = []
    for key in keys:
        cells = []
        for n in ranks:
            r = next(
                (r for r in rows
                 if (r["launcher"], r["rate"], r["model"], label(r)) == key and r["ranks"] == n),
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
        table.append([*key, *cells])
    head = ["launcher", "rate", "model", "case", *(f"N={n}" for n in ranks)]
    return lines + report.md_table(head, table)


def plot_bytes(rows: list, path: Path) -> str | None:
    """Bytes sent per rank per step (transport-counted) against the number of ranks, one
    line per (launcher, rate, model, case and exchange); only with several rank counts."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ranks = sorted({r["ranks"] for r in ok})
    if len(ranks) < 2:
        return None
    try:
        plt = report.pyplot()
    except ImportError as err:
        return f"no bytes PNG ({err})"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    keys = list(dict.fromkeys((r["launcher"], r["rate"], r["model"], label(r)) for r in ok))
    for key in keys:
        pts = sorted(
            (r["ranks"], r["sent_bytes_per_rank"] / 1e3)
            for r in ok
            if (r["launcher"], r["rate"], r["model"], label(r)) == key
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=" ".join(key))
    ax.set_xticks(ranks)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("kB sent per rank per step (transport-counted)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Bytes per rank vs ranks: allgather (N - 1) x P, two-stage ~2 (N - 1) / N x P")
    report.save_figure(fig, path)
    return None


def plot(rows: list, path: Path, models: tuple, launchers: tuple) -> str | None:
    """Step time against link rate, log-log: one panel per model x ranks (rows: models,
    columns: ranks, ``models`` in that order), one colour per case, one line style per
    launcher (of ``launchers``)."""
    try:
        plt = report.pyplot()
        from matplotlib.lines import Line2D
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError as err:
        return f"no PNG ({err})"
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return "no PNG (no successful case)"
    models = [m for m in models if any(r["model"] == m for r in rows)]
    all_ranks = sorted({r["ranks"] for r in rows})
    finite = [netns.rate_bits(r["rate"]) for r in rows if netns.rate_bits(r["rate"]) is not None]
    unlimited_x = 10 * max(finite) / 1e9 if finite else 100.0

    def x_of(rate):
        b = netns.rate_bits(rate)
        return unlimited_x if b is None else b / 1e9

    cases = list(dict.fromkeys(label(r) for r in rows))
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(cases)}
    styles = {"gloo": "-", "mpi": "--"}
    launchers = [la for la in launchers if any(r["launcher"] == la for r in rows)]
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
                        if (r["model"], r["ranks"], label(r), r["launcher"]) == key
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
    report.save_figure(fig, path, rect=(0, 0, 1 - 1.9 / fig.get_figwidth(), 1))
    return None
