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
(sparkdeploy.model.project.lab_root: /srv/sparkdeploy-lab unless SPARKDEPLOY_LAB_ROOT says
otherwise);
`down` removes it all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lab.layout import (
    CONTAINER_RUNTIMES_DIR,
    DEFAULT_NAME,
    DEFAULT_NODES,
    FABRIC_NETDEV,
    HUB_PORT,
    REGISTRY_PORT,
    LabLayout,
    runtimes_dir,
)
from sparkdeploy.errors import LabError
from sparkdeploy.node.probe import EngineApi
from sparkdeploy.remote.ssh import SshTarget

COMMAND_TIMEOUT_S = 15
READY_TIMEOUT_S = 30
STOP_TIMEOUT_S = 4
STOP_ROUNDS = 3
NODEINIT = Path(__file__).resolve().parent / "nodeinit.py"
NETNS_DIR = Path("/run/netns")
CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUIRED_TOOLS = ("ip", "nsenter", "unshare", "mount", "dockerd", "containerd", "sshd")
REGISTRY_BINARY = "/usr/bin/docker-registry"
# A node's daemons as lab.nodeinit starts them (in the node's namespaces, its config files).
NODE_DAEMON_ARGV = {
    "sshd": ["/usr/sbin/sshd", "-D", "-e", "-f", "/etc/ssh/sshd_config"],
    "dockerd": ["/usr/sbin/dockerd", "--config-file", "/etc/docker/daemon.json"],
}
# The listener and every session process (OpenSSH 9.8 split the sessions into sshd-session).
SSHD_COMMANDS = frozenset({"sshd", "sshd-session"})
MACHINE_ID = Path("/etc/machine-id")
LAB_NODE_MEMORY_GIB = 6.0
LAB_ENGINE_OVERHEAD_GIB = 2.0


