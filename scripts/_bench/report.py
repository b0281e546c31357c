"""What the benchmarks write: markdown and fixed-width tables, JSON files, figures
(matplotlib, files only) and a description of the machine and the run."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def md_table(head: list[str], rows) -> list[str]:
    """A markdown table's lines: the header, the rule, one line per row (a list of cells)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return lines


def print_fixed(head: str, lines) -> None:
    """A fixed-width table: the header, a rule of its width, the lines."""
    print(head)
    print("-" * len(head))
    for line in lines:
        print(line)


def write_json(path: Path, data, indent: int) -> None:
    """``data`` as JSON in ``path``, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))


def pyplot():
    """matplotlib.pyplot on the Agg backend (figures to files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, **layout) -> Path:
    """Lay out, write (120 dpi) and close ``fig``; ``layout``: tight_layout's keywords."""
    import matplotlib.pyplot as plt

    fig.tight_layout(**layout)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def host() -> str:
    """This machine: its name, cores and architecture."""
    return f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})"


def command_line() -> str:
    """How this run was started (the interpreter's name and the arguments)."""
    return " ".join([Path(sys.executable).name, *sys.argv])


def versions() -> dict:
    """The torch and Python versions a result was measured with."""
    import torch

    return {"torch": torch.__version__, "python": platform.python_version()}
