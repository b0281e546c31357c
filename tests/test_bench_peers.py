"""scripts/bench_peers.py: DDP's allreduce, torch's PowerSGD hook and hvdcompress's hook
(overlapped and inline) through real TCP traffic on a rate-limited namespace loopback,
2 ranks under torchrun, a few steps of the training recipe. Needs root and ``ip netns``
(skipped otherwise, except in CI, where that fails); the recipe and the combining of
``--repeats`` without them: tests/test_bench_peers_recipe.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts._bench import netns
from tests.helpers import needs_netns

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_peers.py"
_SKIP = netns.netns_available()
pytestmark = needs_netns(_SKIP)


def test_a_small_run_measures_steps_and_wire_bytes_of_each_hook(tmp_path):
    rows = ["ddp", "torch-powersgd-r1", "hvdc-none", "hvdc-3lc", "hvdc-3lc-inline"]
    cmd = [sys.executable, str(SCRIPT), "--ranks", "2", "--rates", "100mbit", "--models", "cnn",
           "--rows", *rows, "--steps", "3", "--warmup", "2", "--repeats", "2",
           "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "bench_peers.json").read_text())
    got = {r["row"]: r for r in data["rows"]}
    assert sorted(got) == sorted(rows)
    ddp, none, threelc = got["ddp"], got["hvdc-none"], got["hvdc-3lc"]
    # ring allreduce of B bytes of float32 gradients: each of the N = 2 ranks sends
    # 2 (N - 1) / N x B, so the link carries 2 B (plus TCP/IP headers and the barriers)
    assert 0.9 < ddp["wire_mb"] * 1e6 / (2 * ddp["parameters"] * 4) < 1.3, ddp
    assert 0.9 < none["wire_mb"] / ddp["wire_mb"] < 1.1
    assert threelc["wire_mb"] < ddp["wire_mb"] / 20 and threelc["bits_per_value"] < 1
    assert threelc["overlapping"] and not got["hvdc-3lc-inline"]["overlapping"]
    # auto, tuned: timed until its first round decided (a compressed option, at 100 Mbit/s)
    assert threelc["tuning_steps"] > 0 and threelc["decisions"], threelc
    # the tuner's steps, each the slowest rank's time: longer than a steady-state step
    assert threelc["tuning_s"] > threelc["tuning_steps"] * threelc["step_lo_s"] * 0.5
    assert ddp["tuning_s"] == 0.0 and ddp["tuning_steps"] == 0
    # the training recipe: train.py's batch, SGD and seed; two launches, their spread
    for r in got.values():
        assert (r["recipe"], r["data"], r["seed"], r["batch"]) == ("training", "fashion-mnist",
                                                                     1, 64)  # fmt: skip
        assert (r["lr"], r["momentum"]) == (0.05, 0.9)
        assert r["repeats"] == 2 and r["failed_runs"] == 0 and len(r["step_runs_s"]) == 2
        assert r["step_lo_s"] <= r["step_s"] <= r["step_hi_s"]
        # the period: barrier to barrier, per timed step, no longer than the slowest rank's
        # steps summed (every step waits for its slowest rank at the collective)
        assert len(r["period_runs_s"]) == 2 and 0 < r["period_s"] <= 1.2 * r["step_hi_s"]
    assert "recipe training" in data["header"] and "2 launches per rate" in data["header"]
    assert done.stdout.count("launch 2 of 2") == 1 and "median" in done.stdout
    assert "dense" not in threelc["exchanges"] and got["hvdc-none"]["decisions"] == []
    # at 100 Mbit/s the 0.83 MB of gradients take about 70 ms a step; 3LC's bytes do not
    assert threelc["step_s"] < ddp["step_s"]
    assert "| cnn | hvdc-3lc | 100mbit |" in (tmp_path / "bench_peers.md").read_text()
    assert (tmp_path / "bench_peers.png").stat().st_size > 0


def test_the_two_stage_bytes_are_checked_against_the_allgather_payload():
    """twostage_bytes: sent per rank over 2 (N - 1) / N x the -allgather row's payload, MET
    within 15%, MISS outside, nothing without the allgather row of the same model and rate."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_peers_under_test", SCRIPT)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)

    def row(name, payload, sent, rate="unlimited"):
        return {"model": "cnn", "rate": rate, "row": name, "payload_kb_per_rank": payload,
                "sent_kb_per_rank": sent}  # fmt: skip

    gather = row("hvdc-3lc-allgather", 9.0, 27.0)
    met = peers.twostage_bytes([gather, row("hvdc-3lc-twostage", 5.0, 15.1)], 4)
    assert met.startswith("  MET ") and "1.12x" in met  # 15.1 / (1.5 x 9.0)
    miss = peers.twostage_bytes([gather, row("hvdc-3lc-twostage", 5.0, 22.0)], 4)
    assert miss.startswith("  MISS") and "1.63x" in miss
    assert peers.twostage_bytes([row("hvdc-3lc-twostage", 5.0, 15.1)], 4) == ""
    other_rate = row("hvdc-3lc-twostage", 5.0, 15.1, rate="1gbit")
    assert peers.twostage_bytes([gather, other_rate], 4) == ""