def run(argv: list[str], *, stdin: bytes | None = None, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run a host command (argv, never a shell); LabError with its stderr when it fails."""
    try:
        completed = subprocess.run(
            argv, input=stdin, capture_output=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise LabError(f"`{' '.join(argv)}` did not finish within {timeout} s") from error
    if completed.returncode != 0:
        raise LabError(
            f"`{' '.join(argv)}` exited {completed.returncode}:"
            f" {completed.stderr.decode(errors='replace').strip()[-800:]}"
        )
    return completed.stdout.decode()


def _ip_batch(commands: list[str], netns: str | None = None) -> None:
    """Several `ip` commands in one process (each `ip` start costs a few ms)."""
    argv = ["ip", *(["-n", netns] if netns else []), "-batch", "-"]
    run(argv, stdin="\n".join(commands).encode())


@dataclass(frozen=True)
class _KeyPair:
    private_openssh: bytes
    public_line: str

    @classmethod
    def generate(cls) -> _KeyPair:
        key = Ed25519PrivateKey.generate()
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        )
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        return cls(private, public.decode())


def _write(path: Path, content: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    path.write_bytes(data)
    path.chmod(mode)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML spelling for {value!r}")


def _toml_table(header: str, values: dict[str, object]) -> str:
    lines = [header, *(f"{key} = {_toml_value(value)}" for key, value in values.items())]
    return "\n".join(lines) + "\n"


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
        return ["nsenter", f"--net={NETNS_DIR / self.layout.ops_host_netns(ops_host)}", "--"]

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

    # ---------------------------------------------------------------- up

    def up(self) -> float:
        """Bring the lab up; returns the seconds it took. Remains of a crashed lab go first."""
        started = time.monotonic()
        _check_prerequisites()
        self.down()
        self._check_subnet_is_free()
        try:
            self._write_node_files()
            self._create_network()
            pids = self._start_daemons()
            self._wait_until_ready(pids)
            self._write_state(pids)
            self._write_inventory()
        except BaseException:
            self.down()
            raise
        return time.monotonic() - started

    def _check_subnet_is_free(self) -> None:
        prefix = self.layout.subnet_prefix + "."
        for line in run(["ip", "-o", "-4", "addr", "show"]).splitlines():
            if f" {prefix}" in line:
                raise LabError(
                    f"lab {self.name!r} would use {self.layout.subnet}, but the host already has"
                    f" an address in it ({line.split()[1]}: {line.split()[3]}); pick another"
                    " --name (the subnet derives from it)"
                )

    def _write_node_files(self) -> None:
        layout = self.layout
        layout.state_dir.mkdir(parents=True, exist_ok=True)
        (layout.nas_dir / "hf-cache").mkdir(parents=True, exist_ok=True)
        (layout.nas_dir / "runs").mkdir(parents=True, exist_ok=True)
        layout.hub_repos_dir.mkdir(parents=True, exist_ok=True)
        runtimes_dir().mkdir(parents=True, exist_ok=True)
        client = _KeyPair.generate()
        _write(layout.identity_file, client.private_openssh, 0o600)
        _write(layout.identity_file.with_suffix(".pub"), client.public_line + "\n")
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{layout.node_ip(node)} {node}\n" for node in self.nodes
        )
        known_hosts = []
        for node in self.nodes:
            node_dir = layout.node_dir(node)
            for sub in (
                "run/sshd",
                "tmp",
                "var-upper",
                "var-work",
                "docker",
                "etc-docker",
                "home-root",
            ):
                (node_dir / sub).mkdir(parents=True, exist_ok=True)
            (node_dir / "tmp").chmod(0o1777)
            (node_dir / "var-upper" / "tmp").symlink_to("/tmp")
            host_key = _KeyPair.generate()
            etc_ssh = node_dir / "etc-ssh"
            _write(etc_ssh / "ssh_host_ed25519_key", host_key.private_openssh, 0o600)
            _write(etc_ssh / "ssh_host_ed25519_key.pub", host_key.public_line + "\n")
            _write(etc_ssh / "authorized_keys", client.public_line + "\n", 0o600)
            _write(etc_ssh / "sshd_config", self._sshd_config(node))
            _write(
                node_dir / "etc-docker" / "daemon.json",
                json.dumps(self._daemon_config(node), indent=2),
            )
            _write(node_dir / "hosts", hosts)
            _write(node_dir / "machine-id", layout.machine_id(node) + "\n", 0o444)
            known_hosts.append(f"{layout.node_ip(node)} {host_key.public_line}\n")
        _write(layout.known_hosts, "".join(known_hosts))
        registry_dir = layout.state_dir / "registry"
        registry_dir.mkdir(exist_ok=True)
        _write(
            layout.state_dir / "registry.yml",
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {registry_dir}\n"
            "  delete:\n    enabled: true\n"
            f"http:\n  addr: {layout.registry}\n",
        )

    def _sshd_config(self, node: str) -> str:
        return (
            f"ListenAddress {self.layout.node_ip(node)}:22\n"
            "HostKey /etc/ssh/ssh_host_ed25519_key\n"
            "PidFile /run/sshd.pid\n"
            # Node-private: the host's /root/.ssh is shared with every node and stays untouched.
            "AuthorizedKeysFile /etc/ssh/authorized_keys\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "PrintMotd no\n"
            "PrintLastLog no\n"
            "MaxStartups 128\n"
            "MaxSessions 64\n"
            "LogLevel ERROR\n"
            "Subsystem sftp internal-sftp\n"
        )

    def _daemon_config(self, node: str) -> dict[str, Any]:
        return {
            "data-root": "/var/lib/docker",
            "exec-root": "/run/docker",
            "pidfile": "/run/docker.pid",
            "hosts": ["unix:///run/docker.sock"],
            "storage-driver": "overlay2",
            "iptables": False,
            "ip-forward": False,
            "ip-masq": False,
            "bridge": "none",
            "insecure-registries": [self.layout.registry],
            "registry-mirrors": [f"http://{self.layout.registry}"],
            "exec-opts": ["native.cgroupdriver=cgroupfs"],
            "cgroup-parent": "/" + self.layout.cgroup_parent(node),
            "shutdown-timeout": 1,
            "log-level": "warn",
        }

    def _create_network(self) -> None:
        layout = self.layout
        bridge_ns = layout.bridge_netns
        # Every host on the fabric: (its namespace, its port on the bridge, its address).
        hosts = [
            (layout.node_netns(node), layout.node_bridge_port(node), layout.node_ip(node))
            for node in self.nodes
        ] + [
            (layout.ops_host_netns(ops), layout.ops_host_bridge_port(ops), layout.ops_host_ip(ops))
            for ops in self.ops_hosts
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

    def _start_daemons(self) -> dict[str, int]:
        layout = self.layout
        pids = {
            "registry": self._spawn(
                self._bridge_daemon_argv("registry"), self._daemon_log("registry")
            ),
            "hub": self._spawn(self._bridge_daemon_argv("hub"), self._daemon_log("hub")),
        }
        for node in self.nodes:
            pids[f"{node}/sshd"] = self._spawn(
                [
                    "nsenter",
                    f"--net={NETNS_DIR / layout.node_netns(node)}",
                    "--",
                    "unshare",
                    "--mount",
                    "--uts",
                    "--propagation",
                    "private",
                    "--",
                    sys.executable,
                    "-S",
                    "-E",
                    str(NODEINIT),
                    str(layout.node_dir(node)),
                    node,
                ],
                layout.node_dir(node) / "nodeinit.log",
            )
        return pids

    def _bridge_daemon_argv(self, daemon: str) -> list[str]:
        """The registry's or the hub's command, in the bridge's namespace."""
        layout = self.layout
        in_bridge = ["nsenter", f"--net={NETNS_DIR / layout.bridge_netns}", "--"]
        if daemon == "registry":
            return [*in_bridge, REGISTRY_BINARY, "serve", str(layout.state_dir / "registry.yml")]
        return [
            *in_bridge,
            sys.executable,
            "-m",
            "lab.hub",
            "--repos",
            str(layout.hub_repos_dir),
            "--host",
            layout.registry_ip,
            "--port",
            str(HUB_PORT),
            "--storage-host",
            layout.hub_storage_ip,
            "--storage-port",
            str(HUB_PORT),
        ]

    def _daemon_log(self, daemon: str) -> Path:
        node, _, program = daemon.partition("/")
        if program:
            return self.layout.node_dir(node) / f"{program}.log"
        return self.layout.state_dir / f"{daemon}.log"

    @staticmethod
    def _spawn(argv: list[str], log_path: Path) -> int:
        """Start a lab daemon in its own session, so it outlives the `lab up` command."""
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")},
            )
        # Reaped by _reap_when_done once it exits, so it never lingers as a zombie.
        _spawned[process.pid] = process
        return process.pid

    def _wait_until_ready(self, pids: dict[str, int]) -> None:
        self._wait_for(self._readiness_checks(pids))

    def _readiness_checks(self, pids: dict[str, int]) -> dict[str, tuple[int, Any]]:
        """What answers once each daemon is up, with the process whose death means it never
        will (a node's sshd and dockerd both hang off its nodeinit at start-up)."""
        layout = self.layout
        checks: dict[str, tuple[int, Any]] = {}
        if "registry" in pids:
            checks["registry"] = (pids["registry"], self._registry_answers)
        if "hub" in pids:
            checks["hub"] = (pids["hub"], self._hub_answers)
        for node in self.nodes:
            ip = layout.node_ip(node)
            socket_path = layout.docker_socket(node)
            sshd = pids.get(f"{node}/sshd")
            dockerd = pids.get(f"{node}/dockerd", sshd)
            if sshd is not None:
                checks[f"{node} sshd"] = (sshd, lambda ip=ip: _ssh_banner(ip))
            if dockerd is not None:
                checks[f"{node} dockerd"] = (dockerd, lambda path=socket_path: _docker_ping(path))
        return checks

    def _wait_for(self, checks: dict[str, tuple[int, Any]]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = dict(checks)
        while pending:
            for what, (pid, check) in list(pending.items()):
                if check():
                    del pending[what]
                elif not _alive(pid):
                    raise LabError(f"lab {self.name!r}: {what} died during start; {self._logs()}")
            if pending and time.monotonic() > deadline:
                raise LabError(
                    f"lab {self.name!r}: {', '.join(pending)} not ready after"
                    f" {READY_TIMEOUT_S} s; {self._logs()}"
                )
            if pending:
                time.sleep(0.05)

    def _registry_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.layout.registry}/v2/", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _hub_answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.layout.hub_url}/_lab/stats", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    @property
    def hub_url(self) -> str:
        return self.layout.hub_url

    @property
    def hub_repos_dir(self) -> Path:
        return self.layout.hub_repos_dir

    def _logs(self) -> str:
        logs = [self.layout.state_dir / "registry.log", self.layout.state_dir / "hub.log"]
        for node in self.nodes:
            node_dir = self.layout.node_dir(node)
            logs += [node_dir / name for name in ("nodeinit.log", "dockerd.log", "sshd.log")]
        tails = []
        for log in logs:
            if log.exists() and log.stat().st_size:
                tails.append(f"{log}: {log.read_text(errors='replace').strip()[-400:]}")
        return "logs: " + (" | ".join(tails) if tails else "all empty")

    def _write_state(self, pids: dict[str, int]) -> None:
        for node in self.nodes:
            pid_file = self.layout.node_dir(node) / "run" / "docker.pid"
            pids[f"{node}/dockerd"] = int(pid_file.read_text())
        state = {"name": self.name, "nodes": self.nodes, "ops_hosts": self.ops_hosts, "pids": pids}
        _write(self.layout.state_file, json.dumps(state, indent=2))

    def _write_inventory(self) -> None:
        layout = self.layout
        text = (
            f"# Generated by `python -m lab up --name {self.name}`; removed by `lab down`.\n"
            f"name = {_toml_value(self.name)}\n"
            f'known_hosts = "{layout.known_hosts.name}"\n\n'
            + _toml_table(
                "[ssh]",
                {
                    "user": "root",
                    "port": 22,
                    "identity_file": layout.identity_file.name,
                    "connect_timeout_s": 10,
                },
            )
            + "\n"
            + _toml_table(
                "[node_defaults]",
                {
                    "gpus": 1,
                    "fabric_netdev": FABRIC_NETDEV,
                    # The lab's fabric is a veth: "auto" finds no RDMA device, NCCL uses sockets.
                    "roce_hcas": "auto",
                    "gid_index": "auto",
                    # The nodes share the host's memory and /proc/meminfo: what one may use.
                    "memory_gib": LAB_NODE_MEMORY_GIB,
                    # Engines on the CPU, in host RAM: the page cache counts as available.
                    "unified_memory": False,
                    # The real engine beside its KV cache, measured (docs/real-engine.md).
                    "engine_overhead_gib": LAB_ENGINE_OVERHEAD_GIB,
                },
            )
            + "".join(
                "\n"
                + _toml_table(
                    "[[nodes]]",
                    {"name": node, "host": layout.node_ip(node), "fabric_ip": layout.node_ip(node)},
                )
                for node in self.nodes
            )
            + "\n"
            + _toml_table(
                "[nas]",
                {
                    "hf_cache": str(layout.nas_dir / "hf-cache"),
                    "runs_dir": str(layout.nas_dir / "runs"),
                },
            )
            + "\n"
            + _toml_table(
                "[node_paths]",
                {
                    "engram_root": "/var/tmp/engram-local",
                    "composed_root": "/var/tmp/sparkdeploy/composed",
                },
            )
            + "\n"
            + _toml_table(
                "[docker]",
                {
                    "gpus": "",
                    # The real engine's runtime (lab.vllm_runtime), read-only in every container.
                    "run_options": [
                        "--volume",
                        f"{runtimes_dir()}:{CONTAINER_RUNTIMES_DIR}:ro",
                    ],
                    # No RDMA in the lab, and the sandbox may not raise the memlock hard limit.
                    "ulimits": {"stack": "67108864"},
                    "registry": layout.registry,
                    "drop_page_cache": False,
                },
            )
            + "\n"
            + _toml_table("[hub]", {"endpoint": layout.hub_url})
            + "\n"
            + _toml_table(
                "[nccl.lab]",
                {"NCCL_IB_DISABLE": "1"},
            )
        )
        _write(layout.inventory_path, text)

    # ---------------------------------------------------------------- down

    def down(self) -> float:
        """Remove every trace of the lab (also of a crashed one); returns the seconds it took."""
        started = time.monotonic()
        netns_names = self._existing_netns()
        cgroup_dirs = self._existing_cgroup_dirs()
        self._remove_containers()
        self._stop_processes(netns_names, cgroup_dirs)
        for directory in cgroup_dirs:
            _remove_cgroup_tree(directory)
        if netns_names:
            _ip_batch([f"netns delete {name}" for name in netns_names])
        self._delete_host_link()
        self._unmount_leftovers()
        shutil.rmtree(self.layout.state_dir, ignore_errors=True)
        if self.layout.state_dir.exists():
            raise LabError(f"lab {self.name!r}: could not remove {self.layout.state_dir}")
        return time.monotonic() - started

    def _delete_host_link(self) -> None:
        """The veth's host end. Deleting the bridge namespace takes it along too, but the kernel
        does that asynchronously: it can vanish between the check and the delete."""
        link = Path("/sys/class/net") / self.layout.host_link
        if not link.exists():
            return
        try:
            run(["ip", "link", "delete", self.layout.host_link])
        except LabError:
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while link.exists():
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def remains(self) -> list[str]:
        """What of this lab exists on the machine: namespaces, cgroup dirs, state, processes."""
        found = [f"netns {name}" for name in self._existing_netns()]
        found += [f"cgroup {path}" for path in self._existing_cgroup_dirs()]
        if (Path("/sys/class/net") / self.layout.host_link).exists():
            found.append(f"link {self.layout.host_link}")
        if self.layout.state_dir.exists():
            found.append(f"dir {self.layout.state_dir}")
        found += [f"mount {mount}" for mount in self._leftover_mounts()]
        return found

    def _existing_netns(self) -> list[str]:
        pattern = re.compile(rf"{re.escape(self.layout.netns_prefix)}(net|node\d+|ops\d+)")
        if not NETNS_DIR.is_dir():
            return []
        return sorted(entry.name for entry in NETNS_DIR.iterdir() if pattern.fullmatch(entry.name))

    def _existing_cgroup_dirs(self) -> list[Path]:
        pattern = re.compile(rf"{re.escape(self.layout.cgroup_prefix)}node\d+")
        found = []
        for hierarchy in _cgroup_hierarchies():
            found += [entry for entry in hierarchy.iterdir() if pattern.fullmatch(entry.name)]
        return sorted(found)

    def _remove_containers(self) -> None:
        """Containers go through their dockerd first, so it cleans its mounts and cgroups."""
        sockets = sorted(self.layout.state_dir.glob("node*/run/docker.sock"))
        with ThreadPoolExecutor(max_workers=max(1, len(sockets))) as pool:
            list(pool.map(_remove_all_containers, sockets))

    def _stop_processes(self, netns_names: list[str], cgroup_dirs: list[Path]) -> None:
        """Every process in the lab's namespaces and cgroups, until none is left: the scan is
        repeated because one may fork between a scan and its signal (an SSH session starting,
        dockerd spawning a shim)."""
        for _ in range(STOP_ROUNDS):
            pids: set[int] = set()
            for name in netns_names:
                pids.update(_netns_pids(name))
            for directory in cgroup_dirs:
                pids.update(_cgroup_pids(directory))
            pids.discard(os.getpid())
            pids = {pid for pid in pids if _alive(pid)}
            if not pids:
                return
            _terminate(pids)
        raise LabError(
            f"lab {self.name!r}: processes kept appearing in its namespaces and cgroups after"
            f" {STOP_ROUNDS} rounds of SIGTERM/SIGKILL; the last: {_describe(pids)}"
        )

    def _leftover_mounts(self) -> list[str]:
        state_dir = str(self.layout.state_dir)
        mounts = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            mount_point = line.split()[4]
            if mount_point == state_dir or mount_point.startswith(state_dir + "/"):
                mounts.append(mount_point)
        return mounts

    def _unmount_leftovers(self) -> None:
        for mount_point in sorted(self._leftover_mounts(), reverse=True):
            run(["umount", "--lazy", mount_point])

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """The lab's addresses and which of its recorded processes are alive."""
        layout = self.layout
        state = json.loads(layout.state_file.read_text()) if layout.state_file.exists() else None
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
                what: {"pid": pid, "alive": _alive(pid)}
                for what, pid in (state["pids"].items() if state else [])
            },
            "remains": [] if state else self.remains(),
        }

    # ---------------------------------------------------------------- fault switches

    def daemons(self) -> list[str]:
        """What stop_daemon and start_daemon take: registry, hub, <node>/sshd, <node>/dockerd."""
        return ["registry", "hub"] + [
            f"{node}/{program}" for node in self.nodes for program in ("sshd", "dockerd")
        ]

    def stop_daemon(self, daemon: str) -> None:
        """One of the lab's daemons gone, as when it crashed or was stopped: its process ended
        (for a node's sshd, every SSH session of the node with it, so no open connection
        outlives it). Returns once it has exited; start_daemon brings it back."""
        pids = self._recorded_pids()
        if daemon not in pids:
            raise LabError(f"lab {self.name!r} has no daemon {daemon!r}; it has {self.daemons()}")
        node, _, program = daemon.partition("/")
        doomed = {pids[daemon]}
        if program == "sshd":
            doomed |= {
                pid
                for pid in _netns_pids(self.layout.node_netns(node))
                if _command_name(pid) in SSHD_COMMANDS
            }
        _terminate({pid for pid in doomed if _alive(pid)})

    def start_daemon(self, daemon: str) -> int:
        """A stopped daemon started again as `up` started it (a node's in the node's namespaces),
        once it answers; its new PID is recorded."""
        pids = self._recorded_pids()
        if daemon not in pids:
            raise LabError(f"lab {self.name!r} has no daemon {daemon!r}; it has {self.daemons()}")
        if _alive(pids[daemon]):
            raise LabError(f"lab {self.name!r}: {daemon} is running already (PID {pids[daemon]})")
        node, _, program = daemon.partition("/")
        if program:
            sibling = pids[f"{node}/{'dockerd' if program == 'sshd' else 'sshd'}"]
            if not _alive(sibling):
                raise LabError(
                    f"lab {self.name!r}: {node} has neither sshd nor dockerd running, so its"
                    " namespaces are gone; bring the lab down and up again"
                )
            argv = [
                "nsenter",
                f"--target={sibling}",
                "--net",
                "--mount",
                "--uts",
                "--",
                *NODE_DAEMON_ARGV[program],
            ]
        else:
            argv = self._bridge_daemon_argv(daemon)
        pids[daemon] = self._spawn(argv, self._daemon_log(daemon))
        self._wait_for(self._readiness_checks({daemon: pids[daemon]}))
        state = json.loads(self.layout.state_file.read_text())
        _write(self.layout.state_file, json.dumps({**state, "pids": pids}, indent=2))
        return pids[daemon]

    def lose_ops_host(self, ops_host: str) -> None:
        """Every process on an ops host SIGKILLed at once, as when the host loses power: its
        worker and the flow runs under it (which Prefect starts in sessions of their own)."""
        doomed = _netns_pids(self.layout.ops_host_netns(ops_host))
        _signal_all(doomed, signal.SIGKILL)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(_alive(pid) for pid in doomed):
            if time.monotonic() > deadline:
                raise LabError(f"{ops_host}: still alive after SIGKILL: {_describe(doomed)}")
            time.sleep(0.05)

    def daemon_pid(self, daemon: str) -> int:
        """The PID recorded for one of daemons() (a node's sshd is its first process, whose
        namespaces and /proc/PID/root are the node's)."""
        pids = self._recorded_pids()
        if daemon not in pids:
            raise LabError(f"lab {self.name!r} has no daemon {daemon!r}; it has {self.daemons()}")
        return pids[daemon]

    def _recorded_pids(self) -> dict[str, int]:
        try:
            state = json.loads(self.layout.state_file.read_text())
        except FileNotFoundError as error:
            raise LabError(f"lab {self.name!r} is not up") from error
        return {what: int(pid) for what, pid in state["pids"].items()}


