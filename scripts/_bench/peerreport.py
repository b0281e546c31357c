"""bench_peers' report: the markdown table of its rows (step time, speedup over ``ddp``,
bytes on the wire, bits per value, where an hvdcompress step's time goes), the link-speed
targets (MET / MISS), the two-stage exchange's bytes against its model, and the figure
(step time against link rate)."""

from __future__ import annotations

from pathlib import Path

from . import netns


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
