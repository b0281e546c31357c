"""bench_peers' report: its launches' rows combined into one per (model, row, rate)
(``combine_launches``: the median of the launches' median step times and their spread)
with a summary line each, the markdown table of the rows (step time, speedup over
``ddp``, bytes on the wire, bits per value, where an hvdcompress step's time goes), the
link-speed targets (MET / MISS), the two-stage exchange's bytes against its model, and
the figure (step time against link rate)."""

from __future__ import annotations

import statistics
from pathlib import Path

from . import netns


def combine_launches(launches: list[list[dict]]) -> list[dict]:
    """One row per (model, row, rate, topology) of the rows of ``launches`` (a list per
    launch, in launch order), in the order they first appear. Of the launches where the
    row worked (no ``error``): ``step_runs_s`` their median step times in launch order,
    ``step_s`` the median of those, ``step_lo_s`` / ``step_hi_s`` their min and max; the
    other fields from the launch whose median is the middle one (for an even number, the
    lower middle); ``period_runs_s`` and their median ``period_s``, where the launches
    timed the period (wall-clock per step). ``repeats``: the launches; ``failed_runs``:
    those where the row failed or is missing (a launch that died). A row that worked in
    no launch is its last error row with the same two counts."""
    runs: dict[tuple, list[dict]] = {}
    for rows in launches:
        for r in rows:
            key = (r["model"], r["row"], r.get("rate"), r.get("topology"))
            runs.setdefault(key, []).append(r)
    out = []
    for got in runs.values():
        ok = [r for r in got if "error" not in r]
        counts = {"repeats": len(launches), "failed_runs": len(launches) - len(ok)}
        if not ok:
            out.append({**got[-1], **counts})
            continue
        middle = sorted(ok, key=lambda r: r["step_s"])[(len(ok) - 1) // 2]
        times = [r["step_s"] for r in ok]
        periods = {"period_runs_s": [r["period_s"] for r in ok]} if "period_s" in middle else {}
        if periods:
            periods["period_s"] = statistics.median(periods["period_runs_s"])
        out.append({
            **middle, "step_runs_s": times, "step_s": statistics.median(times),
            "step_lo_s": min(times), "step_hi_s": max(times), **periods, **counts,
        })  # fmt: skip
    return out


def summary(rows: list[dict]) -> str:
    """A line per combined row: the median step time over its launches and their spread."""
    lines = []
    for r in rows:
        where = f"  {r.get('rate', ''):>9} {r['model']:>7} {r['row']:>18}"
        failed = f", {r['failed_runs']} failed" if r.get("failed_runs") else ""
        if "error" in r:
            lines.append(f"{where}: failed in all {r['repeats']} launches: {r['error'][:80]}")
            continue
        lo, hi, mid, n = r["step_lo_s"], r["step_hi_s"], r["step_s"], len(r["step_runs_s"])
        lines.append(
            f"{where}: median {mid:.3f} s of {n} launch{'es' if n > 1 else ''} "
            f"({lo:.3f}-{hi:.3f}, spread {100 * (hi - lo) / mid:.0f}%){failed}"
        )
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | row | rate | step s (median of launches, lo-hi) | period s (lo-hi) "
        "| speedup over ddp | MB on the wire per step | bits/value "
        "| encode / wait / decode s per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["model"], r["rate"]): r["step_s"]
        for r in rows
        if r.get("row") == "ddp" and "step_s" in r
    }
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['row']} | {r['rate']} | failed: {r['error'][:80]} | | | | | |"
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
        # the launches' spread (a row from before --repeats: its timed steps' min-max)
        lo, hi = r.get("step_lo_s", r["step_min_s"]), r.get("step_hi_s", r["step_max_s"])
        failed = f", {r['failed_runs']} failed" if r.get("failed_runs") else ""
        runs = r.get("period_runs_s")  # wall-clock per timed step, by launch
        period = f"{r['period_s']:.3f} ({min(runs):.3f}-{max(runs):.3f})" if runs else ""
        lines.append(
            f"| {r['model']} | {r['row']} | {r['rate']} | {r['step_s']:.3f} "
            f"({lo:.3f}-{hi:.3f}{failed}) | {period} | {speedup} | {wire} | {bits} | {split} |"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> str:
    """The link-speed targets (docs/benchmarks-peers.md), MET / MISS per model and rate, for
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
