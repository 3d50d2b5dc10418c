"""Cluster inventories (clusters/<name>.toml): the nodes, the NAS, docker and NCCL settings.

The file format is documented in docs/inventory.md. Per-node
values are merged here ([ssh] and [node_defaults] under each [[nodes]] entry), so everything
downstream sees one complete `Node` per machine.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from sparkdeploy.errors import InventoryError, PlanError
from sparkdeploy.spec.toml_validation import validate_document
from sparkdeploy.spec.tomlfile import KeyPath, TomlDocument, format_key, load_toml

# Matched with fullmatch: `$` would let a name end in a newline.
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Like mlx5_0 or rocep1s0f1: NCCL_IB_HCA joins the list with commas, so a name holds none.
_HCA_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Set per node by the plan; a profile that also set them would be overridden silently.
_PER_NODE_ENV = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "UCX_NET_DEVICES",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "VLLM_HOST_IP",
)

RoceHcas = list[str] | Literal["auto"]
GidIndex = int | Literal["auto"]

# Upper bounds that catch a slip of the keyboard, far above any machine's figure.
MAX_GPUS_PER_NODE = 64
MAX_MEMORY_GIB = 16384.0
MAX_CONNECT_TIMEOUT_S = 3600.0

_Value = TypeVar("_Value")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _not_empty(fix: str) -> AfterValidator:
    """A string that may not be empty or blank (an empty one would not fall back to the default);
    `fix` says what to write instead."""

    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"must not be empty: {fix}")
        return value

    return AfterValidator(check)


def _at_most(limit: float, unit: str, fix: str) -> AfterValidator:
    def check(value: float) -> float:
        if value > limit:
            raise ValueError(f"{value} is more than {limit:g} {unit}: {fix}")
        return value

    return AfterValidator(check)


SshUser = Annotated[
    str,
    _not_empty(
        "write the SSH user's name, or remove the key for the default ([ssh] user, else root)"
    ),
]
IdentityFile = Annotated[
    str,
    _not_empty(
        "write the path of the SSH private key (absolute, or relative to this file), or remove "
        "the key on a node to use [ssh]'s"
    ),
]
FabricNetdev = Annotated[
    str,
    _not_empty(
        "write the netdev carrying fabric_ip (e.g. enp1s0f1np1), or remove the key on a node to "
        "use [node_defaults]'s"
    ),
]
ConnectTimeout = Annotated[
    float,
    Field(gt=0),
    _at_most(MAX_CONNECT_TIMEOUT_S, "seconds", "write how long to wait for a node's SSH answer"),
]
GpuCount = Annotated[
    int,
    Field(ge=1),
    _at_most(MAX_GPUS_PER_NODE, "GPUs on one node", "write the node's GPU count"),
]
MemoryGib = Annotated[
    float,
    Field(gt=0),
    _at_most(
        MAX_MEMORY_GIB, "GiB on one node", "write the node's memory in GiB (a GB10's: 121.63)"
    ),
]


def _check_roce_hcas(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    if not (isinstance(value, list) and value and all(isinstance(h, str) for h in value)):
        raise ValueError('must be "auto" or a non-empty list of HCA names like ["rocep1s0f1"]')
    for name in value:
        if not _HCA_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not an HCA name: letters, digits, '_', '.', '-' only, like "
                '"mlx5_0" or "rocep1s0f1"; list each HCA as its own string'
            )
    return value


def _check_gid_index(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError('must be "auto" or a GID index (an integer ≥ 0, without quotes)')


class SshDefaults(_Strict):
    user: SshUser = "root"
    port: int = Field(default=22, ge=1, le=65535)
    identity_file: IdentityFile | None = None
    connect_timeout_s: ConnectTimeout = 10.0


# A DGX Spark's GB10: the memory CUDA reports as its total (docs/field.md#nodes-and-fabric).
GB10_MEMORY_GIB = 121.63
# Per rank, beside weights and KV cache: CUDA context, activation peak, CUDA graphs, NCCL buffers
# (docs/field.md#memory-fit).
DEFAULT_ENGINE_OVERHEAD_GIB = 4.0


class NodeDefaults(_Strict):
    gpus: GpuCount = 1
    fabric_netdev: FabricNetdev | None = None
    memory_gib: MemoryGib = GB10_MEMORY_GIB
    unified_memory: bool = True
    engine_overhead_gib: float = Field(default=DEFAULT_ENGINE_OVERHEAD_GIB, ge=0)
    roce_hcas: RoceHcas = "auto"
    gid_index: GidIndex = "auto"
    # The node's local disk write rate in GB/s (10^9 bytes), for the preview's expected times.
    disk_gb_per_s: float | None = Field(default=None, gt=0)

    _roce = field_validator("roce_hcas", mode="before")(_check_roce_hcas)
    _gid = field_validator("gid_index", mode="before")(_check_gid_index)


class NodeEntry(_Strict):
    """One [[nodes]] table: its own keys plus any [ssh]/[node_defaults] key overridden."""

    name: str
    host: Annotated[str, _not_empty("write the node's SSH address (a DNS name or an IP)")]
    fabric_ip: str
    user: SshUser | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: IdentityFile | None = None
    connect_timeout_s: ConnectTimeout | None = None
    gpus: GpuCount | None = None
    fabric_netdev: FabricNetdev | None = None
    memory_gib: MemoryGib | None = None
    unified_memory: bool | None = None
    engine_overhead_gib: float | None = Field(default=None, ge=0)
    roce_hcas: RoceHcas | None = None
    gid_index: GidIndex | None = None
    disk_gb_per_s: float | None = Field(default=None, gt=0)

    _roce = field_validator("roce_hcas", mode="before")(_check_roce_hcas)
    _gid = field_validator("gid_index", mode="before")(_check_gid_index)

    @field_validator("name")
    @classmethod
    def _container_safe(cls, name: str) -> str:
        if not _NODE_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a usable node name: letters, digits, '_', '.', '-' only "
                "(it becomes part of container names)"
            )
        return name

    @field_validator("fabric_ip")
    @classmethod
    def _ipv4(cls, fabric_ip: str) -> str:
        # IPv4 only: the endpoint URL (http://<fabric_ip>:<port>) takes it unbracketed, and the
        # boot finds the node's RoCE v2 GID by its IPv4 address.
        try:
            ipaddress.IPv4Address(fabric_ip)
        except ValueError:
            raise ValueError(
                f"{fabric_ip!r} is not an IPv4 address: write the node's address on the fabric, "
                "like 192.168.100.11"
            ) from None
        return fabric_ip


class Nas(_Strict):
    hf_cache: str
    runs_dir: str
    # How fast the flow host and the nodes read the NAS, in GB/s (10^9 bytes): the preview's
    # expected times of hashing a cache to adopt it and of an Engram copy's reads.
    read_gb_per_s: float | None = Field(default=None, gt=0)


class NodePaths(_Strict):
    composed_root: str = "/var/tmp/sparkdeploy/composed"


# Keys inventories had and no longer read, with what to do instead.
RETIRED_KEYS: dict[KeyPath, str] = {
    ("node_paths", "engram_root"): (
        "each Engram copy goes where its recipe's [[composed_model.local_files]] host path says"
        " (keep that on the filesystem of composed_root, which hardlinks it); remove the key"
    ),
}


# What the field runs vLLM with (docs/field.md): RDMA needs unlimited locked memory.
DEFAULT_ULIMITS = {"memlock": "-1", "stack": "67108864"}


class DockerSettings(_Strict):
    gpus: str = "all"
    run_options: list[str] = Field(default_factory=list)
    ulimits: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_ULIMITS))
    registry: (
        Annotated[str, _not_empty("write the registry's host:port, or remove the key for none")]
        | None
    ) = None
    drop_page_cache: bool = False
    # How fast a node pulls an image (from its registry or the cluster's), in GB/s: the
    # preview's expected times of a pull or a ship.
    pull_gb_per_s: float | None = Field(default=None, gt=0)


class HubSettings(_Strict):
    # The Hugging Face endpoint the flow host prefetches from; None: HF_ENDPOINT, else the hub.
    endpoint: (
        Annotated[
            str,
            _not_empty("write the hub's URL, or remove the key for HF_ENDPOINT or the public hub"),
        ]
        | None
    ) = None
    # Send the HF token to a plain-http endpoint (it crosses the network in clear text).
    allow_http_token: bool = False
    # How fast the flow host downloads from the hub into the NAS, in GB/s (10^9 bytes): the
    # preview's expected download times.
    download_gb_per_s: float | None = Field(default=None, gt=0)


class InventoryFile(_Strict):
    """The inventory file as written."""

    name: (
        Annotated[
            str, _not_empty("write the cluster's name, or remove the key to use the file's name")
        ]
        | None
    ) = None
    known_hosts: Annotated[
        str,
        _not_empty(
            "write the path of the nodes' known_hosts file, or remove the key for "
            "~/.ssh/known_hosts"
        ),
    ] = "~/.ssh/known_hosts"
    ssh: SshDefaults = Field(default_factory=SshDefaults)
    node_defaults: NodeDefaults = Field(default_factory=NodeDefaults)
    nodes: list[NodeEntry] = Field(min_length=1)
    nas: Nas
    node_paths: NodePaths = Field(default_factory=NodePaths)
    docker: DockerSettings = Field(default_factory=DockerSettings)
    hub: HubSettings = Field(default_factory=HubSettings)
    nccl: dict[str, dict[str, str]] = Field(default_factory=dict)


class Node(_Strict):
    """A node with every default applied; paths on the flow host are absolute."""

    name: str
    host: str
    port: int
    user: str
    identity_file: str
    connect_timeout_s: float
    gpus: int
    fabric_ip: str
    fabric_netdev: str
    roce_hcas: RoceHcas
    gid_index: GidIndex
    memory_gib: float
    unified_memory: bool
    engine_overhead_gib: float
    disk_gb_per_s: float | None = None

    @property
    def home(self) -> str:
        """The SSH user's home on the node: what a leading `~` in a recipe mount means."""
        return "/root" if self.user == "root" else f"/home/{self.user}"


