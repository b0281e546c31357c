"""Who reaches the target first in the time-to-accuracy report (scripts/_bench/
tta_report.py): hvdcompress's fastest compressed row against the fastest peer per rate,
judged with the tie band and the spread (``tta.judge``), as a verdict line and as the
margin table's cells."""

from __future__ import annotations

try:
    from _bench import tta
except ModuleNotFoundError:
    from scripts._bench import tta


def fastest(table: list[dict], rate: str, ours: bool) -> dict | None:
    """The row that reaches the target first at ``rate`` among hvdcompress's rows that
    compressed (``ours``; a row its tuner sent all dense is an allreduce, not a compression
    result) or among the peers (DDP, torch's hooks); None if none reaches it."""
    timed = [
        r for r in table
        if r["method"].startswith("hvdc-") == ours and r["seconds"][rate]
        and not (ours and r["dense"][rate])
    ]  # fmt: skip
    return min(timed, key=lambda r: r["seconds"][rate]) if timed else None


def best_hvdc(table: list[dict], rate: str) -> str | None:
    best = fastest(table, rate, ours=True)
    return best["method"] if best else None


def minutes(seconds: float, span: tuple) -> str:
    """A time in minutes with its spread: "2.2 min (2.1-2.4)"."""
    return f"{seconds / 60:.1f} min ({span[0] / 60:.1f}-{span[1] / 60:.1f})"


def judge_rate(table: list[dict], rate: str) -> tuple[dict | None, dict | None, dict | None]:
    """(hvdcompress's fastest compressed row, the fastest peer, ``tta.judge`` of their
    times or None where either reached no target) at ``rate``."""
    ours, theirs = fastest(table, rate, ours=True), fastest(table, rate, ours=False)
    if ours is None or theirs is None:
        return ours, theirs, None
    return ours, theirs, tta.judge(*(
        (r["seconds"][rate], *r["span"][rate]) for r in (ours, theirs)
    ))  # fmt: skip


def ratio_text(judged: dict) -> str:
    return f"{judged['ratio']:.2f}x ({judged['low']:.2f}-{judged['high']:.2f})"


def verdict(table: list[dict], rate: str) -> str:
    """hvdcompress's best compressed row against the fastest peer (DDP, torch's hooks) at
    ``rate``: who reaches the target first, or a tie (``tta.judge``), and the ratio of
    their times with its low and high end."""
    ours, theirs, judged = judge_rate(table, rate)
    dense = [r["method"] for r in table if r["dense"][rate] and r["seconds"][rate]]
    aside = f" ({', '.join(dense)}: sent all dense, not counted)" if dense else ""
    if ours is None and theirs is None:
        return "nobody reached the target" + aside
    if ours is None:
        first = theirs["method"]
        return f"no compressed hvdcompress row reached the target; first: {first}{aside}"
    if theirs is None:
        return f"**{ours['method']} first**; no peer reached the target" + aside
    name = {"ours": f"**{ours['method']} first**", "theirs": f"{theirs['method']} first",
            "tie": "tie"}[judged["winner"]]  # fmt: skip
    return (f"{name}, {ours['method']} {minutes(ours['seconds'][rate], ours['span'][rate])} "
            f"against {theirs['method']} {minutes(theirs['seconds'][rate], theirs['span'][rate])}"
            f": {ratio_text(judged)}{aside}")  # fmt: skip


def margin_table(tables: dict[float, list[dict]], goals: dict[float, float | None]) -> list[str]:
    """Per margin below DDP's mean final accuracy (``tables``: margin -> ``rows`` at that
    margin's target), per rate, the verdict's short form: the first row and the ratio."""
    lines = [
        "| margin (target) | " + " | ".join(tta.RATE_NAMES[r] for r in tta.RATES) + " |",
        "|---" * (1 + len(tta.RATES)) + "|",
    ]
    for margin, table in tables.items():
        cells = []
        for rate in tta.RATES:
            ours, theirs, judged = judge_rate(table, rate)
            if judged is None:
                first = ours or theirs
                cells.append(f"{first['method']}, alone" if first else "nobody")
                continue
            first = {"ours": ours["method"], "theirs": theirs["method"], "tie": "tie"}
            cells.append(f"{first[judged['winner']]} {ratio_text(judged)}")
        goal = goals[margin]
        lines.append(f"| {100 * margin:.1f} ({'-' if goal is None else f'{100 * goal:.2f}%'}) | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return lines
