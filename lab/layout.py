"""Names, addresses and paths of one lab, all derived from its name.

Two labs with different names (say one per person, or the test suite's next to a demo's) get
different namespaces, host link, cgroup dirs, state dir and /24, so they can run side by side.
The /24 lives in 10.64.0.0/10 and is only ever configured inside namespaces the lab creates,
plus the host end of the one veth that reaches the lab's bridge.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from sparkdeploy.errors import LabError
from sparkdeploy.spec.project import lab_root

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_NAME = "lab"
DEFAULT_NODES = 3
MAX_NODES = 32
MAX_OPS_HOSTS = 8
# Ops hosts' addresses start here in the lab's /24, far from the nodes' (.11 to .42).
OPS_HOST_FIRST_OCTET = 201
FABRIC_NETDEV = "enp1s0f1np1"
REGISTRY_PORT = 5000
HUB_PORT = 8080
ENGINE_IMAGE = "lab/vllm-standin"
# Engine runtimes installed on the host (lab.vllm_runtime), mounted read-only at this path in
# every lab container, as a real node's image would carry its engine.
CONTAINER_RUNTIMES_DIR = "/opt/lab-runtimes"


def runtimes_dir() -> Path:
    """Shared by every lab: outside their state dirs, so a new lab reuses what is installed."""
    return lab_root() / "runtimes"


_NAME_PATTERN = re.compile(r"[a-z][a-z0-9-]{0,19}")


@dataclass(frozen=True)
class LabLayout:
    name: str
    node_count: int
    state_root: Path = field(default_factory=lab_root)
    # Hosts on the lab fabric without sshd or dockerd, where Prefect workers run as on a team's
    # ops machines (README: Running it for a team).
    ops_host_count: int = 0

    def __post_init__(self) -> None:
        if not _NAME_PATTERN.fullmatch(self.name):
            raise LabError(
                f"lab name {self.name!r} is not usable: it names namespaces and cgroup dirs, so it"
                " must be 1-20 characters of a-z, 0-9 and '-', starting with a letter"
                " (e.g. --name lab2)"
            )
        if not 1 <= self.node_count <= MAX_NODES:
            raise LabError(
                f"--nodes {self.node_count} is out of range for lab {self.name!r}: choose 1 to"
                f" {MAX_NODES}"
            )
        if not 0 <= self.ops_host_count <= MAX_OPS_HOSTS:
            raise LabError(
                f"--ops-hosts {self.ops_host_count} is out of range for lab {self.name!r}: choose"
                f" 0 to {MAX_OPS_HOSTS}"
            )

    @property
    def _digest(self) -> bytes:
        return hashlib.sha256(self.name.encode()).digest()

    @property
    def subnet_prefix(self) -> str:
        """The first three octets of the lab's /24, e.g. '10.93.17'."""
        return f"10.{64 + self._digest[0] % 64}.{self._digest[1]}"

    @property
    def subnet(self) -> str:
        return f"{self.subnet_prefix}.0/24"

    @property
    def host_ip(self) -> str:
        return f"{self.subnet_prefix}.1"

    @property
    def registry_ip(self) -> str:
        return f"{self.subnet_prefix}.2"

    @property
    def registry(self) -> str:
        return f"{self.registry_ip}:{REGISTRY_PORT}"

    @property
    def hub_url(self) -> str:
        """The lab's Hugging Face hub server, beside the registry in the bridge namespace."""
        return f"http://{self.registry_ip}:{HUB_PORT}"

    @property
    def hub_storage_ip(self) -> str:
        """A second address of the bridge namespace: the hub's storage host, another origin
        than the hub, as the real hub's LFS storage is."""
        return f"{self.subnet_prefix}.3"

    @property
    def hub_storage_url(self) -> str:
        return f"http://{self.hub_storage_ip}:{HUB_PORT}"

    @property
    def hub_repos_dir(self) -> Path:
        return self.state_dir / "hub-repos"

    @property
    def host_link(self) -> str:
        """Host end of the veth into the bridge namespace (interface names are <= 15 chars)."""
        return f"lab{self._digest.hex()[:8]}"

    @property
    def bridge_netns(self) -> str:
        return f"lab-{self.name}-net"

    @property
    def node_names(self) -> list[str]:
        return [f"node{rank + 1}" for rank in range(self.node_count)]

    def node_ip(self, node: str) -> str:
        return f"{self.subnet_prefix}.{10 + self._node_number(node)}"

    @property
    def ops_host_names(self) -> list[str]:
        return [f"ops{number + 1}" for number in range(self.ops_host_count)]

    def ops_host_ip(self, ops_host: str) -> str:
        return f"{self.subnet_prefix}.{OPS_HOST_FIRST_OCTET - 1 + self._ops_host_number(ops_host)}"

    def ops_host_netns(self, ops_host: str) -> str:
        self._ops_host_number(ops_host)
        return f"lab-{self.name}-{ops_host}"

    def ops_host_bridge_port(self, ops_host: str) -> str:
        return f"opsport{self._ops_host_number(ops_host)}"

    def machine_id(self, node: str) -> str:
        """The node's /etc/machine-id (32 hex digits): its own, and the same each time the lab
        is brought up, as a real machine keeps its id across reboots."""
        self._node_number(node)
        return hashlib.sha256(f"sparkdeploy-lab:{self.name}:{node}".encode()).hexdigest()[:32]

    def node_netns(self, node: str) -> str:
        return f"lab-{self.name}-{node}"

    def node_bridge_port(self, node: str) -> str:
        return f"port{self._node_number(node)}"

    def cgroup_parent(self, node: str) -> str:
        """The cgroup dir (in every hierarchy) under which the node's dockerd puts containers."""
        return f"lab-{self.name}-{node}"

    @property
    def cgroup_prefix(self) -> str:
        return f"lab-{self.name}-"

    @property
    def netns_prefix(self) -> str:
        return f"lab-{self.name}-"

    @property
    def state_dir(self) -> Path:
        return self.state_root / self.name

    def node_dir(self, node: str) -> Path:
        return self.state_dir / node

    @property
    def nas_dir(self) -> Path:
        return self.state_dir / "nas"

    @property
    def inventory_path(self) -> Path:
        return self.state_dir / "cluster.toml"

    @property
    def identity_file(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def docker_socket(self, node: str) -> Path:
        """The node's /run/docker.sock as the host sees it (the node's /run is a bind of this)."""
        return self.node_dir(node) / "run" / "docker.sock"

    def _node_number(self, node: str) -> int:
        if node not in self.node_names:
            raise LabError(
                f"lab {self.name!r} has no node {node!r}; its nodes are"
                f" {', '.join(self.node_names)}"
            )
        return int(node.removeprefix("node"))

    def _ops_host_number(self, ops_host: str) -> int:
        if ops_host not in self.ops_host_names:
            raise LabError(
                f"lab {self.name!r} has no ops host {ops_host!r}; its ops hosts are"
                f" {', '.join(self.ops_host_names) or 'none (lab up --ops-hosts N)'}"
            )
        return int(ops_host.removeprefix("ops"))
