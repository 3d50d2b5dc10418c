"""The lab's daemons: the registry and the hub in the bridge's namespace, and on each node its
nodeinit (which starts the node's dockerd and becomes its sshd). Started, waited for until each
answers, their PIDs recorded in the state file; one stopped and started again as a fault."""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from lab.layout import HUB_PORT, LabLayout
from lab.network import in_netns, netns_pids
from lab.node_files import write_file
from lab.processes import alive, command_name, spawn_daemon, terminate
from sparkdeploy.errors import LabError
from sparkdeploy.node.docker_facts import EngineApi

READY_TIMEOUT_S = 30
NODEINIT = Path(__file__).resolve().parent / "nodeinit.py"
REGISTRY_BINARY = "/usr/bin/docker-registry"
# A node's daemons as lab.nodeinit starts them (in the node's namespaces, its config files).
NODE_DAEMON_ARGV = {
    "sshd": ["/usr/sbin/sshd", "-D", "-e", "-f", "/etc/ssh/sshd_config"],
    "dockerd": ["/usr/sbin/dockerd", "--config-file", "/etc/docker/daemon.json"],
}
# The listener and every session process (OpenSSH 9.8 split the sessions into sshd-session).
SSHD_COMMANDS = frozenset({"sshd", "sshd-session"})

# By the daemon's name in an error: (the PID whose death means it never answers, whether it does).
ReadinessChecks = dict[str, tuple[int, Callable[[], bool]]]


def daemon_names(layout: LabLayout) -> list[str]:
    """The names the state file records PIDs by: registry, hub, <node>/sshd, <node>/dockerd."""
    return ["registry", "hub"] + [
        f"{node}/{program}" for node in layout.node_names for program in ("sshd", "dockerd")
    ]