class Cluster(_Strict):
    name: str
    path: str
    known_hosts: str
    nodes: list[Node]
    nas: Nas
    node_paths: NodePaths
    docker: DockerSettings
    hub: HubSettings
    nccl: dict[str, dict[str, str]]

    def missing_files(self) -> list[str]:
        """Flow-host files the SSH connections need that do not exist, one problem each."""
        problems = []
        if Path(self.known_hosts).is_dir():
            problems.append(
                f"{self.path}: known_hosts {self.known_hosts} is a directory: point known_hosts "
                "at the file holding the nodes' host keys"
            )
        elif not Path(self.known_hosts).is_file():
            problems.append(
                f"{self.path}: known_hosts {self.known_hosts} does not exist: create it with the "
                "nodes' host keys (ssh-keyscan -H HOST >> FILE, after checking the keys)"
            )
        for identity in sorted({node.identity_file for node in self.nodes}):
            users = [node.name for node in self.nodes if node.identity_file == identity]
            if Path(identity).is_dir():
                problems.append(
                    f"{self.path}: identity_file {identity} (nodes {', '.join(users)}) is a "
                    "directory: point identity_file at the private key file (e.g. "
                    f"{Path(identity) / 'id_ed25519'})"
                )
            elif not Path(identity).is_file():
                problems.append(
                    f"{self.path}: identity_file {identity} (nodes {', '.join(users)}) does not "
                    "exist: create the key or point identity_file at it"
                )
        return problems

    def select(self, count: int, names: Sequence[str] | None = None) -> list[Node]:
        """`count` nodes: the named ones in the given order, else the first `count` listed."""
        by_name = {node.name: node for node in self.nodes}
        if names:
            problems = []
            for name in names:
                if name not in by_name:
                    close = difflib.get_close_matches(name, by_name, n=1)
                    hint = (
                        f"did you mean '{close[0]}'?" if close else f"known: {', '.join(by_name)}"
                    )
                    problems.append(
                        f"{self.path}: no node named '{name}' in cluster {self.name}; {hint}"
                    )
            repeated = sorted({name for name in names if list(names).count(name) > 1})
            if repeated:
                problems.append(f"node {', '.join(repeated)} selected twice; name each node once")
            if len(names) != count:
                problems.append(
                    f"{len(names)} nodes selected ({', '.join(names)}) but the recipe needs "
                    f"required_nodes = {count}; name exactly {count}"
                )
            if problems:
                raise PlanError("\n".join(problems))
            return [by_name[name] for name in names]
        if len(self.nodes) < count:
            raise PlanError(
                f"{self.path}: the recipe needs {count} nodes, cluster {self.name} has "
                f"{len(self.nodes)}; add nodes to the inventory or use a smaller recipe"
            )
        return self.nodes[:count]