_spawned: dict[int, subprocess.Popen[bytes]] = {}


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


def _cgroup_hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones and the v2 tree)."""
    hierarchies = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount_point, fstype, *_ = line.split()
        if fstype in ("cgroup", "cgroup2") and mount_point.startswith(str(CGROUP_ROOT)):
            hierarchies.append(Path(mount_point))
    return hierarchies


def _cgroup_pids(directory: Path) -> set[int]:
    pids: set[int] = set()
    for procs in directory.rglob("cgroup.procs"):
        try:
            pids.update(int(pid) for pid in procs.read_text().split())
        except OSError:
            continue
    return pids


def _remove_cgroup_tree(directory: Path) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for current, _, _ in sorted(os.walk(directory, topdown=False), key=lambda w: -len(w[0])):
        while True:
            try:
                os.rmdir(current)
                break
            except FileNotFoundError:
                break
            except OSError as error:
                # EBUSY while the last task of a just-killed container is still exiting.
                if time.monotonic() > deadline:
                    raise LabError(f"cannot remove cgroup dir {current}: {error}") from error
                time.sleep(0.02)


def _remove_all_containers(socket_path: Path) -> None:
    engine = EngineApi(str(socket_path), timeout=10)
    try:
        status, containers = engine.get("/containers/json?all=1")
        if status != 200:
            raise OSError(f"GET /containers/json on {socket_path} answered {status}: {containers}")
        for container in containers:
            engine.request("DELETE", f"/containers/{container['Id']}?force=1&v=1")
    except OSError:
        # No dockerd behind the socket (crashed lab): its containers die with the cgroup sweep.
        return


def _alive(pid: int) -> bool:
    """Whether any thread of the process still runs. A zombie leader is not enough: in an
    exit_group the leader can turn Z while its other threads are still exiting and holding the
    node's mounts and namespaces. A zombie that is not our child (re-parented to init, which
    reaps when it likes) is gone; ours are reaped here."""
    process = _spawned.get(pid)
    if process is not None:
        # waitpid returns only once every thread of the process has exited.
        return process.poll() is None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return False
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return True
    return False


def _netns_pids(netns: str) -> set[int]:
    return {int(pid) for pid in run(["ip", "netns", "pids", netns]).split()}


def _command_name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _describe(pids: Iterable[int]) -> str:
    """PIDs with their command lines, for an error that says what would not stop."""
    described = []
    for pid in sorted(pids):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            command = " ".join(part.decode(errors="replace") for part in argv if part)
        except (FileNotFoundError, ProcessLookupError):
            command = "(gone)"
        described.append(f"{pid} ({command[:120] or 'kernel thread or zombie'})")
    return ", ".join(described)


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


def _terminate(pids: set[int]) -> None:
    """SIGTERM, then SIGKILL what is left after STOP_TIMEOUT_S; returns once every thread of
    every one has exited (LabError naming them if any outlives the SIGKILL by STOP_TIMEOUT_S)."""
    _signal_all(pids, signal.SIGTERM)
    for signum in (signal.SIGKILL, None):
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pids and time.monotonic() < deadline:
            pids = {pid for pid in pids if _alive(pid)}
            if pids:
                time.sleep(0.02)
        if not pids:
            break
        if signum is None:
            raise LabError(
                f"lab processes still running {STOP_TIMEOUT_S} s after SIGKILL: {_describe(pids)};"
                " look for a process stuck in the kernel (state D in /proc/PID/stat), e.g. on an"
                " unreachable mount, and remove its cause before `python -m lab down` again"
            )
        _signal_all(pids, signum)
    for pid in list(_spawned):
        if _spawned[pid].poll() is not None:
            del _spawned[pid]


def _ssh_banner(ip: str) -> bool:
    try:
        with socket.create_connection((ip, 22), timeout=1) as connection:
            return connection.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _docker_ping(socket_path: Path) -> bool:
    try:
        status, _ = EngineApi(str(socket_path), timeout=1).request("GET", "/_ping")
    except OSError:
        return False
    return status == 200


__all__ = ["REGISTRY_PORT", "Lab"]
