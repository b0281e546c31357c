"""bench_peers' launches as resumable pieces: a JSON-lines file with one line per finished
launch (its configuration, its rate, its rows), so that a matrix too long for one job (the
10 M MLP's dense rows at 100 Mbit/s take 10-20 s a step) runs as pieces of one launch
each, the driver skipping the launches already recorded, and the last piece writes the
table of every piece.

A line: ``{"config": {...}, "rate": "100mbit", "rows": [<a launch's rows>]}``. The
configuration is what makes two launches the same measurement (models, rows, steps,
warm-up, batch, width, recipe, ranks, topology); the rows of one configuration and rate
are combined as ``--repeats`` launches are (``peerreport.combine_launches``). Pieces that
time different rows under otherwise equal settings are *siblings*: the table joins them.
"""

from __future__ import annotations

import json
from pathlib import Path

try:
    from _bench.peerreport import combine_launches
except ModuleNotFoundError:  # loaded by file path from the repository root (the tests)
    from scripts._bench.peerreport import combine_launches

# the settings that make two pieces' tables one table (everything but the rows timed)
SHARED = ("steps", "warmup", "batch", "width", "recipe", "ranks", "nodes", "ranks_per_node")


def config_of(args) -> dict:
    """The configuration a launch is recorded under: the rows and models it times and the
    settings in ``SHARED``."""
    shared = {k: getattr(args, k) for k in SHARED}
    return {"models": list(args.models), "rows": list(args.rows), **shared}


def read(path: Path) -> list[dict]:
    """The recorded launches, in the order they ran; a missing file is none. A line that
    is not a launch record (a piece killed while writing it) is refused with its number,
    not skipped: the driver would run that launch again and count it twice otherwise."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); remove the line") from e
        if not isinstance(rec, dict) or not {"config", "rate", "rows"} <= rec.keys():
            raise ValueError(f"{path}:{n}: not a launch record (config, rate, rows)")
        out.append(rec)
    return out


def launches_of(records: list[dict], config: dict, rate: str) -> list[list[dict]]:
    """The rows of each recorded launch of ``config`` at ``rate``, in the order they ran."""
    return [r["rows"] for r in records if r["config"] == config and r["rate"] == rate]


def append(path: Path, config: dict, rate: str, rows: list[dict]) -> None:
    """Record one finished launch (one line, flushed before the next launch starts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"config": config, "rate": rate, "rows": rows}) + "\n")


def combined(records: list[dict], config: dict, repeats: int) -> list[dict]:
    """The table of ``config`` and its siblings (the same ``SHARED`` settings, other rows
    or models): per (configuration, rate), its first ``repeats`` launches combined, in the
    order the pieces first ran."""
    shared = {k: config[k] for k in SHARED}
    groups: dict[str, list[list[dict]]] = {}
    for r in records:
        if {k: r["config"].get(k) for k in SHARED} != shared:
            continue
        key = json.dumps([r["config"], r["rate"]], sort_keys=True)
        groups.setdefault(key, []).append(r["rows"])
    return [row for launches in groups.values() for row in combine_launches(launches[:repeats])]
