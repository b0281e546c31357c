"""The time-to-accuracy report of scripts/bench_tta.py: per model, a table of final
accuracy and time to the target at each link rate (the block of
docs/benchmarks-time-to-accuracy.md), a plot of test accuracy against wall-clock (one
panel per rate), and the README's headline table (per model and rate, hvdcompress's
fastest row against the fastest peer), all from the results file and the peer
benchmark's step times alone (the arithmetic: scripts/_bench/tta.py; who is first, ties:
scripts/_bench/tta_verdict.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

try:
    from _bench import tta, tta_verdict
except ModuleNotFoundError:
    from scripts._bench import tta, tta_verdict

RATES, RATE_NAMES = tta.RATES, tta.RATE_NAMES


@dataclass(frozen=True)
class Matrix:
    """What the report's rows are: ``methods`` (in table order); ``step_row`` (method ->
    the bench_peers row whose step time it takes, having none of its own); ``declared``
    (method -> the exchange its accuracy runs used where they did not record it);
    ``pinned`` (a tuned method -> {exchange: the method that fixes that exchange});
    ``warm`` (model -> method -> its first steps sent dense, as DDP's allreduce);
    ``tuned`` (the tuned runs of ``tuned_table``)."""

    methods: tuple[str, ...]
    step_row: Mapping[str, str] = field(default_factory=dict)
    declared: Mapping[str, str] = field(default_factory=dict)
    pinned: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    warm: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    tuned: tuple[str, ...] = ()


# the generated blocks: every table (docs/benchmarks-time-to-accuracy.md), the headline
# (README.md)
TABLES_BLOCK = re.compile(r"(<!-- tta:begin -->\n).*?(<!-- tta:end -->)", re.S)
HEADLINE_BLOCK = re.compile(r"(<!-- tta:headline:begin -->\n).*?(<!-- tta:headline:end -->)", re.S)
BORROWED = "† the step time of the bench_peers row {rows} (no row of its own)."
# what a cell's mark says about the accuracy curve its step time was joined with
FOOTNOTES = {
    "‡": '‡ at this rate the method\'s tuner (`exchange="auto"`) sent every bucket '
    "uncompressed in bench_peers: that run trains as an allreduce after its tuning steps, "
    "so DDP allreduce's accuracy curve goes with its step time (torch's bf16 hook's where "
    "every bucket took the bf16 allreduce).",
    "≠": "≠ the timed run's exchange (bench_peers' `exchanges`) is not the one the accuracy "
    "runs used: the curve may not be that exchange's.",
    "?": '? the accuracy runs predate the record of their exchange: `exchange="auto"` in the '
    "simulated world, the allgather or the two-stage exchange, perhaps not the timed run's.",
    "§": "§ the tuner sent some buckets uncompressed, others compressed: the codec's accuracy "
    "curve is kept.",
}
OLD_TIMING = (
    "° timed before the training recipe and the period (bench_peers' random batch, one "
    "launch): the slowest rank's median step time, the range of its timed steps as the spread "
    "(a warm-up row: its dense steps at DDP's step so timed)."
)


def _accuracy_sets(records: dict, model: str, method: str, pinned: Mapping):
    """The method's own runs and its runs on each fixed exchange (``pinned``: method ->
    {exchange: the method that fixes it}), those with results."""
    own = tta.finished(records, model, method)
    on = {ex: tta.finished(records, model, m) for ex, m in pinned.get(method, {}).items()}
    return own, {ex: runs for ex, runs in on.items() if runs}


def _set(label: str, runs: list[dict], goal: float | None) -> dict:
    curve = tta.mean_curve(runs)
    return {
        "label": label, "final": tta.final_accuracy(runs), "curve": curve,
        "steps": None if goal is None else tta.steps_to(curve, goal),
        "bits": sum(r["bits_per_value"] for r in runs) / len(runs),
    }  # fmt: skip


def rows(
    records: dict, peers: dict, model: str, matrix: Matrix, margin: float = tta.MARGIN
) -> list[dict]:  # fmt: skip
    """One row per method with results: accuracy, steps to the target and seconds per rate.

    Per rate, the step time goes with the accuracy runs of what that timed run trained:
    where its tuner sent every bucket dense (``tta.sent_dense``), the baseline's curve, or
    torch's bf16 hook's where every bucket took the bf16 allreduce (``dense[rate]``: that
    run trains as such an allreduce); where it used one compressed
    exchange that the method has fixed-exchange runs of (``matrix.pinned``), those runs'
    curve (``on[rate]``); otherwise the method's own runs,
    with ``mark[rate]`` (``tta.exchange_mark``) saying whether they used the exchange that
    was timed (``matrix.declared``). ``sets``: the run sets
    the row uses, in the order of the first rate using each (label: the fixed exchange,
    "" for its own runs), each with final accuracy, curve, steps to the target and bits
    per value; ``final``, ``steps``, ``bits`` and ``curve`` are the first's.

    A time counts the timed row's tuning steps at their measured cost and a method's dense
    warm-up (``matrix.warm``, at DDP's step time on that link); ``span[rate]``: the time
    at the row's fastest and slowest launch (``tta.step_spread``). The target: the
    baseline's mean final accuracy - ``margin``."""
    goal = tta.target(records, model, margin=margin)
    peer = tta.peer_rows(peers)
    # a dense row's curve: DDP's, or the bf16 hook's (tta.dense_stand_in)
    stand_in = {
        m: tta.mean_curve(tta.finished(records, model, m))
        for m in (tta.BASELINE, tta.HALF_STAND_IN)
    }  # fmt: skip
    out = []
    for method in matrix.methods:
        own, on_exchange = _accuracy_sets(records, model, method, matrix.pinned)
        if not own and not on_exchange:
            continue
        row = matrix.step_row.get(method, method)
        own_exchanges = tta.run_exchanges(own, matrix.declared.get(method)) if own else None
        seconds, span, lead, step_s, curves = {}, {}, {}, {}, {}
        dense, partly, mark, on, old = {}, {}, {}, {}, {}
        warm = matrix.warm.get(model, {}).get(method)
        used: dict[str, list[dict]] = {}
        for rate in RATES:
            measured = peer.get((model, row, rate))
            base_curve = stand_in[tta.dense_stand_in(measured)]
            dense[rate] = tta.sent_dense(measured) and bool(base_curve)
            partly[rate] = tta.partly_dense(measured)
            exchange = tta.compressed_exchange(measured)
            on[rate] = exchange if exchange in on_exchange and not dense[rate] else None
            mark[rate] = ""
            if dense[rate]:
                curves[rate] = base_curve
            else:
                runs = on_exchange[on[rate]] if on[rate] else own
                if runs:
                    used.setdefault(on[rate] or "", runs)
                if not on[rate] and own and not partly[rate]:
                    mark[rate] = tta.exchange_mark(own_exchanges, measured)
                curves[rate] = tta.mean_curve(runs)
            rate_steps = None if goal is None else tta.steps_to(curves[rate], goal)
            step_s[rate] = None if measured is None else tta.step_time(measured)
            baseline = peer.get((model, tta.BASELINE, rate))
            lead[rate] = _lead(measured, baseline, warm)
            # a warm-up is priced at the baseline's step: its timing is the row's too
            old[rate] = measured is not None and not (
                tta.timed_on_training_job(measured)
                and (not warm or baseline is None or tta.timed_on_training_job(baseline))
            )
            seconds[rate], span[rate] = _timed(rate_steps, measured, lead[rate])
        if not used:  # every timed rate dense: the row still shows its accuracy
            used = {"": own} if own else dict([next(iter(on_exchange.items()))])
        sets = [_set(label, runs, goal) for label, runs in used.items()]
        out.append({
            "method": method, "sets": sets, "final": sets[0]["final"], "steps": sets[0]["steps"],
            "bits": sets[0]["bits"], "curve": sets[0]["curve"], "seconds": seconds, "span": span,
            "lead": lead,
            "has_time": {rate: (model, row, rate) in peer for rate in RATES},
            "has_runs": {rate: bool(curves[rate]) for rate in RATES},
            "borrowed": row != method, "dense": dense, "partly_dense": partly, "mark": mark,
            "on": on, "curves": curves, "step_s": step_s, "step_row": row,
            "timed_bits": {rate: (peer.get((model, row, rate)) or {}).get("bits_per_value")
                           for rate in RATES},
            "old_timing": old,
        })  # fmt: skip
    return out


def _lead(measured: dict | None, baseline: dict | None, warm_steps: int | None) -> tuple:
    """``tta.time_to``'s lead for the timed row ``measured``: its tuner's trial steps at
    their measured cost, then a dense warm-up of ``warm_steps`` at the baseline's step
    time on the link (none where either is unknown)."""
    tuning = tta.tuning_lead(measured) if measured is not None else ()
    if not warm_steps or baseline is None:
        return tuning
    return (*tuning, (warm_steps, tta.step_time(baseline)))


def _timed(steps: int | None, measured: dict | None, lead: tuple) -> tuple:
    """(seconds, (at the fastest launch, at the slowest)) to ``steps`` on the timed row
    ``measured``: ``lead`` first, then its median step time."""
    if measured is None:
        return None, (None, None)
    fast, slow, _ = tta.step_spread(measured)
    return (tta.time_to(steps, tta.step_time(measured), lead),
            (tta.time_to(steps, fast, lead), tta.time_to(steps, slow, lead)))  # fmt: skip


def _time_cell(r: dict, rate: str) -> tuple[str, str]:
    """A reached time with its spread and its marks (†: a borrowed step row; ‡, §, ≠, ?:
    what the step time was joined with, FOOTNOTES), "dense:" before a row its tuner sent
    all uncompressed; and the mark."""
    cell = ("dense: " if r["dense"][rate] else "") + tta_verdict.minutes(
        r["seconds"][rate], r["span"][rate]
    )
    cell += " †" if r["borrowed"] else ""
    cell += " °" if r["old_timing"][rate] else ""
    mark = "‡" if r["dense"][rate] else "§" if r["partly_dense"][rate] else ""
    mark = mark or r["mark"][rate]
    return cell + (f" {mark}" if mark else ""), mark


def markdown(records: dict, peers: dict, models, matrix: Matrix) -> str:
    lines, marks, labelled, old_timing = [], set(), False, False
    for model in models:
        table = rows(records, peers, model, matrix)
        if not table:
            continue
        goal = tta.target(records, model)
        head = "no DDP allreduce run yet" if goal is None else f"target {100 * goal:.2f}%"
        lines += [f"#### {model} ({head}: DDP allreduce's mean final accuracy - 0.3 points)", ""]
        rates = " | ".join(RATE_NAMES[r] for r in RATES)
        lines.append("| method | seeds | final accuracy % (mean ± std, min-max) | bits/value "
                     "trained | bits/value timed (per link) | steps to target | "
                     f"{rates} |")  # fmt: skip
        lines.append("|---" * (6 + len(RATES)) + "|")
        best = {rate: tta_verdict.best_hvdc(table, rate) for rate in RATES}
        for r in table:
            several = len(r["sets"]) > 1  # then each cell names the exchange of its runs
            labelled = labelled or any(one["label"] for one in r["sets"])
            cells = []
            for rate in RATES:
                s = r["seconds"][rate]
                if not r["has_time"][rate]:
                    cell = "no step time"
                elif not r["has_runs"][rate]:
                    cell = "no accuracy run"
                elif s is None:
                    cell = "not reached"
                else:
                    cell, mark = _time_cell(r, rate)
                    cell += f" [{r['on'][rate]}]" if several and r["on"][rate] else ""
                    marks.add(mark)
                    old_timing = old_timing or r["old_timing"][rate]
                cells.append(f"**{cell}**" if best[rate] == r["method"] and s else cell)
            seeds, accs, bits, steps = [], [], [], []
            for one in r["sets"]:
                f, on = one["final"], f" [{one['label']}]" if one["label"] else ""
                seeds.append(",".join(map(str, f["seeds"])) + on)
                accs.append(_accuracy_cell(f))
                bits.append(f"{one['bits']:.3f}")
                steps.append("-" if one["steps"] is None else str(one["steps"]))
            timed = " / ".join("-" if r["timed_bits"][rate] is None
                               else f"{r['timed_bits'][rate]:.2f}" for rate in RATES)  # fmt: skip
            lines.append(f"| {r['method']} | {'; '.join(seeds)} | {'; '.join(accs)} | "
                         f"{' / '.join(bits)} | {timed} | {' / '.join(steps)} | "
                         + " | ".join(cells) + " |")  # fmt: skip
        lines += ["", "hvdcompress's best compressed row (bold in the table) against the "
                  f"fastest peer (within {tta.TIE_BAND:.2f}x, or reversed by the spread: a tie):",
                  ""]  # fmt: skip
        lines += [f"- {RATE_NAMES[rate]}: {tta_verdict.verdict(table, rate)}" for rate in RATES]
        by_margin = {
            m: rows(records, peers, model, matrix, m)
            for m in tta.MARGINS
        }  # fmt: skip
        goals = {m: tta.target(records, model, margin=m) for m in tta.MARGINS}
        lines += ["", "The verdict at other targets (points below DDP's mean final accuracy):", ""]
        lines += [*tta_verdict.margin_table(by_margin, goals), ""]
    if any(matrix.step_row.values()):
        lines.append(_borrowed(matrix.step_row))
    if old_timing:
        lines += ["", OLD_TIMING]
    if labelled:
        lines += ["", "[exchange]: accuracy runs with the exchange fixed to the one the tuner "
                  "picked in the timed run (the simulated world cannot time a link)."]  # fmt: skip
    lines += [line for mark in FOOTNOTES if mark in marks for line in ("", FOOTNOTES[mark])]
    return "\n".join(lines) + "\n"


def _accuracy_cell(final: dict) -> str:
    """``tta.final_accuracy``'s figures in points: mean ± std (min-max)."""
    return (f"{100 * final['mean']:.2f} ± {100 * final['std']:.2f} "
            f"({100 * final['min']:.2f}-{100 * final['max']:.2f})")  # fmt: skip


def tuned_table(records: dict, models, tuned) -> list[str]:
    """The accuracy of the tuned runs (``tuned``: bench_tta's TUNED_METHODS): per model and
    method, the final accuracy over its seeds against DDP allreduce's mean, and the
    options its buckets took (``exchanges_used``: the trials' too), by seed (none: no run
    yet, no lines)."""
    lines = []
    for model in models:
        ddp = tta.final_accuracy(tta.finished(records, model, tta.BASELINE))
        for method in tuned:
            runs = tta.finished(records, model, method)
            if not runs or ddp is None:
                continue
            f = tta.final_accuracy(runs)
            kept = "; ".join(",".join(r.get("exchanges") or ["-"]) for r in runs)
            bits = sum(r["bits_per_value"] for r in runs) / len(runs)
            lines.append(
                f"| {model} | {method} | {','.join(map(str, f['seeds']))} | "
                f"{_accuracy_cell(f)} | {100 * ddp['mean']:.2f} | "
                f"{100 * (f['mean'] - ddp['mean']):+.2f} | {bits:.3f} | {kept} |"
            )  # fmt: skip
    if not lines:
        return []
    head = [
        "#### Tuned runs: hvdcompress's hook on 4 real ranks, the tuner choosing", "",
        "| model | method | seeds | final accuracy % (mean ± std, min-max) | DDP mean "
        "| difference | bits/value | options used (trials included; a job in pieces: its "
        "last), by seed |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    return [*head, *lines, ""]


def _borrowed(step_row: Mapping) -> str:
    return BORROWED.format(rows=", ".join(f"`{v}` for {k}" for k, v in step_row.items()))


def headline(records: dict, peers: dict, models, matrix: Matrix) -> str:
    """The README's table: per model and rate, hvdcompress's fastest compressed row to the
    target against the fastest peer (the same rows, times, spreads and marks as
    ``markdown``'s tables), the peer's time over hvdcompress's with its low and high end,
    and the verdict (``tta.judge``: a tie within the band or the spread); the first to the
    target in bold where it is not a tie."""
    lines = [
        "| model (target) | link | hvdcompress's fastest compressed | fastest peer (DDP, "
        "torch's hooks) | peer's time / hvdcompress's (low-high) | verdict |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    marks, borrowed, old_timing = set(), False, False
    for model in models:
        table = rows(records, peers, model, matrix)
        if not table:
            continue
        goal = tta.target(records, model)
        name = f"{model} ({'no DDP allreduce run' if goal is None else f'{100 * goal:.2f}%'})"
        for rate in RATES:
            ours, theirs, judged = tta_verdict.judge_rate(table, rate)
            cells = {}
            for side, r in (("ours", ours), ("theirs", theirs)):
                if r is None:
                    cells[side] = "not reached"
                    continue
                cell, mark = _time_cell(r, rate)
                cells[side] = f"{r['method']} {cell}"
                marks.add(mark)
                borrowed = borrowed or r["borrowed"]
                old_timing = old_timing or r["old_timing"][rate]
            if judged is None:  # one side alone (or neither) reached it
                winner = "ours" if ours else "theirs" if theirs else "tie"
                ratio, said = "-", {"ours": "hvdcompress alone", "theirs": "peer alone",
                                    "tie": "neither"}[winner]  # fmt: skip
            else:
                winner, ratio = judged["winner"], tta_verdict.ratio_text(judged)
                said = {"ours": "hvdcompress first", "theirs": "peer first", "tie": "tie"}[winner]
            if winner in cells:
                cells[winner] = f"**{cells[winner]}**"
            lines.append(f"| {name} | {RATE_NAMES[rate]} | {cells['ours']} | {cells['theirs']} "
                         f"| {ratio} | {said} |")  # fmt: skip
    lines += ["", f"Times: median over the bench's launches (fastest-slowest launch); a ratio "
              f"within {tta.TIE_BAND:.2f}x either way, or one the spread could reverse, is a "
              "tie. A row its tuner sent all uncompressed is no compression result and is "
              "left out."]  # fmt: skip
    if borrowed:
        lines += ["", _borrowed(matrix.step_row)]
    if old_timing:
        lines += ["", OLD_TIMING]
    lines += [line for mark in FOOTNOTES if mark in marks for line in ("", FOOTNOTES[mark])]
    return "\n".join(lines) + "\n"


def plot(records: dict, peers: dict, model: str, matrix: Matrix, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    table = rows(records, peers, model, matrix)
    if not any(s is not None for r in table for s in r["step_s"].values()):
        return False
    fig, axes = plt.subplots(1, len(RATES), figsize=(5 * len(RATES), 4), sharey=True)
    goal = tta.target(records, model)
    for ax, rate in zip(axes, RATES, strict=True):
        for r in table:
            step_s = r["step_s"][rate]
            if step_s is None or not r["has_runs"][rate]:
                continue
            curve = r["curves"][rate]
            xs = [tta.time_to(step, step_s, r["lead"][rate]) / 60 for step, _ in curve]
            style = "-" if r["method"].startswith("hvdc-") else "--"  # ours solid, peers dashed
            ax.plot(xs, [100 * acc for _, acc in curve], style, marker=".", label=r["method"])
        if goal is not None:
            ax.axhline(100 * goal, color="grey", linestyle="--", linewidth=0.8)
        ax.set(title=f"{model}, {RATE_NAMES[rate]}", xlabel="wall-clock (min)")
        ax.set_xscale("log")
        # plain minutes on the major ticks; the log scale's minor labels overlap them
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    axes[0].set_ylabel("test accuracy (%)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def rewrite_block(path: Path, block: re.Pattern, text: str) -> None:
    """Replace what lies between ``block``'s two markers in ``path`` with ``text``."""
    body = path.read_text()
    if not block.search(body):
        begin, end = re.findall(r"<!-- [a-z:]+ -->", block.pattern)
        raise SystemExit(f"{path} has no {begin} ... {end} block")
    path.write_text(block.sub(lambda m: m.group(1) + text + m.group(2), body))


def write_report(
    records: dict, peers: dict, out: Path, models, matrix: Matrix, readme: Path | None = None,
    page: Path | None = None,
) -> str:  # fmt: skip
    """Write results/time_to_accuracy.md and tta_<model>.png under ``out``, every table
    (``matrix.tuned``'s runs' too: ``tuned_table``) into ``page``'s tta block and the
    headline into ``readme``'s (each if given)."""
    text = markdown(records, peers, models, matrix)
    tuned_lines = tuned_table(records, models, matrix.tuned)
    if tuned_lines:
        text += "\n" + "\n".join(tuned_lines)
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "time_to_accuracy.md").write_text(text)
    for model in models:
        plot(records, peers, model, matrix, out / f"tta_{model}.png")
    if page is not None:
        rewrite_block(page, TABLES_BLOCK, text)
    if readme is not None:
        top = headline(records, peers, models, matrix)
        rewrite_block(readme, HEADLINE_BLOCK, top)
    return text
