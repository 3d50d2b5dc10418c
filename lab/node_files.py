"""The files a lab starts from, written before any of its daemons: the SSH keys (the client's,
each node's host key, known_hosts), each node's sshd and dockerd config, /etc/hosts and
machine id and the dirs lab.nodeinit mounts over the host's for the node, the registry's config,
and the shared NAS, hub and runtime dirs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lab.layout import LabLayout, runtimes_dir


@dataclass(frozen=True)
class _KeyPair:
    """An Ed25519 key: the private half as OpenSSH writes it, the public one as a key line."""

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


def write_file(path: Path, content: str | bytes, mode: int = 0o644) -> None:
    """The file with exactly this content and mode, its parent dirs made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode() if isinstance(content, str) else content
    path.write_bytes(data)
    path.chmod(mode)


def write_node_files(layout: LabLayout) -> None:
    """Every file and dir the lab's daemons start from, with fresh keys."""
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    (layout.nas_dir / "hf-cache").mkdir(parents=True, exist_ok=True)
    (layout.nas_dir / "runs").mkdir(parents=True, exist_ok=True)
    layout.hub_repos_dir.mkdir(parents=True, exist_ok=True)
    runtimes_dir().mkdir(parents=True, exist_ok=True)
    client = _KeyPair.generate()
    write_file(layout.identity_file, client.private_openssh, 0o600)
    write_file(layout.identity_file.with_suffix(".pub"), client.public_line + "\n")
    hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
        f"{layout.node_ip(node)} {node}\n" for node in layout.node_names
    )
    known_hosts = []
    for node in layout.node_names:
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
        write_file(etc_ssh / "ssh_host_ed25519_key", host_key.private_openssh, 0o600)
        write_file(etc_ssh / "ssh_host_ed25519_key.pub", host_key.public_line + "\n")
        write_file(etc_ssh / "authorized_keys", client.public_line + "\n", 0o600)
        write_file(etc_ssh / "sshd_config", sshd_config(layout.node_ip(node)))
        write_file(
            node_dir / "etc-docker" / "daemon.json",
            json.dumps(daemon_config(layout.registry, layout.cgroup_parent(node)), indent=2),
        )
        write_file(node_dir / "hosts", hosts)
        write_file(node_dir / "machine-id", layout.machine_id(node) + "\n", 0o444)
        known_hosts.append(f"{layout.node_ip(node)} {host_key.public_line}\n")
    write_file(layout.known_hosts, "".join(known_hosts))
    registry_dir = layout.state_dir / "registry"
    registry_dir.mkdir(exist_ok=True)
    write_file(
        layout.state_dir / "registry.yml",
        "version: 0.1\n"
        "log:\n  level: warn\n"
        f"storage:\n  filesystem:\n    rootdirectory: {registry_dir}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {layout.registry}\n",
    )


def sshd_config(node_ip: str) -> str:
    """A node's /etc/ssh/sshd_config: root by key only, on the node's fabric address."""
    return (
        f"ListenAddress {node_ip}:22\n"
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


def daemon_config(registry: str, cgroup_parent: str) -> dict[str, Any]:
    """A node's /etc/docker/daemon.json: the lab registry as its mirror, its containers under
    the node's cgroup dir, and no iptables or bridge of its own on the shared host."""
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
        "insecure-registries": [registry],
        "registry-mirrors": [f"http://{registry}"],
        "exec-opts": ["native.cgroupdriver=cgroupfs"],
        "cgroup-parent": "/" + cgroup_parent,
        "shutdown-timeout": 1,
        "log-level": "warn",
    }
