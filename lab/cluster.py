"""A real multi-node cluster on one machine: `Lab.up()` and `Lab.down()`.

Topology (names and addresses from lab.layout, derived from the lab's name):

    host: <host_link> 10.x.y.1 ══veth══ uplink ─┐
                                                 ├─ br0 10.x.y.2 (registry, hub)
                                                 │      10.x.y.3 (hub storage), netns lab-<name>-net
    netns lab-<name>-node1: enp1s0f1np1 10.x.y.11 ══veth══ port1 ─┤
    netns lab-<name>-node2: enp1s0f1np1 10.x.y.12 ══veth══ port2 ─┘ ...

The bridge sits in its own namespace so node-to-node traffic never crosses the host's firewall.
Each node runs lab/nodeinit.py in its own mount and UTS namespaces (own /run, /tmp + /var/tmp,
/var/lib/docker, /etc/ssh, /etc/docker, /etc/hosts, /etc/machine-id, hostname), which starts
the node's dockerd and becomes its sshd. Everything lives under <lab root>/<name>/
(sparkdeploy.spec.project.lab_root: /srv/sparkdeploy-lab unless SPARKDEPLOY_LAB_ROOT says
otherwise);
`down` removes it all.

`Lab` is the facade; each job is a module of its own: lab.node_files (keys and config files),
lab.network (namespaces, bridge, veths), lab.daemons (registry, hub and the nodes' daemons:
start, readiness, recorded PIDs, fault switches), lab.inventory (the cluster.toml it writes),
lab.teardown (`down` and what remains), with lab.processes (run, spawn, stop processes) and
lab.cgroups (the nodes' container cgroups) beneath.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from lab import daemons as lab_daemons
from lab import teardown
from lab.daemons import REGISTRY_BINARY
from lab.inventory import write_inventory
from lab.layout import DEFAULT_NAME, DEFAULT_NODES, REGISTRY_PORT, LabLayout
from lab.network import check_subnet_is_free, create_network, in_netns, netns_pids
from lab.node_files import write_node_files
from lab.processes import alive, kill_at_once
from sparkdeploy.errors import LabError
from sparkdeploy.remote.ssh import SshTarget

REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "mount", "dockerd", "containerd", "sshd")
MACHINE_ID = Path("/etc/machine-id")


class Lab:
    """One lab, by name. `up()` builds it (cleaning a crashed one first), `down()` removes it."""

    def __init__(
        self, name: str = DEFAULT_NAME, node_count: int = DEFAULT_NODES, ops_hosts: int = 0
    ) -> None:
        self.layout = LabLayout(name, node_count, ops_host_count=ops_hosts)

    @classmethod
    def existing(cls, name: str = DEFAULT_NAME) -> Lab:
        """The lab `lab up --name NAME` brought up, read back from its state file."""
        state_file = LabLayout(name, DEFAULT_NODES).state_file
        try:
            state = json.loads(state_file.read_text())
        except FileNotFoundError as error:
            raise LabError(
                f"lab {name!r} is not up: {state_file} does not exist (run"
                f" `python -m lab up --name {name}`)"
            ) from error
        return cls(name, len(state["nodes"]), len(state.get("ops_hosts", [])))

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def nodes(self) -> list[str]:
        return self.layout.node_names

    @property
    def registry(self) -> str:
        return self.layout.registry

    @property
    def inventory_path(self) -> Path:
        return self.layout.inventory_path

    @property
    def nas_dir(self) -> Path:
        return self.layout.nas_dir

    def node_ip(self, node: str) -> str:
        return self.layout.node_ip(node)

    @property
    def ops_hosts(self) -> list[str]:
        return self.layout.ops_host_names

    @property
    def host_ip(self) -> str:
        """The flow host's own address on the lab fabric: where a Prefect server that the ops
        hosts' workers reach listens."""
        return self.layout.host_ip

    def on_ops_host(self, ops_host: str) -> list[str]:
        """The command prefix that runs a command on an ops host: in its network namespace, on
        the host's filesystem (the lab's keys, inventory and NAS at the same paths, as a team
        mounts them on its ops machines)."""
        return in_netns(self.layout.ops_host_netns(ops_host))

    def docker_socket(self, node: str) -> Path:
        return self.layout.docker_socket(node)

    def ssh_target(self, node: str) -> SshTarget:
        return SshTarget(
            host=self.layout.node_ip(node),
            port=22,
            user="root",
            identity_file=str(self.layout.identity_file),
            known_hosts=str(self.layout.known_hosts),
        )

    def ssh_targets(self) -> dict[str, SshTarget]:
        return {node: self.ssh_target(node) for node in self.nodes}

    @property
    def hub_url(self) -> str:
        return self.layout.hub_url

    @property
    def hub_repos_dir(self) -> Path:
        return self.layout.hub_repos_dir

    def up(self) -> float:
        """Bring the lab up; returns the seconds it took. Remains of a crashed lab go first, but
        never a lab that a live process brought up (its tests or bench would fail under it)."""
        started = time.monotonic()
        self._refuse_if_in_use()
        _check_prerequisites()
        self.down()
        check_subnet_is_free(self.layout)
        try:
            write_node_files(self.layout)
            create_network(self.layout)
            lab_daemons.start_daemons(self.layout)
            write_inventory(self.layout)
            self._owner_file.write_text(f"{os.getpid()}\n")
        except BaseException:
            self.down()
            raise
        return time.monotonic() - started

    @property
    def _owner_file(self) -> Path:
        # In the state dir: `down` removes it with the rest.
        return self.layout.state_dir / "owner.pid"

    def _refuse_if_in_use(self) -> None:
        try:
            owner = int(self._owner_file.read_text())
        except (FileNotFoundError, ValueError):
            return
        if owner == os.getpid() or not alive(owner):
            return
        try:
            command = Path(f"/proc/{owner}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            command = "?"
        raise LabError(
            f"lab {self.name!r} is up and in use by process {owner} ({command.strip()[:120]}):"
            " bringing it up again would tear it down under that process. Give this one another"
            " name (SPARKDEPLOY_TEST_LAB for the tests, --name for `python -m lab up`), or stop"
            f" process {owner} first."
        )

    def down(self) -> float:
        """Remove every trace of the lab (also of a crashed one); returns the seconds it took."""
        started = time.monotonic()
        teardown.remove_lab(self.layout)
        return time.monotonic() - started

    def remains(self) -> list[str]:
        """What of this lab exists on the machine: namespaces, cgroup dirs, host link, state dir,
        mounts."""
        return teardown.remains(self.layout)

    def status(self) -> dict[str, Any]:
        """The lab's addresses and which of its recorded processes are alive."""
        layout = self.layout
        state = lab_daemons.read_state(layout)
        return {
            "name": self.name,
            "up": state is not None,
            "subnet": layout.subnet,
            "host_ip": layout.host_ip,
            "registry": layout.registry,
            "inventory": str(layout.inventory_path),
            "nas": str(layout.nas_dir),
            "nodes": {node: layout.node_ip(node) for node in self.nodes},
            "ops_hosts": {ops: layout.ops_host_ip(ops) for ops in self.ops_hosts},
            "processes": {
                what: {"pid": pid, "alive": alive(pid)}
                for what, pid in (state["pids"].items() if state else [])
            },
            "remains": [] if state else self.remains(),
        }

    # ---------------------------------------------------------------- fault switches

    def daemons(self) -> list[str]:
        """What stop_daemon and start_daemon take: registry, hub, <node>/sshd, <node>/dockerd."""
        return lab_daemons.daemon_names(self.layout)

    def stop_daemon(self, daemon: str) -> None:
        """One of the lab's daemons gone, as when it crashed or was stopped: its process ended
        (for a node's sshd, every SSH session of the node with it, so no open connection
        outlives it). Returns once it has exited; start_daemon brings it back."""
        lab_daemons.stop_daemon(self.layout, daemon)

    def start_daemon(self, daemon: str) -> int:
        """A stopped daemon started again as `up` started it (a node's in the node's namespaces),
        once it answers; its new PID is recorded."""
        return lab_daemons.start_daemon(self.layout, daemon)

    def lose_ops_host(self, ops_host: str) -> None:
        """Every process on an ops host SIGKILLed at once, as when the host loses power: its
        worker and the flow runs under it (which Prefect starts in sessions of their own)."""
        kill_at_once(netns_pids(self.layout.ops_host_netns(ops_host)), ops_host)

    def daemon_pid(self, daemon: str) -> int:
        """The PID recorded for one of daemons() (a node's sshd is its first process, whose
        namespaces and /proc/PID/root are the node's)."""
        return lab_daemons.daemon_pid(self.layout, daemon)

    def node_path(self, node: str, path: str) -> Path:
        """A path as the node sees it (its own mounts), from the host: under /proc/PID/root of
        the node's sshd, its symlinks followed there (an absolute one, like the node's /var/tmp
        -> /tmp, would otherwise lead back to the host's)."""
        root = Path(f"/proc/{self.daemon_pid(f'{node}/sshd')}/root")
        resolved = Path("/")
        parts = list(Path(path).parts[1:])
        for _ in range(40):
            if not parts:
                return root / resolved.relative_to("/")
            here = resolved / parts.pop(0)
            target = root / here.relative_to("/")
            if target.is_symlink():
                link = Path(os.readlink(target))
                parts = [*link.parts[1:], *parts] if link.is_absolute() else [*link.parts, *parts]
                resolved = Path("/") if link.is_absolute() else resolved
            else:
                resolved = here
        raise LabError(f"{path} on {node}: too many symlinks")


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, mounts, dockerd): run it as root")
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if not Path(REGISTRY_BINARY).exists():
        missing.append(REGISTRY_BINARY)
    if missing:
        raise LabError(
            f"the lab needs {', '.join(missing)}: run scripts/setup (installs docker.io"
            " openssh-server docker-registry busybox-static iproute2)"
        )
    if not MACHINE_ID.is_file():
        raise LabError(
            f"the lab gives each node its own {MACHINE_ID} by mounting a file over the host's,"
            " and this host has none: create it with `systemd-machine-id-setup` (or"
            f" `dbus-uuidgen --ensure={MACHINE_ID}`)"
        )


__all__ = ["REGISTRY_PORT", "Lab"]
