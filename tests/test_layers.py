"""The package's layers (docs/design.md, "Layers"): every module sits in one layer of the
import-linter contract in setup.cfg, no module imports a layer above its own, and no
import cycle exists (grimp's graph, the one lint-imports checks, every import counted:
function-level and type-checking ones too)."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import grimp

import hvdcompress

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(hvdcompress.__file__).resolve().parent


def contract_layers() -> list[list[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    raw = cfg["importlinter:contract:layers"]["layers"]
    return [
        [name.strip() for name in line.replace(":", "|").split("|")]
        for line in raw.strip().splitlines()
    ]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.add(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def package_graph() -> dict[str, set[str]]:
    graph = grimp.build_graph("hvdcompress", cache_dir=None)
    return {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}


def test_every_module_of_the_package_sits_in_exactly_one_layer():
    named = [name for layer in contract_layers() for name in layer]
    assert len(named) == len(set(named))
    top = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert top == set(named), f"not in a layer: {top - set(named)}; gone: {set(named) - top}"


def test_the_package_has_no_import_cycle():
    cycles = strongly_connected(package_graph())
    assert cycles == [], f"import cycles: {[sorted(c) for c in cycles]}"


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = package_graph()
    # wire imports the backends; plant the import back that the layers forbid
    graph["hvdcompress.backends.records"] = graph["hvdcompress.backends.records"] | {
        "hvdcompress.wire"
    }
    cycles = strongly_connected(graph)
    assert any({"hvdcompress.wire", "hvdcompress.backends.records"} <= c for c in cycles)
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_lint_imports_keeps_the_layers_contract():
    exe = Path(sys.executable).with_name("lint-imports")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [str(exe), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 kept, 0 broken" in run.stdout