def start_daemons(layout: LabLayout) -> None:
    """Every daemon of the lab started, once each answers; their PIDs in the state file."""
    pids = {
        "registry": spawn_daemon(
            _bridge_daemon_argv(layout, "registry"), _daemon_log(layout, "registry")
        ),
        "hub": spawn_daemon(_bridge_daemon_argv(layout, "hub"), _daemon_log(layout, "hub")),
    }
    for node in layout.node_names:
        pids[f"{node}/sshd"] = spawn_daemon(
            [
                *in_netns(layout.node_netns(node)),
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
    _wait_for(layout, _readiness_checks(layout, pids))
    _write_state(layout, pids)


def read_state(layout: LabLayout) -> dict[str, Any] | None:
    """What `lab up` recorded (name, nodes, ops hosts, daemons' PIDs); None if it is not up."""
    if not layout.state_file.exists():
        return None
    state: dict[str, Any] = json.loads(layout.state_file.read_text())
    return state


def daemon_pid(layout: LabLayout, daemon: str) -> int:
    """The PID the state file records for the daemon (LabError if the lab has no such one)."""
    return _recorded_pids_with(layout, daemon)[daemon]


def stop_daemon(layout: LabLayout, daemon: str) -> None:
    """Lab.stop_daemon: a node's sshd goes with every SSH session of the node."""
    pids = _recorded_pids_with(layout, daemon)
    node, _, program = daemon.partition("/")
    doomed = {pids[daemon]}
    if program == "sshd":
        doomed |= {
            pid for pid in netns_pids(layout.node_netns(node)) if command_name(pid) in SSHD_COMMANDS
        }
    terminate({pid for pid in doomed if alive(pid)})


def start_daemon(layout: LabLayout, daemon: str) -> int:
    """Lab.start_daemon: a node's daemon enters the namespaces of the node's other daemon, so
    that one must still run (the node's mount namespace ends with its last process)."""
    pids = _recorded_pids_with(layout, daemon)
    if alive(pids[daemon]):
        raise LabError(f"lab {layout.name!r}: {daemon} is running already (PID {pids[daemon]})")
    node, _, program = daemon.partition("/")
    if program:
        sibling = pids[f"{node}/{'dockerd' if program == 'sshd' else 'sshd'}"]
        if not alive(sibling):
            raise LabError(
                f"lab {layout.name!r}: {node} has neither sshd nor dockerd running, so its"
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
        argv = _bridge_daemon_argv(layout, daemon)
    pids[daemon] = spawn_daemon(argv, _daemon_log(layout, daemon))
    _wait_for(layout, _readiness_checks(layout, {daemon: pids[daemon]}))
    state = json.loads(layout.state_file.read_text())
    write_file(layout.state_file, json.dumps({**state, "pids": pids}, indent=2))
    return pids[daemon]


def _recorded_pids(layout: LabLayout) -> dict[str, int]:
    try:
        state = json.loads(layout.state_file.read_text())
    except FileNotFoundError as error:
        raise LabError(f"lab {layout.name!r} is not up") from error
    return {what: int(pid) for what, pid in state["pids"].items()}


def _recorded_pids_with(layout: LabLayout, daemon: str) -> dict[str, int]:
    """The recorded PIDs; LabError naming the lab's daemons if `daemon` is not one."""
    pids = _recorded_pids(layout)
    if daemon not in pids:
        raise LabError(
            f"lab {layout.name!r} has no daemon {daemon!r}; it has {daemon_names(layout)}"
        )
    return pids


def _bridge_daemon_argv(layout: LabLayout, daemon: str) -> list[str]:
    """The registry's or the hub's command, in the bridge's namespace."""
    in_bridge = in_netns(layout.bridge_netns)
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


def _daemon_log(layout: LabLayout, daemon: str) -> Path:
    node, _, program = daemon.partition("/")
    if program:
        return layout.node_dir(node) / f"{program}.log"
    return layout.state_dir / f"{daemon}.log"


def _readiness_checks(layout: LabLayout, pids: dict[str, int]) -> ReadinessChecks:
    """What answers once each daemon is up, with the process whose death means it never
    will (a node's sshd and dockerd both hang off its nodeinit at start-up)."""
    checks: ReadinessChecks = {}
    if "registry" in pids:
        checks["registry"] = (pids["registry"], partial(_http_ok, f"http://{layout.registry}/v2/"))
    if "hub" in pids:
        checks["hub"] = (pids["hub"], partial(_http_ok, f"{layout.hub_url}/_lab/stats"))
    for node in layout.node_names:
        sshd = pids.get(f"{node}/sshd")
        dockerd = pids.get(f"{node}/dockerd", sshd)
        if sshd is not None:
            checks[f"{node} sshd"] = (sshd, partial(_ssh_banner, layout.node_ip(node)))
        if dockerd is not None:
            checks[f"{node} dockerd"] = (dockerd, partial(_docker_ping, layout.docker_socket(node)))
    return checks


def _wait_for(layout: LabLayout, checks: ReadinessChecks) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = dict(checks)
    while pending:
        for what, (pid, check) in list(pending.items()):
            if check():
                del pending[what]
            elif not alive(pid):
                raise LabError(f"lab {layout.name!r}: {what} died during start; {_logs(layout)}")
        if pending and time.monotonic() > deadline:
            raise LabError(
                f"lab {layout.name!r}: {', '.join(pending)} not ready after"
                f" {READY_TIMEOUT_S} s; {_logs(layout)}"
            )
        if pending:
            time.sleep(0.05)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


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


def _logs(layout: LabLayout) -> str:
    """The tail of every daemon's log, for an error that says why one did not start."""
    logs = [layout.state_dir / "registry.log", layout.state_dir / "hub.log"]
    for node in layout.node_names:
        node_dir = layout.node_dir(node)
        logs += [node_dir / name for name in ("nodeinit.log", "dockerd.log", "sshd.log")]
    tails = [
        f"{log}: {log.read_text(errors='replace').strip()[-400:]}"
        for log in logs
        if log.exists() and log.stat().st_size
    ]
    return "logs: " + (" | ".join(tails) if tails else "all empty")


def _write_state(layout: LabLayout, pids: dict[str, int]) -> None:
    """The state file: the lab's nodes, ops hosts and daemons' PIDs (each node's dockerd's from
    its pidfile), which `status`, Lab.existing and the fault switches read back."""
    for node in layout.node_names:
        pid_file = layout.node_dir(node) / "run" / "docker.pid"
        pids[f"{node}/dockerd"] = int(pid_file.read_text())
    state = {
        "name": layout.name,
        "nodes": layout.node_names,
        "ops_hosts": layout.ops_host_names,
        "pids": pids,
    }
    write_file(layout.state_file, json.dumps(state, indent=2))
