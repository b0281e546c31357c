"""scripts/_bench/cluster.py: an emulated cluster of 2 nodes x 2 ranks (a namespace per
node, a switch namespace with a bridge, veth links rate-limited in both directions,
link-local addresses). torchrun per node places ranks by node; an allreduce across the
nodes is exact and its bytes cross each node's link; the namespaces are removed after
the run, after SIGTERM of the driver, and, for a driver killed with SIGKILL, by the next
run. Needs root and ``ip netns`` (skipped otherwise, except in CI, where that fails)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from scripts._bench import cluster, netns
from tests.helpers import needs_netns

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "cluster" / "allreduce_worker.py"
_SKIP = netns.netns_available()
pytestmark = needs_netns(_SKIP)


def _ours(prefix: str) -> list[str]:
    return netns.list_namespaces(prefix)


def test_two_nodes_of_two_ranks_allreduce_exactly_across_rate_limited_links(tmp_path):
    c = cluster.Cluster(f"hvdc-cltest-{os.getpid()}-", 2)
    logs, qdiscs = [], []

    def body() -> None:
        cluster.set_node_link(c, "100mbit")
        for ns, dev in ((c.node(0), "eth0"), (c.switch, "s1")):
            qdiscs.append(
                netns.sh("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev).stdout
            )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        procs = [
            subprocess.Popen(cluster.torchrun_command(c, i, 2, 29611, [str(WORKER), str(tmp_path)]),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)
        ]  # fmt: skip
        for p in procs:
            logs.append((p.communicate(timeout=240)[0], p.returncode))

    assert cluster.in_cluster(c, body) is None
    assert _ours(c.prefix) == []  # all removed
    assert all(rc == 0 for _, rc in logs), [out[-1500:] for out, _ in logs]
    assert all("tbf" in q and "100Mbit" in q for q in qdiscs), qdiscs  # both directions
    nodes = [json.loads((tmp_path / f"node{g}.json").read_text()) for g in range(2)]
    for g, r in enumerate(nodes):
        assert r["exact"]
        assert r["placed"] == [[0, 0], [1, 0], [2, 1], [3, 1]]  # K consecutive ranks a node
        assert r["topology"] == [[0, 1], [2, 3]]  # hvdcompress sees the same nodes
        assert len(set(r["hierarchical_digests"])) == 1  # the hook's hierarchical exchange
        # a ring allreduce of 4 MB on 4 ranks: one cross-node edge each way per node,
        # 2 (N - 1) / N x 4 MB = 6 MB on it, plus TCP/IP headers; the intra-node edge
        # stays on the node's loopback
        for way in ("tx", "rx"):
            assert 5.5e6 < r[way] < 8e6, (g, r)


DRIVER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from scripts._bench import cluster
    c = cluster.Cluster(sys.argv[2], 3)
    def body():
        print("up", flush=True)
        time.sleep(120)
    print(cluster.in_cluster(c, body), flush=True)
    """
)


def _start_driver(prefix: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(ROOT), prefix],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_sigterm_of_the_driver_removes_every_namespace():
    prefix = f"hvdc-cltest-{os.getpid()}t-"
    proc = _start_driver(prefix)
    assert len(_ours(prefix)) == 4  # the switch and three nodes
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert "SIGTERM" in out and time.monotonic() - t0 < 30
    assert _ours(prefix) == []


def test_the_namespaces_of_a_killed_driver_are_removed_by_the_next_run():
    base = "hvdc-cltest-k"
    proc = _start_driver(f"{base}{os.getpid()}-")  # named by a pid that is not the driver's
    proc.kill()
    proc.wait()
    left = _ours(f"{base}{os.getpid()}-")
    assert len(left) == 4  # SIGKILL: nothing could clean up
    # the test process is alive but does not run the driver's script: stale
    removed = cluster.cleanup_stale(base, "no-such-driver.py")
    assert sorted(removed) == sorted(left) and _ours(base) == []
