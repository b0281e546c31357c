"""An emulated cluster on one machine: M nodes of K ranks, a network namespace per node,
joined through a switch, each node's link rate-limited in both directions, the ranks of
a node talking over their own loopback at memory speed.

Layout (``Cluster``): a switch namespace ``<prefix>sw`` holds a bridge ``br0``; node ``i``
is the namespace ``<prefix>n<i>``, whose ``eth0`` is one end of a veth pair whose other end,
``s<i>``, is a port of the bridge. Addresses are link-local, ``169.254.100.<i+1>/24`` on
each node's ``eth0``, and nothing outside the namespaces is touched. A node's link is
limited by tc tbf on both ends of its veth: ``eth0``'s egress (what the node sends) and
``s<i>``'s egress (what it receives). Traffic between the ranks of one node goes to the
node's own address, which Linux routes over ``lo``: unlimited, as NVLink or shared memory
would be. Every namespace and every process in it is removed on exit, on failure and on
SIGINT / SIGTERM / SIGHUP (``in_cluster``); the namespaces of a driver that was killed
with SIGKILL are found by the driver's pid in their names and removed by the next run
(``cleanup_stale``).

Ranks are launched with torchrun, one per node namespace (``torchrun_command``; every
node's at once: ``launch_command``): it needs no ssh, and gloo binds to ``eth0``
(``GLOO_SOCKET_IFNAME``). The ranks find their node's link in ``NODE_DEVICE_ENV``, and
the node's local rank 0 reads its bytes around the timed steps (``node_link_counter``).
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

try:
    from _bench import netns
except ModuleNotFoundError:
    from scripts._bench import netns

SUBNET = "169.254.100."  # link-local (RFC 3927): never routed beyond the namespaces
DEVICE = "eth0"  # a node's link, inside its namespace
NODE_DEVICE_ENV = "HVDC_BENCH_NODE_DEVICE"  # set for the ranks of a cluster: their link


@dataclass(frozen=True)
class Cluster:
    """The names and addresses of an emulated cluster of ``nodes`` nodes."""

    prefix: str  # e.g. "hvdc-cl-<driver pid>-"
    nodes: int

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= 200:
            raise ValueError(f"an emulated cluster has 2 to 200 nodes, got {self.nodes}")

    def node(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}{i + 1}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(self.node(i) for i in range(self.nodes))]


def _ip(ns: str, *args: str) -> None:
    netns.sh("ip", "-n", ns, *args)


def create(cluster: Cluster) -> None:
    """The switch, the nodes, their veth pairs and addresses (no rate limit yet)."""
    netns.ns_create(cluster.switch)
    _ip(cluster.switch, "link", "add", "br0", "type", "bridge")
    _ip(cluster.switch, "link", "set", "br0", "up")
    for i in range(cluster.nodes):
        node = cluster.node(i)
        netns.ns_create(node)
        _ip(cluster.switch, "link", "add", f"s{i}", "type", "veth", "peer", "name", DEVICE,
            "netns", node)  # fmt: skip
        _ip(cluster.switch, "link", "set", f"s{i}", "master", "br0", "up")
        _ip(node, "addr", "add", f"{cluster.address(i)}/24", "dev", DEVICE)
        _ip(node, "link", "set", DEVICE, "up")


def tc_command(device: str, rate: str) -> list[str]:
    """tc tbf at ``rate`` on ``device``'s egress (unlimited: remove the qdisc). The burst
    is one millisecond at the rate, at least 64 KiB (above the veth's 1500-byte MTU and a
    TCP segment burst)."""
    bits = netns.rate_bits(rate)
    if bits is None:
        return ["tc", "qdisc", "del", "dev", device, "root"]
    burst = max(64 << 10, int(bits / 8 * 1e-3))
    return ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{int(bits)}bit",
            "burst", str(burst), "latency", "100ms"]  # fmt: skip


def set_node_link(cluster: Cluster, rate: str) -> None:
    """Every node's link at ``rate`` in both directions."""
    limited = netns.rate_bits(rate) is not None
    for i in range(cluster.nodes):
        netns.sh("ip", "netns", "exec", cluster.node(i), *tc_command(DEVICE, rate), check=limited)
        netns.sh("ip", "netns", "exec", cluster.switch, *tc_command(f"s{i}", rate), check=limited)