def test_an_emulated_cluster_reports_the_bytes_on_each_nodes_link(tmp_path):
    """--nodes 2 --ranks-per-node 2: torchrun per node namespace; every row reports each
    node's link (tx, rx per step), the intra-node traffic stays off it, and 3LC puts far
    fewer bytes on it than DDP's allreduce."""
    cmd = [sys.executable, str(SCRIPT), "--nodes", "2", "--ranks-per-node", "2", "--rates",
           "100mbit", "--models", "cnn", "--rows", "ddp", "hvdc-3lc", "--steps", "3",
           "--warmup", "2", "--repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "bench_peers.json").read_text())
    got = {r["row"]: r for r in data["rows"]}
    assert "2 nodes x 2 ranks" in data["header"]
    for r in got.values():
        assert r["ranks"] == 4 and r["topology"] == "2x2" and len(r["node_link_mb"]) == 2
        assert r["wire_mb"] == pytest.approx(sum(tx for tx, _ in r["node_link_mb"]))
    ddp = got["ddp"]["node_link_mb"]
    # DDP's ring over 4 ranks: each node's link carries 2 (N - 1) / N of the 0.83 MB of
    # gradient each way (the other edge of the ring stays inside the node)
    assert all(1.1 < tx < 1.6 and 1.1 < rx < 1.6 for tx, rx in ddp), ddp
    assert max(map(max, got["hvdc-3lc"]["node_link_mb"])) < 0.1 * min(map(min, ddp))
    assert netns.list_namespaces("hvdc-peers-") == []


def test_the_targets_are_printed_met_or_missed_from_the_rows():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_peers_targets", SCRIPT)
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)

    def row(name, step_s, **kw):
        return {"model": "cnn", "rate": "100mbit", "row": name, "step_s": step_s, **kw}

    text = peers.targets([
        row("ddp", 1.0), row("hvdc-3lc-allgather", 0.10), row("hvdc-3lc-twostage", 0.09),
        row("hvdc-3lc", 0.0925, wire_mb=0.25, wait_s=0.03), row("hvdc-none", 1.05),
        row("hvdc-powersgd-r2", 0.07), row("torch-powersgd-r2", 0.072),
    ])  # fmt: skip
    lines = text.splitlines()
    assert "hvdc-3lc (auto) speed / hvdc-3lc-twostage's: 0.97 (target >= 0.97) MET" in lines[0]
    assert "hvdc-none speed / ddp's: 0.95 (target >= 0.97) MISS" in lines[1]
    assert "hvdc-powersgd-r2 (fastest hvdc codec) speed / torch-powersgd-r2's: 1.03" in lines[2]
    assert lines[2].endswith("MET")
    # 0.25 MB at 100 Mbit/s is 0.020 s of line time: waiting 0.030 s is 1.5x
    assert (
        "wait / line-rate time of its bytes (0.030 / 0.020 s): 1.50 (target <= 1.3) MISS"
        in lines[3]
    )
