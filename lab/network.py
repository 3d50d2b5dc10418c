"""The lab's network: a namespace per node and ops host, a bridge in a namespace of its own, veths
between them and one veth from the bridge to the host (the topology is in lab.cluster's
docstring); found again and removed by `lab down`."""

from __future__ import annotations

import re
import time
from pathlib import Path

from lab.layout import FABRIC_NETDEV, LabLayout
from lab.processes import STOP_TIMEOUT_S, run
from sparkdeploy.errors import LabError

NETNS_DIR = Path("/run/netns")
HOST_NETDEVS_DIR = Path("/sys/class/net")


def in_netns(netns: str) -> list[str]:
    """The command prefix that runs a host command in a network namespace of the lab."""
    return ["nsenter", f"--net={NETNS_DIR / netns}", "--"]


def _ip_batch(commands: list[str], netns: str | None = None) -> None:
    """Several `ip` commands in one process (each `ip` start costs a few ms)."""
    argv = ["ip", *(["-n", netns] if netns else []), "-batch", "-"]
    run(argv, stdin="\n".join(commands).encode())


def check_subnet_is_free(layout: LabLayout) -> None:
    """LabError if the host already has an address in the lab's /24 (another lab, a VPN)."""
    prefix = layout.subnet_prefix + "."
    for line in run(["ip", "-o", "-4", "addr", "show"]).splitlines():
        if f" {prefix}" in line:
            raise LabError(
                f"lab {layout.name!r} would use {layout.subnet}, but the host already has"
                f" an address in it ({line.split()[1]}: {line.split()[3]}); pick another"
                " --name (the subnet derives from it)"
            )


def create_network(layout: LabLayout) -> None:
    """The namespaces, the bridge and every veth, each host's address on its fabric netdev."""
    bridge_ns = layout.bridge_netns
    # Every host on the fabric: (its namespace, its port on the bridge, its address).
    hosts = [
        (layout.node_netns(node), layout.node_bridge_port(node), layout.node_ip(node))
        for node in layout.node_names
    ] + [
        (layout.ops_host_netns(ops), layout.ops_host_bridge_port(ops), layout.ops_host_ip(ops))
        for ops in layout.ops_host_names
    ]
    _ip_batch(
        [f"netns add {bridge_ns}"]
        + [f"netns add {netns}" for netns, _, _ in hosts]
        + [
            f"link add {layout.host_link} type veth peer name uplink netns {bridge_ns}",
            f"addr add {layout.host_ip}/24 dev {layout.host_link}",
            f"link set {layout.host_link} up",
        ]
    )
    bridge_commands = [
        "link set lo up",
        "link add br0 type bridge",
        f"addr add {layout.registry_ip}/24 dev br0",
        f"addr add {layout.hub_storage_ip}/24 dev br0",
        "link set br0 up",
        "link set uplink master br0 up",
    ]
    for netns, port, _ in hosts:
        bridge_commands += [
            f"link add {port} type veth peer name {FABRIC_NETDEV} netns {netns}",
            f"link set {port} master br0 up",
        ]
    _ip_batch(bridge_commands, bridge_ns)
    for netns, _, ip in hosts:
        _ip_batch(
            [
                "link set lo up",
                f"addr add {ip}/24 dev {FABRIC_NETDEV}",
                f"link set {FABRIC_NETDEV} up",
            ],
            netns,
        )


def existing_netns(netns_prefix: str) -> list[str]:
    """The lab's namespaces on the machine (bridge, nodes, ops hosts), whatever its node count."""
    pattern = re.compile(rf"{re.escape(netns_prefix)}(net|node\d+|ops\d+)")
    if not NETNS_DIR.is_dir():
        return []
    return sorted(entry.name for entry in NETNS_DIR.iterdir() if pattern.fullmatch(entry.name))


def netns_pids(netns: str) -> set[int]:
    """Every process in the namespace."""
    return {int(pid) for pid in run(["ip", "netns", "pids", netns]).split()}


def delete_netns(names: list[str]) -> None:
    """The namespaces, in one `ip` process; nothing to run if there are none."""
    if names:
        _ip_batch([f"netns delete {name}" for name in names])


def host_link_exists(host_link: str) -> bool:
    return (HOST_NETDEVS_DIR / host_link).exists()


def delete_host_link(host_link: str) -> None:
    """The veth's host end. Deleting the bridge namespace takes it along too, but the kernel
    does that asynchronously: it can vanish between the check and the delete."""
    if not host_link_exists(host_link):
        return
    try:
        run(["ip", "link", "delete", host_link])
    except LabError:
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while host_link_exists(host_link):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
