"""Which machine each node of an inventory is: its /etc/machine-id, read over SSH.

Two inventories can name one machine (different node names, an IP in one and a DNS name in the
other); a node lock must then be the machine's, not the name's. The identity is the one the
machine keeps itself: the machine id systemd writes at its first boot and keeps across reboots,
32 lowercase hex digits (machine-id(5)). A reinstalled machine gets a new one; machines cloned
from one image keep the image's until it is regenerated, which is why two nodes of one
inventory with the same id are an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from sparkdeploy.errors import RemoteError
from sparkdeploy.remote.docker_cli import checked, on_nodes
from sparkdeploy.remote.runner import Runner
from sparkdeploy.remote.ssh import SshTarget

MACHINE_ID_PATH = "/etc/machine-id"
READ_TIMEOUT_S = 30.0
_MACHINE_ID = re.compile(r"[0-9a-f]{32}")


def parse_machine_id(node: str, text: str) -> str:
    """The machine id in the content of a node's /etc/machine-id; RemoteError if it is none."""
    machine_id = text.strip()
    if not _MACHINE_ID.fullmatch(machine_id):
        shown = machine_id[:40] or "empty"
        raise RemoteError(
            f"node {node}: {MACHINE_ID_PATH} holds {shown!r}, not a machine id (32 hex"
            f" digits): the node locks need it; create it on {node} with"
            " `systemd-machine-id-setup`"
        )
    return machine_id


def machine_ids(targets: Mapping[str, SshTarget]) -> dict[str, str]:
    """node -> its machine id, every node at once, one command each on the node's cached SSH
    connection (the one the deploy's later steps use). RemoteError when a node cannot be asked
    or two nodes turn out to be one machine."""

    def read(runner: Runner, node: str) -> str:
        result = checked(
            node,
            runner.run(["cat", MACHINE_ID_PATH], timeout=READ_TIMEOUT_S, check=False),
            f"reading {MACHINE_ID_PATH}",
            f"create it on {node} with `systemd-machine-id-setup`",
        )
        return parse_machine_id(node, result.stdout.decode("utf-8", "replace"))

    found = on_nodes(targets, read)
    by_machine: dict[str, list[str]] = {}
    for node, machine_id in found.items():
        by_machine.setdefault(machine_id, []).append(node)
    same = [nodes for nodes in by_machine.values() if len(nodes) > 1]
    if same:
        named = [
            f"nodes {', '.join(nodes)} have one machine id ({found[nodes[0]]})" for nodes in same
        ]
        raise RemoteError(
            "; ".join(named)
            + ": either the inventory names one machine twice (remove one of its entries) or the"
            " machines were cloned with one id (on each clone: `rm /etc/machine-id &&"
            " systemd-machine-id-setup`)"
        )
    return found
