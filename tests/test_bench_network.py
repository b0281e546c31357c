"""scripts/bench_network.py: real TCP traffic through a rate-limited namespace loopback,
and through the rate-limited node links of an emulated cluster (--nodes).

Needs root and ``ip netns`` (skipped otherwise, except in CI, where that fails). Each run
uses its own namespace prefix, so a benchmark running at the same time does not disturb
the checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import needs_netns

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_network.py"


def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: network namespaces and tc"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if res.returncode != 0:
        return f"ip netns unavailable: {res.stderr.strip()}"
    if importlib.util.find_spec("horovod") is None:
        return "horovod not installed (the benchmark launches with horovodrun --gloo)"
    return None


_SKIP = _netns_skip_reason()
pytestmark = needs_netns(_SKIP)


def _namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _run(tmp_path: Path, prefix: str, *extra: str, timeout: float = 150) -> tuple:
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--ns-prefix", prefix]
    res = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if not (out / "bench_network.json").is_file():
        pytest.fail(f"no JSON written (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr}")
    data = json.loads((out / "bench_network.json").read_text())
    return res, data, out


def test_quick_run_measures_wire_bytes(tmp_path):
    prefix = f"hvdc-bt{os.getpid()}a-"
    res, data, out = _run(tmp_path, prefix)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {(r["rate"], r["case"]): r for r in data["rows"]}
    assert set(rows) == {(rate, c) for rate in ("1gbit", "unlimited") for c in ("none", "3lc")}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["ranks"] == 2 and r["launcher"] == "gloo" and r["model"] == "light"
        assert r["step_s"] > 0
    n = 2
    for rate in ("1gbit", "unlimited"):
        none, threelc = rows[(rate, "none")], rows[(rate, "3lc")]
        # ring allreduce: each rank sends 2(n-1)/n of the float32 gradient; the loopback
        # carries every rank's sends (plus TCP/IP headers and the barriers)
        theory = 2 * (n - 1) / n * none["params"] * 4 * n
        assert 0.9 * theory < none["measured_bytes_per_step"] < 1.5 * theory, none
        assert threelc["measured_bytes_per_step"] * 10 < none["measured_bytes_per_step"], threelc
        assert none["speedup_vs_none"] == pytest.approx(1.0)
    assert "netem" in data["meta"]["latency"]
    assert (out / "bench_network.md").read_text().count("| gloo | 2 |") == 4
    assert (out / "bench_network.png").stat().st_size > 0
    assert data["meta"]["namespace"].startswith(prefix)
    assert _namespaces(prefix) == []


def test_failures_are_reported_and_cleaned_up(tmp_path):
    """A case that raises is reported with its reason and the launch restarted for the
    next case; a rank that hangs (the others wait in a collective) is killed at
    --timeout. No namespace, hence no process in it, is left behind."""
    prefix = f"hvdc-bt{os.getpid()}b-"
    res, data, _ = _run(
        tmp_path,
        prefix,
        *("--rates", "unlimited", "--cases", "3lc", "none", "fp16"),
        *("--inject-failure", "3lc", "--inject-hang", "fp16", "--timeout", "10"),
    )
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["case"]: r for r in data["rows"]}
    assert set(rows) == {"3lc", "none", "fp16"}
    assert rows["3lc"]["status"] == "failed"
    assert "injected failure" in rows["3lc"]["reason"]
    assert rows["none"]["status"] == "ok", rows["none"]
    assert rows["fp16"]["status"] == "failed"
    assert "timeout" in rows["fp16"]["reason"]
    assert "FAILED" in res.stdout
    assert _namespaces(prefix) == []


def test_exchange_and_ranks_axes_measure_bytes_per_rank(tmp_path):
    """3LC on the allgather and the two-stage exchange at 2 and 3 ranks (mpi over TCP):
    the transport counts the two-stage bytes near 2 (N - 1) / N x the allgather payload,
    fewer than the allgather's at 3 ranks; none runs once, allreduced."""
    prefix = f"hvdc-bt{os.getpid()}c-"
    res, data, out = _run(
        tmp_path,
        prefix,
        *("--ranks", "2", "3", "--rates", "unlimited", "--models", "cnn"),
        *("--cases", "none", "3lc", "--exchanges", "allgather", "twostage"),
        *("--launchers", "mpi"),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {(r["ranks"], r["case"], r["exchange"]): r for r in data["rows"]}
    assert set(rows) == {
        (n, c, e)
        for n in (2, 3)
        for c, e in (("none", "allreduce"), ("3lc", "allgather"), ("3lc", "twostage"))
    }
    for r in rows.values():
        assert r["status"] == "ok", r
    for n in (2, 3):
        ag, ts = rows[(n, "3lc", "allgather")], rows[(n, "3lc", "twostage")]
        assert ag["exchanges"] == ["allgather"] and ts["exchanges"] == ["twostage"]
        assert 0.85 < ts["sent_vs_model"] < 1.25, ts
        assert ts["measured_bytes_per_rank"] > ts["sent_bytes_per_rank"] > 0  # + TCP/IP
    assert (
        rows[(3, "3lc", "twostage")]["sent_bytes_per_rank"]
        < 0.8 * (rows[(3, "3lc", "allgather")]["sent_bytes_per_rank"])
    )
    table = (out / "bench_network.md").read_text()
    assert "| mpi | unlimited | cnn | 3lc (twostage) |" in table  # the bytes-vs-ranks table
    assert (out / "bench_network_bytes.png").stat().st_size > 0
    assert _namespaces(prefix) == []


def test_an_emulated_cluster_reports_the_bytes_on_each_nodes_link(tmp_path):
    """--nodes 2 --ranks-per-node 2 --node-link 100mbit: torchrun per node namespace
    (scripts/_bench/cluster.py); every row has each node's link (tx, rx per step) and the
    measured bytes are what crossed the links; the allreduce's intra-node edge stays off
    them; the hierarchical exchange puts fewer bytes on them than the allgather. Every
    namespace of the cluster is removed afterwards."""
    prefix = f"hvdc-bt{os.getpid()}d-"
    res, data, out = _run(
        tmp_path,
        prefix,
        *("--nodes", "2", "--ranks-per-node", "2", "--node-link", "100mbit"),
        *("--models", "cnn", "--cases", "none", "3lc"),
        *("--exchanges", "allgather", "hierarchical"),
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert data["meta"]["cluster"] == {"nodes": 2, "ranks_per_node": 2, "node_link": ["100mbit"]}
    rows = {(r["case"], r["exchange"]): r for r in data["rows"]}
    assert set(rows) == {("none", "allreduce"), ("3lc", "allgather"), ("3lc", "hierarchical")}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["launcher"] == "torchrun" and r["ranks"] == 4 and r["rate"] == "100mbit"
        assert r["topology"] == "2x2" and r["nodes"] == 2 and r["ranks_per_node"] == 2
        links = r["node_link_bytes_per_step"]
        assert len(links) == 2 and all(tx > 0 and rx > 0 for tx, rx in links), r
        assert r["measured_bytes_per_step"] == pytest.approx(sum(tx for tx, _ in links))
        assert r["step_s"] > 0
    assert rows[("3lc", "hierarchical")]["exchanges"] == ["hierarchical"]
    # gloo's ring allreduce over 4 ranks, 2 per node: one cross-node edge each way per
    # node, 2 (N - 1) / N x the float32 gradient on it (plus TCP/IP headers)
    none = rows[("none", "allreduce")]
    ring = 2 * 3 / 4 * 4 * none["params"]
    for tx, rx in none["node_link_bytes_per_step"]:
        assert 0.95 * ring < tx < 1.4 * ring and 0.95 * ring < rx < 1.4 * ring, none
    # allgather: each rank's payload goes to both ranks of the other node; hierarchical:
    # the node's ranks combine first, then one exchange per node's shard crosses
    gather = max(tx for tx, _ in rows[("3lc", "allgather")]["node_link_bytes_per_step"])
    hier = max(tx for tx, _ in rows[("3lc", "hierarchical")]["node_link_bytes_per_step"])
    assert hier < 0.75 * gather < 0.1 * ring, (hier, gather)
    table = (out / "bench_network.md").read_text()
    assert "an emulated cluster of 2 nodes x 2 ranks" in table
    assert "node links tx/rx MB/step" in table
    assert "| torchrun | 4 | 100mbit | cnn | 3lc | hierarchical |" in table
    assert "node links tx/rx MB/step" in res.stdout  # the progress lines
    assert data["meta"]["namespace"].startswith(prefix)
    assert _namespaces(prefix) == []


def test_stock_horovod_beside_the_tuned_optimizer(tmp_path):
    """The optimizer's step bench against what a Horovod user has: stock
    ``hvd.DistributedOptimizer`` (none, fp16) in the same launch as hvdcompress's tuned
    3LC, the speedups over both, the tuner's decisions and each timed step's time."""
    prefix = f"hvdc-bt{os.getpid()}e-"
    steps = 20  # past the tuner's warm-up (5) and its first round
    res, data, out = _run(
        tmp_path, prefix, "--rates", "unlimited", "--cases", "horovod-none", "horovod-fp16",
        "3lc", "--steps", str(steps), "--tuning-drift", "off",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["case"]: r for r in data["rows"]}
    assert set(rows) == {"horovod-none", "horovod-fp16", "3lc"}
    stock, half, ours = rows["horovod-none"], rows["horovod-fp16"], rows["3lc"]
    assert all(r["status"] == "ok" and len(r["step_s_series"]) == steps for r in rows.values())
    assert stock["exchange"] == "allreduce" and stock["compressor"] == "horovod.Compression.none"
    # fp16 puts about half of float32's bytes on the loopback
    ratio = half["measured_bytes_per_step"] / stock["measured_bytes_per_step"]
    assert 0.4 < ratio < 0.65, ratio
    assert ours["speedup_vs_horovod_none"] == pytest.approx(stock["step_s"] / ours["step_s"])
    tuner = ours["tuner"]
    assert tuner["rounds"] >= 1 and tuner["trial_steps"] > 0 and tuner["drift_rounds"] == 0
    assert tuner["decisions"] and "bf16" in tuner["decisions"][0]  # the 16-bit option timed
    assert set(ours["exchanges"]) <= {"allgather", "dense", "bf16", "allreduce"}
    assert "vs hvd none" in (out / "bench_network.md").read_text()
    assert _namespaces(prefix) == []


def test_stock_horovod_runs_under_horovodrun_only(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", "horovod-none", "--launchers", "mpi",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2 and "--launchers gloo only" in res.stderr