def link_bytes(device: str = DEVICE) -> tuple[int, int]:
    """(tx, rx) bytes of ``device`` in this process's namespace (/proc/net/dev)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == device:
            fields = rest.split()
            return int(fields[8]), int(fields[0])
    raise RuntimeError(f"no {device} in /proc/net/dev")


def torchrun_command(cluster: Cluster, node: int, ranks_per_node: int, port: int,
                     script: list[str]) -> list[str]:  # fmt: skip
    """torchrun of node ``node``'s ranks, inside its namespace; node 0 hosts the store."""
    return [
        "ip", "netns", "exec", cluster.node(node), "env", f"GLOO_SOCKET_IFNAME={DEVICE}",
        f"TP_SOCKET_IFNAME={DEVICE}", f"{NODE_DEVICE_ENV}={DEVICE}", sys.executable, "-m",
        "torch.distributed.run",
        f"--nnodes={cluster.nodes}", f"--node-rank={node}", f"--nproc-per-node={ranks_per_node}",
        f"--master-addr={cluster.address(0)}", f"--master-port={port}", *script,
    ]  # fmt: skip


def launch_command(cluster: Cluster, ranks_per_node: int, port: int,
                   script: list[str]) -> list[str]:  # fmt: skip
    """One command that runs every node's torchrun (``torchrun_command``) at once, their
    output merged on its own, and exits 0 when every node's did, else 1. Its processes
    live in the node namespaces: ``kill`` ends them."""
    nodes = [shlex.join(torchrun_command(cluster, i, ranks_per_node, port, script))
             for i in range(cluster.nodes)]  # fmt: skip
    started = "".join(f"{cmd} & p{i}=$!; " for i, cmd in enumerate(nodes))
    waited = "".join(f"wait $p{i} || rc=1; " for i in range(cluster.nodes))
    return ["sh", "-c", f"rc=0; {started}{waited}exit $rc"]


def kill(cluster: Cluster) -> None:
    """End every process in the cluster's namespaces (the namespaces stay)."""
    for ns in cluster.namespaces:
        netns.ns_kill(ns)


def node_link_counter():
    """For a rank of an emulated cluster (``NODE_DEVICE_ENV`` set) that is its node's
    local rank 0 (torchrun's ``LOCAL_RANK``): a callable giving the (tx, rx) bytes of the
    node's link so far; else None (another rank of the node, or no cluster)."""
    device = os.environ.get(NODE_DEVICE_ENV)
    if device is None or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    return lambda: link_bytes(device)


def delete(cluster: Cluster) -> None:
    for ns in reversed(cluster.namespaces):  # the nodes' processes first
        if ns in netns.list_namespaces(ns):
            netns.ns_delete(ns)


def cleanup_stale(prefix: str, script_name: str) -> list[str]:
    """Remove the namespaces named ``<prefix><pid>-...`` whose driver (a process ``pid``
    running ``script_name``) is gone."""
    removed = []
    for ns in netns.list_namespaces(prefix):
        pid = ns[len(prefix) :].split("-", 1)[0]
        try:
            alive = (
                pid.isdigit() and script_name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
            )
        except OSError:
            alive = False
        if not alive:
            netns.ns_delete(ns)
            removed.append(ns)
    return removed


def in_cluster(cluster: Cluster, body) -> str | None:
    """Create ``cluster``, run ``body()``, and remove every namespace and process of it,
    whatever happens (``netns.guarded``: SIGINT, SIGTERM and SIGHUP end ``body``; the
    return value is the name of the signal that did, else None)."""
    return netns.guarded(lambda: create(cluster), lambda: delete(cluster), body)