def _resolve_file(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def _or_default(value: _Value | None, default: _Value) -> _Value:
    """A node's own value when the file sets it, else the default (an empty one was refused)."""
    return default if value is None else value


def _merge_node(
    inventory: InventoryFile, index: int, base: Path, where: Callable[[KeyPath], str]
) -> tuple[Node | None, list[str]]:
    entry = inventory.nodes[index]
    ssh, defaults = inventory.ssh, inventory.node_defaults
    identity = _or_default(entry.identity_file, ssh.identity_file)
    netdev = _or_default(entry.fabric_netdev, defaults.fabric_netdev)
    problems = []
    if identity is None:
        problems.append(
            f"{where(('nodes', index))}: node {entry.name} has no identity_file: set it in [ssh] "
            "or on the node"
        )
    if netdev is None:
        problems.append(
            f"{where(('nodes', index))}: node {entry.name} has no fabric_netdev: set it in "
            "[node_defaults] or on the node (the netdev carrying fabric_ip)"
        )
    if identity is None or netdev is None:
        return None, problems
    node = Node(
        name=entry.name,
        host=entry.host,
        port=_or_default(entry.port, ssh.port),
        user=_or_default(entry.user, ssh.user),
        identity_file=_resolve_file(identity, base),
        connect_timeout_s=_or_default(entry.connect_timeout_s, ssh.connect_timeout_s),
        gpus=_or_default(entry.gpus, defaults.gpus),
        fabric_ip=entry.fabric_ip,
        fabric_netdev=netdev,
        roce_hcas=_or_default(entry.roce_hcas, defaults.roce_hcas),
        gid_index=_or_default(entry.gid_index, defaults.gid_index),
        memory_gib=_or_default(entry.memory_gib, defaults.memory_gib),
        unified_memory=_or_default(entry.unified_memory, defaults.unified_memory),
        engine_overhead_gib=_or_default(entry.engine_overhead_gib, defaults.engine_overhead_gib),
        disk_gb_per_s=_or_default(entry.disk_gb_per_s, defaults.disk_gb_per_s),
    )
    return node, problems


def _duplicates(
    values: list[str],
    what: str,
    where: Callable[[KeyPath], str],
    *,
    ignore_case: bool = False,
) -> list[str]:
    """`values[i]` is node i's; each value used again names the node that has it first.

    `ignore_case`: values that differ only in case are the same (DNS names).
    """
    problems = []
    first: dict[str, int] = {}
    for index, value in enumerate(values):
        same = value.lower() if ignore_case else value
        if same in first:
            earlier = first[same]
            written = values[earlier]
            spelt = "" if written == value else f" as {written} (host names ignore case)"
            problems.append(
                f"{where(('nodes', index))}: {what} {value} is already used by nodes[{earlier}] "
                f"({where(('nodes', earlier))}){spelt}; each node needs its own"
            )
        else:
            first[same] = index
    return problems


def _setting_problems(
    inventory: InventoryFile, where: Callable[[KeyPath], str], broken: frozenset[str]
) -> list[str]:
    """Paths and NCCL profiles; a table in `broken` (its problem already reported) is skipped."""
    problems = []
    paths: list[tuple[KeyPath, str]] = []
    if "nas" not in broken:
        paths += [(("nas", "hf_cache"), inventory.nas.hf_cache)]
        paths += [(("nas", "runs_dir"), inventory.nas.runs_dir)]
    if "node_paths" not in broken:
        paths += [(("node_paths", "composed_root"), inventory.node_paths.composed_root)]
    for key, value in paths:
        if not value.startswith("/"):
            problems.append(f"{where(key)}: {format_key(key)} {value!r} must be an absolute path")
    for profile, env in {} if "nccl" in broken else inventory.nccl.items():
        for variable in env:
            at = where(("nccl", profile, variable))
            if not _ENV_NAME.fullmatch(variable):
                problems.append(
                    f"{at}: nccl.{profile}: {variable!r} is not an env variable name: letters, "
                    "digits and _, not first a digit; rename it"
                )
            elif variable in _PER_NODE_ENV:
                problems.append(
                    f"{at}: nccl.{profile}.{variable} is set per node from the node's fabric "
                    "settings; remove it from the profile"
                )
    return problems


def _node_problems(
    inventory: InventoryFile, base: Path, where: Callable[[KeyPath], str], broken: frozenset[str]
) -> tuple[list[Node], list[str]]:
    """Every node with its defaults applied, and the problems of the [[nodes]] entries."""
    if "nodes" in broken:
        return [], []
    entries = inventory.nodes
    problems = _duplicates([e.name for e in entries], "node name", where)
    problems += _duplicates([e.fabric_ip for e in entries], "fabric_ip", where)
    if "ssh" in broken or "node_defaults" in broken:
        return [], problems
    problems += _duplicates(
        [f"{e.host}:{_or_default(e.port, inventory.ssh.port)}" for e in entries],
        "SSH host:port",
        where,
        ignore_case=True,
    )
    nodes = []
    for index in range(len(entries)):
        node, node_problems = _merge_node(inventory, index, base, where)
        problems += node_problems
        if node is not None:
            nodes.append(node)
    return nodes, problems


def cluster_from_document(document: TomlDocument) -> Cluster:
    """The cluster of a parsed inventory; raises InventoryError listing every problem."""
    if "model" in document.data and "nodes" not in document.data:
        # Checked as an inventory, a recipe would be every one of its keys an unknown key.
        raise InventoryError(
            f"{document.where(('model',))}: model: this is a recipe, not a cluster inventory: "
            "move it to recipes/<name>/recipe.toml; nothing else in it was checked"
        )
    validated = validate_document(document, InventoryFile, RETIRED_KEYS)
    inventory, broken = validated.value, validated.broken
    base = document.path.parent
    nodes, node_problems = _node_problems(inventory, base, document.where, broken)
    problems = [
        *validated.problems,
        *_setting_problems(inventory, document.where, broken),
        *node_problems,
    ]
    if problems:
        raise InventoryError("\n".join(document.in_file_order(problems)))
    return Cluster(
        name=_or_default(inventory.name, document.path.stem),
        path=str(document.path),
        known_hosts=_resolve_file(inventory.known_hosts, base),
        nodes=nodes,
        nas=inventory.nas,
        node_paths=inventory.node_paths,
        docker=inventory.docker,
        hub=inventory.hub,
        nccl=inventory.nccl,
    )


def load_cluster(path: Path) -> Cluster:
    """Load an inventory; raises InventoryError listing every problem, one per line.

    Files on the flow host (identity files, known_hosts) are not checked here, so a plan can be
    made for a cluster this machine cannot reach; `Cluster.missing_files()` checks them.
    """
    return cluster_from_document(load_toml(path, InventoryError))
